"""Prefix reuse on the batched hybrid runner, with the prefix cache against without it, interleaved;
prints the median wall time, median TTFT and the cached prompt tokens.
Cases: `shared` (default): four requests at once share a long prefix that a finished request left
(its KV blocks and its kept linear-attention states); `turn`: a conversation's next turn, whose
prompt is the last turn's prompt, its reply and a new message, one request at a time;
`dropped-reply`: the same, but the template rendered the reply otherwise (as one that drops a
reply's reasoning does), so the prompt parts right after the last turn's prompt.
Usage: python tools/bench_hybrid_prefix.py MODEL_DIR [--case shared|turn|dropped-reply] [--prefix-tokens 1100]
       [--repetitions 4]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ovdflash import DFlashPipeline


def shared_prefix(pipe, rng, vocab: int, prefix_tokens: int, cache: bool) -> tuple[float, float, int]:
    prefix = rng.integers(0, vocab, prefix_tokens).tolist()
    if cache:  # a finished request leaves the prefix behind
        pipe.generate_batch([prefix + rng.integers(0, vocab, 20).tolist()], max_new_tokens=4, draft=False)
    prompts = [prefix + rng.integers(0, vocab, 30).tolist() for _ in range(4)]
    t0 = time.perf_counter()
    out = pipe.generate_batch(prompts, max_new_tokens=16, max_batch_size=4, draft=False)
    return (time.perf_counter() - t0, statistics.median(r.stats.ttft_s for r in out),
            sum(r.stats.num_cached_prompt_tokens for r in out))


def next_turn(pipe, rng, vocab: int, prefix_tokens: int, cache: bool,
              dropped: bool = False) -> tuple[float, float, int]:
    first = rng.integers(0, vocab, prefix_tokens).tolist()
    reply = pipe.generate_batch([first], max_new_tokens=24, draft=False, stop=None)[0].token_ids
    rendered = rng.integers(0, vocab, len(reply)).tolist() if dropped else list(reply)
    second = first + rendered + rng.integers(0, vocab, 30).tolist()
    t0 = time.perf_counter()
    out = pipe.generate_batch([second], max_new_tokens=16, draft=False, stop=None)[0]
    return time.perf_counter() - t0, out.stats.ttft_s, out.stats.num_cached_prompt_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--case", choices=("shared", "turn", "dropped-reply"), default="shared")
    parser.add_argument("--prefix-tokens", type=int, default=1100)
    parser.add_argument("--repetitions", type=int, default=4)
    args = parser.parse_args()
    pipe = DFlashPipeline.from_pretrained(args.model_dir, target_runner="paged")
    vocab = pipe.tokenizer.vocab_size
    rng = np.random.default_rng(0)
    case = {"shared": shared_prefix, "turn": next_turn,
            "dropped-reply": lambda *a: next_turn(*a, dropped=True)}[args.case]
    runs = {True: [], False: []}
    for rep in range(args.repetitions):
        for cache in ((True, False) if rep % 2 == 0 else (False, True)):
            pipe.prefix_cache = cache  # the batch runner is made again, its cache empty
            runs[cache].append(case(pipe, rng, vocab, args.prefix_tokens, cache))
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
