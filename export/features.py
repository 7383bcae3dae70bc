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
    * `index.jsonl`: one row per sequence `{"offset", "row", "len"}`, `offset` being the
      sequence's offset in the data directory's tokens.bin, `row` its first row in the arrays;
    * `meta.json`: model directory, compile settings, max_len, F.
  Resumable: rows are appended after their arrays; on start the arrays are cut to the last
  indexed row and sequences already present are skipped. Data directories only ever grow, so
  re-running picks up new sequences.
- `FeatureFile(out_dir)` reads it back (memory-mapped): `lookup(offset, length) -> (feats f16
  [length, F], preds [length]) | None`. Training (`train.PrecomputedStore`) uses it instead of
  running the frozen torch target every step.

Why: on 2 CPU cores the torch target forward was the slowest part of a training step, and it is
the same computation every epoch. The OpenVINO int8 target is also what verifies the drafts at
run time, so its features and greedy tokens are exactly what the drafter sees and must match.
Run: `python -m ovdflash_export.features --model MODEL_DIR --data models/smollm2/data --out DIR`.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from .data import read_index

FEATS, PREDS, INDEX, META = "feats.f16", "preds.u16", "index.jsonl", "meta.json"


class FeatureFile:
    """Read side of a precomputed feature directory (memory-mapped, re-opened by `refresh`)."""

    def __init__(self, out_dir):
        self.dir = Path(out_dir)
        meta_path = self.dir / META
        if not meta_path.is_file():
            raise FileNotFoundError(f"{self.dir} holds no precomputed features (no {META})")
        self.meta = json.loads(meta_path.read_text())
        self.width = int(self.meta["width"])
        self.refresh()

    def refresh(self) -> None:
        rows = read_index(self.dir)
        self.rows = {r["offset"]: (r["row"], r["len"]) for r in rows}
        n = max((r["row"] + r["len"] for r in rows), default=0)
        self.feats = np.memmap(self.dir / FEATS, dtype=np.float16, mode="r", shape=(n, self.width)) if n else None
        self.preds = np.memmap(self.dir / PREDS, dtype=np.uint16, mode="r", shape=(n,)) if n else None

    def lookup(self, offset: int, length: int):
        hit = self.rows.get(offset)
        if hit is None or hit[1] != length:
            return None
        row, n = hit
        return self.feats[row:row + n], self.preds[row:row + n]


def _open_target(model_dir: Path, config: dict | None):
    """The runtime's compiled target (ov_models.compile_runners, runtime compile settings + config)."""
    from ovdflash.ov_models import compile_runners
    from ovdflash.pipeline import default_compile_config, load_manifest

    manifest = load_manifest(model_dir)
    settings = default_compile_config(manifest)
    settings.update(config or {})
    target, _ = compile_runners(model_dir, manifest, "CPU", settings, with_drafter=False)
    return target.compiled, settings, manifest


def precompute_features(model_dir, data_dir, out_dir, max_len: int = 768, config: dict | None = None,
                        deadline: float | None = None, log=print) -> dict:
    """Append features and greedy predictions of every not-yet-stored sequence of `data_dir`."""
    model_dir, data_dir, out_dir = Path(model_dir), Path(data_dir), Path(out_dir)
    rows = read_index(data_dir)
    if not rows:
        raise ValueError(f"{data_dir}: no stored sequences (no index.jsonl rows)")
    compiled, settings, manifest = _open_target(model_dir, config)
    width = compiled.output("target_hidden").get_partial_shape()[2].get_length()
    out_dir.mkdir(parents=True, exist_ok=True)
    meta_path = out_dir / META
    meta = {"model_dir": str(model_dir), "data_dir": str(data_dir), "max_len": max_len, "width": width,
            "target_layer_ids": manifest["target_layer_ids"], "compile": {k: str(v) for k, v in settings.items()}}
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        for key in ("max_len", "width", "target_layer_ids"):
            if old[key] != meta[key]:
                raise ValueError(f"{out_dir}: stored {key} {old[key]} differs from this run's {meta[key]}")
    meta_path.write_text(json.dumps(meta, indent=1))

    done = read_index(out_dir)
    end = max((r["row"] + r["len"] for r in done), default=0)
    with open(out_dir / FEATS, "ab") as f:  # drop arrays of a sequence whose index row never got written
        f.truncate(end * width * 2)
    with open(out_dir / PREDS, "ab") as f:
        f.truncate(end * 2)
    with open(out_dir / INDEX, "w") as f:
        for r in done:
            f.write(json.dumps(r) + "\n")
    have = {r["offset"] for r in done}

    tokens = np.fromfile(data_dir / "tokens.bin", dtype=np.uint16)
    request = compiled.create_infer_request()
    logits_out, hidden_out = compiled.output("logits"), compiled.output("target_hidden")
    beam = np.zeros(1, dtype=np.int32)
    todo = [r for r in rows if r["offset"] not in have and r["offset"] + r["total_len"] <= tokens.size]
    log(f"{len(todo)} sequences to run ({len(have)} already stored) from {data_dir}")
    t0, n_tok = time.time(), 0
    with open(out_dir / FEATS, "ab") as ff, open(out_dir / PREDS, "ab") as fp, open(out_dir / INDEX, "a") as fi:
        for k, r in enumerate(todo):
            if deadline is not None and time.time() > deadline:
                break
            ids = tokens[r["offset"]:r["offset"] + r["total_len"]][:max_len].astype(np.int64)
            L = ids.size
            first = max(min(r["prompt_len"], L) - 1, 0)  # labels need preds from the last prompt position on
            request.reset_state()
            request.infer({"input_ids": ids[None], "attention_mask": np.ones((1, L), dtype=np.int64),
                           "position_ids": np.arange(L, dtype=np.int64)[None], "beam_idx": beam,
                           "logits_indices": np.arange(first, L, dtype=np.int64)})
            preds = np.zeros(L, dtype=np.uint16)
            preds[first:] = request.get_tensor(logits_out).data[0].argmax(-1)
            ff.write(request.get_tensor(hidden_out).data[0].astype(np.float16).tobytes())
            fp.write(preds.tobytes())
            ff.flush(), fp.flush()
            os.fsync(ff.fileno()), os.fsync(fp.fileno())
            fi.write(json.dumps({"offset": r["offset"], "row": end, "len": int(L)}) + "\n")
            fi.flush()
            end += L
            n_tok += L
            if (k + 1) % 100 == 0:
                log(f"[{k + 1}/{len(todo)}] {n_tok} tokens, {n_tok / (time.time() - t0):.0f} tok/s")
    seconds = time.time() - t0
    log(f"done: {n_tok} tokens in {seconds:.0f} s ({n_tok / max(seconds, 1e-9):.0f} tok/s)")
    return {"sequences": len(read_index(out_dir)), "rows": end, "new_tokens": n_tok, "seconds": round(seconds, 1)}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Precompute target features for drafter training (OpenVINO).")
    ap.add_argument("--model", required=True, help="ovdflash model directory (its target IR is used)")
    ap.add_argument("--data", required=True, action="append", help="data directory (repeatable)")
    ap.add_argument("--out", required=True, help="root: one sub-directory per data directory's name")
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--minutes", type=float, default=None)
    a = ap.parse_args()
    stop = time.time() + a.minutes * 60 if a.minutes else None
    for d in a.data:
        sub = Path(a.out) / Path(d).resolve().name
        print(json.dumps(precompute_features(a.model, d, sub, a.max_len, deadline=stop,
                                             log=lambda s: print(s, flush=True))), flush=True)
