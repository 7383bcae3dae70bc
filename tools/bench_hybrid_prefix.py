"""Four requests sharing a long prefix on the batched hybrid runner, with the prefix cache (a finished
request left the prefix's KV blocks and its kept linear-attention states) against without it,
interleaved; prints the median wall time, median TTFT and the cached prompt tokens.
Usage: python tools/bench_hybrid_prefix.py MODEL_DIR [--prefix-tokens 1100] [--repetitions 4]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ovdflash import DFlashPipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--prefix-tokens", type=int, default=1100)
    parser.add_argument("--repetitions", type=int, default=4)
    args = parser.parse_args()
    pipe = DFlashPipeline.from_pretrained(args.model_dir, target_runner="paged")
    vocab = pipe.tokenizer.vocab_size
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, vocab, args.prefix_tokens).tolist()
    runs = {True: [], False: []}
    for rep in range(args.repetitions):
        for cache in ((True, False) if rep % 2 == 0 else (False, True)):
            pipe.prefix_cache = cache  # the batch runner is made again, its cache empty
            if cache:  # a finished request leaves the prefix behind
                pipe.generate_batch([prefix + rng.integers(0, vocab, 20).tolist()], max_new_tokens=4, draft=False)
            prompts = [prefix + rng.integers(0, vocab, 30).tolist() for _ in range(4)]
            t0 = time.perf_counter()
            out = pipe.generate_batch(prompts, max_new_tokens=16, max_batch_size=4, draft=False)
            runs[cache].append((time.perf_counter() - t0, statistics.median(r.stats.ttft_s for r in out),
                                sum(r.stats.num_cached_prompt_tokens for r in out)))
    linear = pipe.batch_target().linear
    if linear is not None:
        print(f"states kept every {linear.checkpoint_every} tokens, {linear.bytes_per_slot / 2 ** 20:.2f} MiB each, "
              f"at most {linear.max_shared} shared")
    for cache in (True, False):
        rs = runs[cache]
        print(f"prefix cache {'on ' if cache else 'off'}: wall {statistics.median(r[0] for r in rs) * 1e3:.0f} ms, "
              f"TTFT median {statistics.median(r[1] for r in rs) * 1e3:.0f} ms, cached prompt tokens per run "
              f"{[r[2] for r in rs]}")


if __name__ == "__main__":
    main()
