"""f32 against bf16 numerics on one model, side by side in one process: speed, verify cost, agreement.

Usage: python tools/compare_precisions.py MODEL_DIR [-n 4] [--max-new-tokens 96] [--blocks 4,8]
       [--runner paged] [--json OUT]

For each precision the CPU offers (`ovdflash.ov.precision.host_precisions`) one pipeline is loaded; then
for each eval prompt (models/prompts/eval_{code,math,chat}.jsonl, the first n of each), AR and DFlash
at each block run greedily, precisions interleaved prompt by prompt. Reported per precision and set:
median tok/s, how many prompts DFlash's reply equals that precision's AR reply token for token, the
first position where they part and the target's top-2 logit margin there, and how many bf16 AR
replies equal f32 AR's. The verify curve is the target's median ms for a forward of K = 1..16 tokens
on top of a 64-token context (paged runner: rolled back with `rewind`, so every K sees the same context).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from ovdflash import DFlashPipeline
from ovdflash.ov.precision import PRECISIONS, host_precisions

SETS = ("code", "math", "chat")
PROMPTS = Path(__file__).resolve().parents[1] / "models" / "prompts"


def eval_prompts(name: str, n: int) -> list[str]:
    rows = [json.loads(line) for line in (PROMPTS / f"eval_{name}.jsonl").read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows[:n]]


def verify_curve(pipe: DFlashPipeline, repeats: int = 7) -> dict[int, float]:
    target = pipe.target
    context = np.arange(100, 164, dtype=np.int64)
    target.reset()
    target.forward(context, all_logits=False)
    target.commit(len(context))
    curve = {}
    for k in range(1, 17):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            target.forward(np.arange(200, 200 + k, dtype=np.int64), all_logits=True)
            times.append(time.perf_counter() - t0)
            target.commit(k)
            target.rewind(len(context))
        curve[k] = 1000 * statistics.median(times)
    return curve


def first_split(pipe: DFlashPipeline, prompt_ids: list[int], a: list[int], b: list[int]):
    """(position where two replies part, top-2 margin of the target's logits there) or None."""
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if j is None:
        return None
    pipe.target.reset()
    logits, _ = pipe.target.forward(np.array(prompt_ids + a[:j], dtype=np.int64), all_logits=False)
    top2 = np.sort(logits[-1])[-2:]
    pipe.target.commit(len(prompt_ids) + j)
    return j, round(float(top2[1] - top2[0]), 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--blocks", default="4,8")
    ap.add_argument("--runner", default="paged")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    precisions = [p for p in PRECISIONS if p in host_precisions()]
    pipes = {p: DFlashPipeline.from_pretrained(args.model_dir, target_runner=args.runner, precision=p,
                                               prompt_lookup=False) for p in precisions}
    for p, pipe in pipes.items():
        pipe.warm_up(block_size=max(blocks))
        print(f"{p}: {pipe.numerics.describe()}", flush=True)
    result = {"model_dir": str(args.model_dir), "runner": args.runner, "precisions": precisions, "sets": {},
              "verify_ms": {p: verify_curve(pipe) for p, pipe in pipes.items()}}
    modes = ["ar"] + [f"dflash@{b}" for b in blocks]
    for name in SETS:
        rows = {p: {m: [] for m in modes} for p in precisions}
        agree = {p: {m: 0 for m in modes[1:]} for p in precisions}
        splits = {p: {m: [] for m in modes[1:]} for p in precisions}
        ar_same_as_f32 = 0
        for text in eval_prompts(name, args.n):
            replies = {}
            for p, pipe in pipes.items():
                ids = pipe.encode_prompt([{"role": "user", "content": text}])
                for m in modes:
                    kw = dict(draft=False) if m == "ar" else dict(block_size=int(m.split("@")[1]))
                    t0 = time.perf_counter()
                    out = pipe.generate(ids, max_new_tokens=args.max_new_tokens, **kw)
                    rows[p][m].append(len(out.token_ids) / (time.perf_counter() - t0))
                    replies[p, m] = out.token_ids
                for m in modes[1:]:
                    same = replies[p, m] == replies[p, "ar"]
                    agree[p][m] += same
                    if not same:
                        splits[p][m].append(first_split(pipe, ids, replies[p, "ar"], replies[p, m]))
            if "bf16" in pipes:
                ar_same_as_f32 += replies["bf16", "ar"] == replies["f32", "ar"]
        result["sets"][name] = {
            "tok_s": {p: {m: statistics.median(v) for m, v in rows[p].items()} for p in precisions},
            "dflash_equals_ar": agree, "splits (position, top-2 margin)": splits,
            "bf16_ar_equals_f32_ar": ar_same_as_f32 if "bf16" in pipes else None, "prompts": args.n}
        print(json.dumps({name: result["sets"][name]}), flush=True)
    print("verify ms (K=1..16):", json.dumps({p: {k: round(v, 1) for k, v in c.items()}
                                              for p, c in result["verify_ms"].items()}))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
