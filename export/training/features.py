"""Target features for drafter training, computed once by the deployed OpenVINO target.

Contract:
- `precompute_features(model_dir, data_dir, out_dir, max_len=768, ...)` runs the exported target of
  an ovdflash model directory (the runtime's default graph: paged attention, `target_hidden` +
  `logits_indices`, compiled with the runtime's own settings, `precision.compile_config`)
  over every stored sequence of `data_dir` (truncated to `max_len`, as training truncates), and
  appends to `out_dir`:
    * `feats.f16`  [rows, F] float16: the concatenated target-layer features of every position;
    * `preds.u16`  [rows] uint16: the target's greedy next token after position q (0 before the
      last prompt position, where no label needs it);
    * with `topk=K > 0`, also `topk_ids.u16` / `topk_logp.f16` [rows, K]: the target's K most
      likely next tokens after position q and their log-probabilities over the full vocabulary
      (the soft labels of distillation, `train --kd-weight`); zeros where preds are 0;
    * `index.jsonl`: one row per sequence `{"offset", "row", "len", "topk"}`, `offset` being the
      sequence's offset in the data directory's tokens.bin, `row` its first row in the arrays,
      `topk` whether its top-k rows were written (a directory made without top-k and resumed
      with it keeps zero rows, flagged false, for the sequences computed before);
    * `meta.json`: model directory, compile settings, max_len, F, K.
  Resumable: rows are appended after their arrays; on start the arrays are cut to the last
  indexed row and sequences already present are skipped. Data directories only ever grow, so
  re-running picks up new sequences. K is fixed once set (0 -> K pads, K -> another K is an error).
- `precompute_features_many(model_dir, [(data_dir, out_dir), ...])` does it for several directories
  in one pass. Sequences run in token order, and the prefix a sequence shares with the previous
  one (a follow-up's earlier conversation, the prompt of another reply) is not run again
  (`PrefixScorer`; `share_prefixes=False` runs each from position 0). On the shipped multi-turn
  data that skips over half the positions: 2.0-2.2x the stored rows a second on 2 idle Zen 4
  cores (models/smollm2_dflash/TRAINING.md).
- `fill_topk(model_dir, data_dir, out_dir, ...)` computes the top-k rows of the sequences stored
  without them (flagged false) in place, and flags them; features and predictions are left as
  they are. Resumable: the index is rewritten (atomically) every few sequences, and a sequence
  whose flag was not yet written is simply computed again.
- `FeatureFile(out_dir)` reads it back (memory-mapped): `lookup(offset, length) -> (feats f16
  [length, F], preds [length]) | None`; `lookup_topk(offset, length) -> (ids [length, K], logp
  [length, K]) | None`. Training (`train.PrecomputedStore`) uses it instead of
  running the frozen torch target every step.

Why: on 2 CPU cores the torch target forward was the slowest part of a training step, and it is
the same computation every epoch. The OpenVINO int8 target is also what verifies the drafts at
run time, so its features and greedy tokens are exactly what the drafter sees and must match.
Run: `python -m ovdflash_export.training.features --model MODEL_DIR --data models/data/smollm2/turn1 --out DIR`.
Give every data directory in one run (`--data A --data B ...`), so prefixes shared across them run once.
`--inference-precision bf16` computes them 3.2x faster on an AMX CPU and 1.9x on Zen 4 (AVX-512
bf16, no AMX; features within ~0.3 %, greedy next tokens 99.2 % equal to f32's; TRAINING.md); `meta.json` records the precision, and a directory never mixes two.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import numpy as np

from .data import read_index, read_tokens

FEATS, PREDS, INDEX, META = "feats.f16", "preds.u16", "index.jsonl", "meta.json"
TOPK_IDS, TOPK_LOGP = "topk_ids.u16", "topk_logp.f16"


class FeatureFile:
    """Read side of a precomputed feature directory (memory-mapped, re-opened by `refresh`)."""

    def __init__(self, out_dir):
        self.dir = Path(out_dir)
        meta_path = self.dir / META
        if not meta_path.is_file():
            raise FileNotFoundError(f"{self.dir} holds no precomputed features (no {META})")
        self.meta = json.loads(meta_path.read_text())
        self.width = int(self.meta["width"])
        self.topk = int(self.meta.get("topk", 0))
        self.refresh()

    def refresh(self) -> None:
        rows = read_index(self.dir)
        self.rows = {r["offset"]: (r["row"], r["len"]) for r in rows}
        self.with_topk = {r["offset"] for r in rows if r.get("topk")}
        n = max((r["row"] + r["len"] for r in rows), default=0)
        self.feats = np.memmap(self.dir / FEATS, dtype=np.float16, mode="r", shape=(n, self.width)) if n else None
        self.preds = np.memmap(self.dir / PREDS, dtype=np.uint16, mode="r", shape=(n,)) if n else None
        k = self.topk if n else 0
        self.topk_ids = np.memmap(self.dir / TOPK_IDS, dtype=np.uint16, mode="r", shape=(n, k)) if k else None
        self.topk_logp = np.memmap(self.dir / TOPK_LOGP, dtype=np.float16, mode="r", shape=(n, k)) if k else None

    def _rows_of(self, offset: int, length: int) -> slice | None:
        hit = self.rows.get(offset)
        return None if hit is None or hit[1] != length else slice(hit[0], hit[0] + length)

    def lookup(self, offset: int, length: int):
        rows = self._rows_of(offset, length)
        return None if rows is None else (self.feats[rows], self.preds[rows])

    def lookup_topk(self, offset: int, length: int):
        rows = self._rows_of(offset, length) if offset in self.with_topk else None
        return None if rows is None else (self.topk_ids[rows], self.topk_logp[rows])


def top_k_log_probs(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """logits [n, V] -> (ids [n, k] uint16, log-probabilities over all V [n, k] float16), most
    likely first, ties in id order. The numpy reference of the graph's `next_ids`/`next_logp`."""
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(logits, ids, -1)
    m = logits.max(-1, keepdims=True)
    lse = m + np.log(np.exp(logits - m).sum(-1, keepdims=True))
    return ids.astype(np.uint16), (top - lse).astype(np.float16)


def add_next_token_scores(model, k: int):
    """Put the target's K most likely next tokens (`next_ids` [1, N, K] i64) and their
    log-probabilities over the whole vocabulary (`next_logp` [1, N, K] f32) on top of the runtime
    graph's `logits`, and drop `logits` as an output. In place. The order among equal values is
    not defined by OpenVINO's TopK: `ties_in_id_order` fixes it on the host.

    Why in the graph: reading [N, V] f32 logits back and ranking them in numpy cost ~1.6 ms per
    row on 2 cores, more than the target's forward of that row; this costs ~0.25 ms. (TopK with
    `stable=True` would order ties itself, but took 1.9 s for 300 rows instead of 41 ms.)"""
    import openvino as ov
    import openvino.opset13 as ops

    logits_result = model.output("logits").get_node()
    logits = logits_result.input_value(0)
    if logits.get_element_type() != ov.Type.f32:
        logits = ops.convert(logits, ov.Type.f32).output(0)
    top = ops.topk(logits, ops.constant(k, ov.Type.i64), axis=-1, mode="max", sort="value",
                   index_element_type=ov.Type.i64)
    peak = ops.gather(top.output(0), ops.constant([0], ov.Type.i64), ops.constant(-1, ov.Type.i64))
    total = ops.reduce_sum(ops.exp(ops.subtract(logits, peak)), ops.constant([-1], ov.Type.i64), keep_dims=True)
    logp = ops.subtract(top.output(0), ops.add(peak, ops.log(total)))
    for name, out in (("next_ids", top.output(1)), ("next_logp", logp.output(0))):
        result = ops.result(out)
        result.output(0).get_tensor().set_names({name})
        model.add_results([result])
    model.remove_result(logits_result)
    model.validate_nodes_and_infer_types()
    return model


def ties_in_id_order(ids: np.ndarray, logp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, K] ids and values, most likely first, with equal values reordered by id: so column 0 is
    numpy's argmax (the runtime's greedy choice) whenever the tied values fit in the K."""
    order = np.lexsort((ids, -logp), axis=-1)
    return np.take_along_axis(ids, order, -1), np.take_along_axis(logp, order, -1)


def _target_settings(model_dir: Path, config: dict | None) -> tuple[dict, dict]:
    """(compile settings: the runtime's for this model + config, manifest)."""
    from ovdflash.manifest import load_manifest
    from ovdflash.ov.precision import compile_config

    manifest = load_manifest(model_dir)
    settings, _ = compile_config(manifest, config, runner="paged")
    return settings, manifest


def _compile_target(model_dir: Path, settings: dict, manifest: dict, k: int):
    """The runtime's paged target graph (`runners.runtime_target_graph`, as compile_runners
    builds it) with its next-token scores computed in the graph (add_next_token_scores), compiled
    with `settings`."""
    import openvino as ov

    from ovdflash.manifest import TARGET_XML
    from ovdflash.ov.compile import runtime_target_graph

    core = ov.Core()
    model = runtime_target_graph(core.read_model(model_dir / TARGET_XML), manifest, "paged")
    add_next_token_scores(model, k)
    return core.compile_model(model, "CPU", settings)


def check_precision(out_dir: Path, stored_meta: dict, settings: dict) -> None:
    """One directory, one inference precision: rows of two would be a silent confound."""
    stored = stored_meta.get("compile", {}).get("INFERENCE_PRECISION_HINT")
    now = settings.get("INFERENCE_PRECISION_HINT")
    now = None if now is None else str(now)  # meta stores compile settings as strings
    if stored != now:
        raise ValueError(f"{out_dir}: stored inference precision {stored} differs from this run's {now}")


class PrefixScorer:
    """Scores sequences one after another on the `_compile_target` graph (an `OVPagedTarget` over it),
    reusing the KV cache of the longest prefix a sequence shares with the one scored before it.

    Follow-up conversations begin with the conversation they continue, and replies to one prompt
    share it, so in token order about half of a multi-turn data set's positions were already run.
    The shared prefix stays in the paged cache (`rewind`, free: the new tokens overwrite the rest
    of the previous sequence), only the new tokens run, and the prefix's features are copied from
    the previous sequence's: causal attention makes them the same values. The prefix is cut at
    `first`, so every position that needs next-token scores is run. `share=False` runs every
    sequence from position 0.

    Why paged: on the stateful graph a multi-token forward on top of a past costs 2.5-3x a fresh
    prefill per token (SmolLM2-135M, bf16, 2 Zen 4 cores: 4.3-6.0 against 1.7-1.8 ms a token),
    which ate the whole saving; paged attention runs such a suffix at 2.0-2.3 ms a token."""

    def __init__(self, compiled, width: int, max_len: int, share: bool = True):
        from ovdflash.ov.paged import OVPagedTarget

        self.target = OVPagedTarget(compiled, max_len)
        self.width, self.share = width, share
        self.tokens = np.zeros(0, dtype=np.int64)
        self.feats = np.zeros((0, width), dtype=np.float16)
        self.run_tokens = 0
        self.reused_tokens = 0

    def score(self, ids: np.ndarray, first: int):
        """(features [L, F] f16, next ids [L-first, K], log-probabilities [L-first, K]) of `ids`."""
        L = ids.size
        n = min(self.tokens.size, L, first) if self.share else 0
        differ = np.flatnonzero(self.tokens[:n] != ids[:n])
        shared = int(differ[0]) if differ.size else n
        target = self.target
        target.rewind(shared)
        target.run(ids[shared:], np.arange(first - shared, L - shared, dtype=np.int64))
        target.commit(L - shared)
        request = target.request
        next_ids, next_logp = ties_in_id_order(request.get_tensor("next_ids").data.reshape(L - first, -1),
                                               request.get_tensor("next_logp").data.reshape(L - first, -1))
        feats = np.empty((L, self.width), dtype=np.float16)
        feats[:shared] = self.feats[:shared]
        feats[shared:] = request.get_tensor("target_hidden").data.reshape(L - shared, self.width)
        self.tokens, self.feats = ids, feats
        self.run_tokens += L - shared
        self.reused_tokens += shared
        return feats, next_ids, next_logp


class _FeatureDir:
    """The append side of one feature directory: checks and (re)writes meta.json, cuts a torn
    tail, and lists the data directory's sequences not stored yet (module docstring)."""

    def __init__(self, data_dir: Path, out_dir: Path, meta: dict, settings: dict, topk: int):
        rows = read_index(data_dir)
        if not rows:
            raise ValueError(f"{data_dir}: no stored sequences (no index.jsonl rows)")
        self.data_dir, self.out_dir, self.topk = data_dir, out_dir, topk
        out_dir.mkdir(parents=True, exist_ok=True)
        meta = {**meta, "data_dir": str(data_dir)}
        meta_path = out_dir / META
        if meta_path.is_file():
            old = json.loads(meta_path.read_text())
            for key in ("max_len", "width", "target_layer_ids"):
                if old[key] != meta[key]:
                    raise ValueError(f"{out_dir}: stored {key} {old[key]} differs from this run's {meta[key]}")
            check_precision(out_dir, old, settings)
            if old.get("topk", 0) and old["topk"] != topk:
                raise ValueError(f"{out_dir}: stored topk {old['topk']} differs from this run's {topk}")
        meta_path.write_text(json.dumps(meta, indent=1))
        done = read_index(out_dir)
        self.end = max((r["row"] + r["len"] for r in done), default=0)
        # drop arrays of a sequence whose index row never got written; a directory gaining top-k
        # gets zero rows (flagged false in its index) for the sequences computed before
        self.arrays = [FEATS, PREDS] + ([TOPK_IDS, TOPK_LOGP] if topk else [])
        row_bytes = {FEATS: meta["width"] * 2, PREDS: 2, TOPK_IDS: topk * 2, TOPK_LOGP: topk * 2}
        for name in self.arrays:
            with open(out_dir / name, "ab") as f:
                f.truncate(self.end * row_bytes[name])
        with open(out_dir / INDEX, "w") as f:
            for r in done:
                f.write(json.dumps(r) + "\n")
        have = {r["offset"] for r in done}
        self.tokens = read_tokens(data_dir)
        self.todo = [r for r in rows if r["offset"] not in have and r["offset"] + r["total_len"] <= self.tokens.size]
        self.already = len(have)
        self.new_tokens = 0

    def open(self, stack: contextlib.ExitStack) -> None:
        self.files = {name: stack.enter_context(open(self.out_dir / name, "ab")) for name in self.arrays}
        self.index = stack.enter_context(open(self.out_dir / INDEX, "a"))

    def append(self, r: dict, feats: np.ndarray, first: int, next_ids: np.ndarray, next_logp: np.ndarray) -> None:
        L = feats.shape[0]
        preds = np.zeros(L, dtype=np.uint16)
        preds[first:] = next_ids[:, 0]
        out = {FEATS: feats.astype(np.float16, copy=False), PREDS: preds}
        if self.topk:
            out[TOPK_IDS] = np.zeros((L, self.topk), dtype=np.uint16)
            out[TOPK_LOGP] = np.zeros((L, self.topk), dtype=np.float16)
            out[TOPK_IDS][first:] = next_ids
            out[TOPK_LOGP][first:] = next_logp
        for name, f in self.files.items():
            f.write(out[name].tobytes())
            f.flush()
            os.fsync(f.fileno())
        self.index.write(json.dumps({"offset": r["offset"], "row": self.end, "len": int(L), "topk": bool(self.topk)}) + "\n")
        self.index.flush()
        self.end += L
        self.new_tokens += L


def precompute_features_many(model_dir, pairs, max_len: int = 768, config: dict | None = None,
                             deadline: float | None = None, log=print, topk: int = 0,
                             share_prefixes: bool = True) -> list[dict]:
    """`precompute_features` for several (data_dir, out_dir) pairs in one pass. With
    `share_prefixes` the sequences of all of them run in token order on a `PrefixScorer`, so a
    prefix shared across directories (a follow-up and the conversation it continues) runs once.
    Returns one summary per pair, each with the pass's `run_tokens` and `reused_tokens`."""
    model_dir = Path(model_dir)
    settings, manifest = _target_settings(model_dir, config)
    width = len(manifest["target_layer_ids"]) * int(manifest["target"]["hidden_size"])
    meta = {"model_dir": str(model_dir), "max_len": max_len, "width": width,
            "target_layer_ids": manifest["target_layer_ids"], "compile": {k: str(v) for k, v in settings.items()},
            "topk": topk}
    dirs = [_FeatureDir(Path(d), Path(o), meta, settings, topk) for d, o in pairs]  # checked before compiling
    compiled = _compile_target(model_dir, settings, manifest, max(topk, 1))
    assert compiled.output("target_hidden").get_partial_shape()[2].get_length() == width
    work = [(fd, r) for fd in dirs for r in fd.todo]
    for fd in dirs:
        log(f"{len(fd.todo)} sequences to run ({fd.already} already stored) from {fd.data_dir}")

    def ids_of(fd, r):
        return fd.tokens[r["offset"]:r["offset"] + r["total_len"]][:max_len].astype(np.int64)

    if share_prefixes:  # token order: sequences sharing a prefix become neighbours (big-endian bytes sort as ids)
        work.sort(key=lambda w: ids_of(*w).astype(">u2").tobytes())
    scorer = PrefixScorer(compiled, width, max_len, share=share_prefixes)
    t0, n_tok = time.time(), 0
    with contextlib.ExitStack() as opened:
        for fd in dirs:
            fd.open(opened)
        for k, (fd, r) in enumerate(work):
            if deadline is not None and time.time() > deadline:
                break
            ids = ids_of(fd, r)
            first = max(min(r["prompt_len"], ids.size) - 1, 0)  # labels need preds from the last prompt position on
            feats, next_ids, next_logp = scorer.score(ids, first)
            fd.append(r, feats, first, next_ids, next_logp)
            n_tok += ids.size
            if (k + 1) % 100 == 0:
                log(f"[{k + 1}/{len(work)}] {n_tok} tokens, {n_tok / (time.time() - t0):.0f} tok/s "
                    f"({scorer.run_tokens} run, {scorer.reused_tokens} from shared prefixes)")
    seconds = time.time() - t0
    log(f"done: {n_tok} tokens in {seconds:.0f} s ({n_tok / max(seconds, 1e-9):.0f} tok/s; "
        f"{scorer.run_tokens} run, {scorer.reused_tokens} from shared prefixes)")
    return [{"sequences": len(read_index(fd.out_dir)), "rows": fd.end, "new_tokens": fd.new_tokens,
             "seconds": round(seconds, 1), "run_tokens": scorer.run_tokens, "reused_tokens": scorer.reused_tokens}
            for fd in dirs]


def precompute_features(model_dir, data_dir, out_dir, max_len: int = 768, config: dict | None = None,
                        deadline: float | None = None, log=print, topk: int = 0, share_prefixes: bool = True) -> dict:
    """Append features and greedy predictions of every not-yet-stored sequence of `data_dir`."""
    return precompute_features_many(model_dir, [(data_dir, out_dir)], max_len, config, deadline, log, topk,
                                    share_prefixes)[0]


def fill_topk(model_dir, data_dir, out_dir, config: dict | None = None, deadline: float | None = None,
              log=print, checkpoint_every: int = 25) -> dict:
    """Write the missing top-k rows of `out_dir` (a feature directory with K > 0) in place."""
    model_dir, data_dir, out_dir = Path(model_dir), Path(data_dir), Path(out_dir)
    ff = FeatureFile(out_dir)
    if not ff.topk:
        raise ValueError(f"{out_dir} stores no top-k (meta topk 0): run the feature pass with --topk first")
    by_offset = {r["offset"]: r for r in read_index(data_dir)}
    index = read_index(out_dir)
    todo = [r for r in index if not r.get("topk") and r["offset"] in by_offset]
    log(f"{len(todo)} sequences without top-k in {out_dir}")
    if not todo:
        return {"filled": 0, "tokens": 0, "seconds": 0.0}
    settings, manifest = _target_settings(model_dir, config)
    check_precision(out_dir, ff.meta, settings)
    compiled = _compile_target(model_dir, settings, manifest, ff.topk)
    scorer = PrefixScorer(compiled, ff.width, int(ff.meta["max_len"]), share=False)
    tokens = read_tokens(data_dir)
    n = ff.feats.shape[0]
    top_ids = np.memmap(out_dir / TOPK_IDS, dtype=np.uint16, mode="r+", shape=(n, ff.topk))
    top_logp = np.memmap(out_dir / TOPK_LOGP, dtype=np.float16, mode="r+", shape=(n, ff.topk))

    def save_index():
        top_ids.flush()
        top_logp.flush()
        tmp = out_dir / (INDEX + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in index))
        os.replace(tmp, out_dir / INDEX)

    t0, n_tok, filled = time.time(), 0, 0
    for r in todo:
        if deadline is not None and time.time() > deadline:
            break
        L, row = r["len"], r["row"]
        ids = tokens[r["offset"]:r["offset"] + L].astype(np.int64)
        first = max(min(by_offset[r["offset"]]["prompt_len"], L) - 1, 0)
        _, next_ids, next_logp = scorer.score(ids, first)
        top_ids[row + first:row + L] = next_ids
        top_logp[row + first:row + L] = next_logp
        r["topk"] = True
        filled += 1
        n_tok += L
        if filled % checkpoint_every == 0:
            save_index()
            log(f"[{filled}/{len(todo)}] {n_tok} tokens, {n_tok / (time.time() - t0):.0f} tok/s")
    save_index()
    seconds = time.time() - t0
    log(f"filled top-k of {filled} sequences: {n_tok} tokens in {seconds:.0f} s")
    return {"filled": filled, "tokens": n_tok, "seconds": round(seconds, 1)}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Precompute target features for drafter training (OpenVINO).")
    ap.add_argument("--model", required=True, help="ovdflash model directory (its target IR is used)")
    ap.add_argument("--data", required=True, action="append", help="data directory (repeatable)")
    ap.add_argument("--out", required=True, help="root: one sub-directory per data directory's name")
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--topk", type=int, default=0,
                    help="also store the K most likely next tokens and their log-probabilities (soft labels)")
    ap.add_argument("--inference-precision", default=None, choices=["f32", "bf16", "f16"],
                    help="override the runtime's INFERENCE_PRECISION_HINT (bf16 is ~3x faster on AMX CPUs; "
                         "meta.json records it)")
    ap.add_argument("--no-shared-prefixes", action="store_true",
                    help="run every sequence from an empty cache (default: sequences of all --data directories "
                         "run in token order and a prefix shared with the previous one is not run again)")
    ap.add_argument("--fill-topk", action="store_true",
                    help="then compute the top-k of sequences stored without it (in place)")
    a = ap.parse_args()
    stop = time.time() + a.minutes * 60 if a.minutes else None
    config = {"INFERENCE_PRECISION_HINT": a.inference_precision} if a.inference_precision else None

    def say(line):
        print(line, flush=True)

    pairs = [(d, Path(a.out) / Path(d).resolve().name) for d in a.data]
    for summary in precompute_features_many(a.model, pairs, a.max_len, config=config, deadline=stop, log=say,
                                            topk=a.topk, share_prefixes=not a.no_shared_prefixes):
        print(json.dumps(summary), flush=True)
    if a.fill_topk:
        for d, sub in pairs:
            print(json.dumps(fill_topk(a.model, d, sub, config=config, deadline=stop, log=say)), flush=True)
