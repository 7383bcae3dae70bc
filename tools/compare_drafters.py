"""Drafter call cost of several exported model directories, side by side.

Usage: python tools/compare_drafters.py MODEL_DIR [MODEL_DIR ...] [--context 300]
       [--drafts 1,3,7] [--reps 7] [--calls 20]

Each directory is loaded with its runtime graphs (draft vocabulary included, default compile
settings). Per repetition and per directory (interleaved, since the machine is noisy), for each
number of drafts k: the drafter state is filled with a `--context`-token context, then `--calls`
steady-state calls each add 2 new context features (an accepted draft + the bonus token) and
propose k tokens. Prints the median and minimum ms per call. The features are random: this
measures cost, not acceptance.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from ovdflash.manifest import load_manifest
from ovdflash.pipeline import DFlashPipeline


def time_drafter(drafter, features: np.ndarray, new_features: np.ndarray, num_drafts: int, calls: int) -> float:
    """ms per steady-state propose() call after a fresh context of len(features) positions."""
    drafter.reset()
    start = len(features)
    drafter.propose(5, features, start, num_drafts)
    t0 = time.perf_counter()
    for _ in range(calls):
        start += len(new_features)
        drafter.propose(5, new_features, start, num_drafts)
    return 1e3 * (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dirs", nargs="+", type=Path)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--drafts", default="1,3,7")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    drafts = [int(k) for k in args.drafts.split(",")]
    manifest = load_manifest(args.model_dirs[0])
    width = len(manifest["target_layer_ids"]) * manifest["target"]["hidden_size"]
    pipes = {d: DFlashPipeline.from_pretrained(d) for d in args.model_dirs}
    rng = np.random.default_rng(0)
    features = rng.standard_normal((args.context, width)).astype(np.float32)
    new_features = rng.standard_normal((2, width)).astype(np.float32)
    times = {(d, k): [] for d in pipes for k in drafts}
    for rep in range(args.reps + 1):  # repetition 0 warms every shape up and is dropped
        for d, pipe in pipes.items():
            for k in drafts:
                ms = time_drafter(pipe.drafter, features, new_features, k, args.calls)
                if rep:
                    times[(d, k)].append(ms)
    for (d, k), values in times.items():
        print(f"{d} drafts={k}: {statistics.median(values):.2f} ms (min {min(values):.2f})")


if __name__ == "__main__":
    main()
