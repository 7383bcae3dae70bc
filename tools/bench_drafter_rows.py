"""Batched generation with a batch's drafters as rows of one request (ov.drafter_rows.DrafterRows, the
default) against one request per sequence (ov.paged_batch.DrafterPool), interleaved in one process.

Prints, per prompt set, concurrency and block size, the medians over the repetitions of tok/s (all
sequences' tokens over the batch's wall time) and of the drafter's seconds in the run (the sum of
every sequence's draft_s: with rows, each sequence's share of the round's one call), and checks that
both legs emit the same tokens. The first run of every cell is a warm-up; the legs alternate order.

    python tools/bench_drafter_rows.py [MODEL_DIR] [--target-runner paged] [--sets code,chat]
        [--concurrency 2,4] [--block-sizes 4] [--repetitions 4] [--max-new-tokens 64] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from ovdflash import DFlashPipeline
from ovdflash.bench import encode_prompts
from ovdflash.ov.drafter_rows import DrafterRows
from ovdflash.ov.host import collect
from ovdflash.ov.paged_batch import DrafterPool


def block_arg(text: str):
    return text if text == "auto" else int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--target-runner", default=None)
    ap.add_argument("--sets", default="code,chat")
    ap.add_argument("--concurrency", default="2,4")
    ap.add_argument("--block-sizes", default="4")
    ap.add_argument("--repetitions", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-lookup", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    pipe = DFlashPipeline.from_pretrained(args.model, **({"target_runner": args.target_runner}
                                                         if args.target_runner else {}))
    legs = {"rows": DrafterRows(pipe.drafter), "per-sequence": DrafterPool(pipe.drafter)}
    rows_out = []
    for set_name in args.sets.split(","):
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            prompts = encode_prompts(pipe, set_name, concurrency)
            for block in (block_arg(b) for b in args.block_sizes.split(",")):
                samples, tokens = {leg: [] for leg in legs}, {}
                for rep in range(args.repetitions + 1):
                    for leg in (list(legs) if rep % 2 else list(legs)[::-1]):
                        pipe._batch.drafter_pool = legs[leg]  # generate_batch takes its drafters from here
                        t0 = time.perf_counter()
                        results = pipe.generate_batch(prompts, max_new_tokens=args.max_new_tokens,
                                                      max_batch_size=concurrency, block_size=block,
                                                      prompt_lookup=args.prompt_lookup)
                        wall = time.perf_counter() - t0
                        ids = [r.token_ids for r in results]
                        if tokens.setdefault("first", ids) != ids:
                            raise SystemExit(f"{leg} emitted other tokens ({set_name}, C={concurrency}, block {block})")
                        if rep:
                            samples[leg].append((sum(map(len, ids)) / wall, sum(r.stats.draft_s for r in results)))
                for leg in legs:
                    row = {"set": set_name, "concurrency": concurrency, "block_size": block, "drafters": leg,
                           "tokens_per_s": statistics.median(s for s, _ in samples[leg]),
                           "draft_s": statistics.median(d for _, d in samples[leg])}
                    rows_out.append(row)
                    print(f"{set_name:5} C={concurrency} block {block!s:4} {leg:12} tok/s {row['tokens_per_s']:7.1f}"
                          f"  drafter s {row['draft_s']:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": collect(), "args": vars(args), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
