"""A chat's second-turn TTFT with and without prefix reuse (ovdflash.decode.prefix_cache).

Each conversation: turn 1 is generated, then turn 2 (the whole conversation re-encoded, as
`ovdflash chat` does) is timed with the cache on (prefills only the new tokens) and off (prefills
everything), alternating, `--repeats` times; prints the per-conversation medians as JSON lines.
Usage: python tools/bench_prefix_reuse.py [MODEL_DIR] [--repeats 5] [--turn1-tokens 128]
"""
from __future__ import annotations

import argparse
import json
import statistics

from ovdflash import DFlashPipeline

SYSTEM = ("You are a careful assistant for a small software team. Answer briefly and precisely, "
          "show code when it helps, and say when you are not sure.")
CONVERSATIONS = [
    ("How does a CPU cache speed up a program?", "And what is a cache miss?"),
    ("Write a Python function that reverses a linked list.", "Now make it recursive."),
    ("Give me three tips for writing clear commit messages.", "Which one matters most?"),
    ("Explain what a hash table is to a new programmer.", "What happens on a collision?"),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", nargs="?")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--turn1-tokens", type=int, default=128)
    args = parser.parse_args()
    pipe = DFlashPipeline.from_pretrained(args.model_dir)
    pipe.warm_up()
    for first, second in CONVERSATIONS:
        turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first}]
        reply = pipe.generate(turn1, max_new_tokens=args.turn1_tokens, prefix_cache=False)
        turn2 = turn1 + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": second}]
        ttft = {True: [], False: []}
        cached = None
        for _ in range(args.repeats):
            for reuse in (True, False):
                pipe.generate(turn1, max_new_tokens=args.turn1_tokens, prefix_cache=False)  # turn 1 in the KV
                result = pipe.generate(turn2, max_new_tokens=4, prefix_cache=reuse)
                ttft[reuse].append(result.stats.ttft_s)
                if reuse:
                    cached = result.stats.num_cached_prompt_tokens
        print(json.dumps({"turn2_prompt_tokens": len(pipe.encode_prompt(turn2)), "cached_tokens": cached,
                          "ttft_ms_reuse": round(1e3 * statistics.median(ttft[True]), 1),
                          "ttft_ms_full": round(1e3 * statistics.median(ttft[False]), 1)}), flush=True)


if __name__ == "__main__":
    main()
