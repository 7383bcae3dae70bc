"""Target features for drafter training, computed once by the deployed OpenVINO target.

Contract:
- `precompute_features(model_dir, data_dir, out_dir, max_len=768, ...)` runs the exported target of
  an ovdflash model directory (the runtime graph: `target_hidden` + `logits_indices`, compiled with
  the runtime's own settings, `pipeline.default_compile_config`) over every stored sequence of
  `data_dir` (truncated to `max_len`, as training truncates) in one prefill each, and appends to
  `out_dir`:
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
Run: `python -m ovdflash_export.features --model MODEL_DIR --data models/smollm2/data --out DIR`.
`--inference-precision bf16` computes them 3.2x faster on an AMX CPU (features within ~0.3 %, greedy
next tokens 99.2 % equal to f32's; TRAINING.md, run 11); `meta.json` records the precision, and a
directory never mixes two.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import numpy as np

from ovdflash.ov_models import run_request

from .data import read_index

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


def score_sequence(request, ids: np.ndarray, first: int):
    """One prefill of `ids` from an empty cache on a request of the `_open_target` graph. Returns
    (features [L, F] f32, next ids [L-first, K], their log-probabilities [L-first, K]) for
    positions first..L-1, ties in id order; the arrays are the request's own (valid until its
    next call) or fresh."""
    L = ids.size
    request.reset_state()
    run_request(request, {"input_ids": ids[None], "attention_mask": np.ones((1, L), dtype=np.int64),
                          "position_ids": np.arange(L, dtype=np.int64)[None], "beam_idx": np.zeros(1, np.int32),
                          "logits_indices": np.arange(first, L, dtype=np.int64)})
    next_ids, next_logp = ties_in_id_order(request.get_tensor("next_ids").data[0],
                                           request.get_tensor("next_logp").data[0])
    return request.get_tensor("target_hidden").data[0], next_ids, next_logp


def _open_target(model_dir: Path, config: dict | None, k: int):
    """The runtime's target graph (ov_models / graphs.target_for_runtime, runtime compile settings
    + config) with its next-token scores computed in the graph (add_next_token_scores)."""
    import openvino as ov

    from ovdflash import graphs
    from ovdflash.ov_models import TARGET_XML
    from ovdflash.pipeline import default_compile_config, load_manifest

    manifest = load_manifest(model_dir)
    settings = default_compile_config(manifest)
    settings.update(config or {})
    core = ov.Core()
    model = graphs.target_for_runtime(core.read_model(model_dir / TARGET_XML), manifest["target_layer_ids"])
    add_next_token_scores(model, k)
    return core.compile_model(model, "CPU", settings), settings, manifest


def check_precision(out_dir: Path, stored_meta: dict, settings: dict) -> None:
    """One directory, one inference precision: rows of two would be a silent confound."""
    stored = stored_meta.get("compile", {}).get("INFERENCE_PRECISION_HINT")
    now = settings.get("INFERENCE_PRECISION_HINT")
    now = None if now is None else str(now)  # meta stores compile settings as strings
    if stored != now:
        raise ValueError(f"{out_dir}: stored inference precision {stored} differs from this run's {now}")


def precompute_features(model_dir, data_dir, out_dir, max_len: int = 768, config: dict | None = None,
                        deadline: float | None = None, log=print, topk: int = 0) -> dict:
    """Append features and greedy predictions of every not-yet-stored sequence of `data_dir`."""
    model_dir, data_dir, out_dir = Path(model_dir), Path(data_dir), Path(out_dir)
    rows = read_index(data_dir)
    if not rows:
        raise ValueError(f"{data_dir}: no stored sequences (no index.jsonl rows)")
    compiled, settings, manifest = _open_target(model_dir, config, max(topk, 1))
    width = compiled.output("target_hidden").get_partial_shape()[2].get_length()
    out_dir.mkdir(parents=True, exist_ok=True)
    meta_path = out_dir / META
    meta = {"model_dir": str(model_dir), "data_dir": str(data_dir), "max_len": max_len, "width": width,
            "target_layer_ids": manifest["target_layer_ids"], "compile": {k: str(v) for k, v in settings.items()},
            "topk": topk}
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
    end = max((r["row"] + r["len"] for r in done), default=0)
    # drop arrays of a sequence whose index row never got written; a directory gaining top-k
    # gets zero rows (flagged false in its index) for the sequences computed before
    arrays = [(FEATS, width * 2), (PREDS, 2)] + ([(TOPK_IDS, topk * 2), (TOPK_LOGP, topk * 2)] if topk else [])
    for name, row_bytes in arrays:
        with open(out_dir / name, "ab") as f:
            f.truncate(end * row_bytes)
    with open(out_dir / INDEX, "w") as f:
        for r in done:
            f.write(json.dumps(r) + "\n")
    have = {r["offset"] for r in done}

    tokens = np.fromfile(data_dir / "tokens.bin", dtype=np.uint16)
    request = compiled.create_infer_request()
    todo = [r for r in rows if r["offset"] not in have and r["offset"] + r["total_len"] <= tokens.size]
    log(f"{len(todo)} sequences to run ({len(have)} already stored) from {data_dir}")
    t0, n_tok = time.time(), 0
    with contextlib.ExitStack() as opened:
        files = {name: opened.enter_context(open(out_dir / name, "ab")) for name, _ in arrays}
        fi = opened.enter_context(open(out_dir / INDEX, "a"))
        for k, r in enumerate(todo):
            if deadline is not None and time.time() > deadline:
                break
            ids = tokens[r["offset"]:r["offset"] + r["total_len"]][:max_len].astype(np.int64)
            L = ids.size
            first = max(min(r["prompt_len"], L) - 1, 0)  # labels need preds from the last prompt position on
            feats, next_ids, next_logp = score_sequence(request, ids, first)
            preds = np.zeros(L, dtype=np.uint16)
            preds[first:] = next_ids[:, 0]
            out = {FEATS: feats.astype(np.float16), PREDS: preds}
            if topk:
                out[TOPK_IDS] = np.zeros((L, topk), dtype=np.uint16)
                out[TOPK_LOGP] = np.zeros((L, topk), dtype=np.float16)
                out[TOPK_IDS][first:] = next_ids
                out[TOPK_LOGP][first:] = next_logp
            for name, f in files.items():
                f.write(out[name].tobytes())
                f.flush()
                os.fsync(f.fileno())
            fi.write(json.dumps({"offset": r["offset"], "row": end, "len": int(L), "topk": bool(topk)}) + "\n")
            fi.flush()
            end += L
            n_tok += L
            if (k + 1) % 100 == 0:
                log(f"[{k + 1}/{len(todo)}] {n_tok} tokens, {n_tok / (time.time() - t0):.0f} tok/s")
    seconds = time.time() - t0
    log(f"done: {n_tok} tokens in {seconds:.0f} s ({n_tok / max(seconds, 1e-9):.0f} tok/s)")
    return {"sequences": len(read_index(out_dir)), "rows": end, "new_tokens": n_tok, "seconds": round(seconds, 1)}


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
    compiled, settings, _ = _open_target(model_dir, config, ff.topk)
    check_precision(out_dir, ff.meta, settings)
    request = compiled.create_infer_request()
    tokens = np.fromfile(data_dir / "tokens.bin", dtype=np.uint16)
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
        _, next_ids, next_logp = score_sequence(request, ids, first)
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
    ap.add_argument("--fill-topk", action="store_true",
                    help="then compute the top-k of sequences stored without it (in place)")
    a = ap.parse_args()
    stop = time.time() + a.minutes * 60 if a.minutes else None
    config = {"INFERENCE_PRECISION_HINT": a.inference_precision} if a.inference_precision else None

    def say(line):
        print(line, flush=True)

    for d in a.data:
        sub = Path(a.out) / Path(d).resolve().name
        print(json.dumps(precompute_features(a.model, d, sub, a.max_len, config=config, deadline=stop, log=say,
                                            topk=a.topk)),
              flush=True)
        if a.fill_topk:
            print(json.dumps(fill_topk(a.model, d, sub, config=config, deadline=stop, log=say)), flush=True)
