"""JSON-schema answers: tokens a second and acceptance of DFlash with and without grammar-forced drafts, and AR.

The 20 tasks of `ovdflash.bench.schemas` (each prompt with its schema appended), greedy, held to the schema
(`structured={"json": schema}`), prefix caching off so every run prefills its prompt. Modes: `ar` (no
drafter), `dflash` (the drafter's drafts only: `forced_drafts` False), `dflash+forced` (the tokens the grammar
forces drafted first, the default) and `dflash+forced+lookup` (with n-gram lookup drafts, the pipeline's
default). Runs are interleaved: each repetition walks the tasks, each task runs every mode, in an order
rotated per task and repetition. Prints one JSON object: per mode the median over repetitions of the
tokens a second summed over the 20 answers (whole answer with its prefill, and decode only after the first
token), target calls per output token, the drafter's acceptance rate and mean acceptance length, answers
that validate (jsonschema) and answers whose tokens equal AR's; and the host's load (uptime before and
after, other processes' CPU use during the runs).
Usage: python tools/bench_structured.py [MODEL_DIR] [--repetitions 3] [--block-size 4] [--max-tokens 128]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jsonschema

from ovdflash import DFlashPipeline
from ovdflash.bench import CpuMeter, rotated
from ovdflash.bench.schemas import SCHEMA_TASKS, schema_prompt
from ovdflash.decode.stats import GenerationStats

MODES = {
    "ar": {"draft": False},
    "dflash": {"forced_drafts": False, "prompt_lookup": False},
    "dflash+forced": {"forced_drafts": True, "prompt_lookup": False},
    "dflash+forced+lookup": {"forced_drafts": True, "prompt_lookup": True},
}


def run(pipe, ids, schema, mode: str, block_size: int, max_tokens: int):
    options = dict(MODES[mode])
    forced = options.pop("forced_drafts", True)
    stats = GenerationStats()
    started = time.perf_counter()
    result = pipe.generate(ids, max_new_tokens=max_tokens, block_size=block_size, prefix_cache=False, stats=stats,
                           structured={"json": schema, "forced_drafts": forced}, **options)
    return result, stats, time.perf_counter() - started


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", nargs="?")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    load_before = os.getloadavg()
    pipe = DFlashPipeline.from_pretrained(args.model_dir)
    pipe.warm_up(block_size=args.block_size)
    prompts = [pipe.encode_prompt([{"role": "user", "content": schema_prompt(task)}]) for task in SCHEMA_TASKS]
    for ids, (_, schema) in zip(prompts[:2], SCHEMA_TASKS):  # first-shape and grammar-compile costs, untimed
        for mode in MODES:
            run(pipe, ids, schema, mode, args.block_size, args.max_tokens)
    meter = CpuMeter()
    # per repetition and mode: [output tokens, seconds, decode seconds, stats]; per mode: answers' checks
    totals = [{mode: [0, 0.0, 0.0, GenerationStats()] for mode in MODES} for _ in range(args.repetitions)]
    checks = {mode: {"valid": 0, "equal_to_ar": 0, "answers": 0} for mode in MODES}
    foreign = []
    for rep in range(args.repetitions):
        for t, (ids, (_, schema)) in enumerate(zip(prompts, SCHEMA_TASKS)):
            tokens = {}
            for mode in rotated(MODES, rep + t):
                started = meter.start()
                result, stats, seconds = run(pipe, ids, schema, mode, args.block_size, args.max_tokens)
                foreign.append(meter.foreign_cores(started))
                total = totals[rep][mode]
                total[0] += len(result.token_ids)
                total[1] += seconds
                total[2] += seconds - stats.ttft_s
                total[3].merge(stats)
                tokens[mode] = result.token_ids
                checks[mode]["valid"] += valid(result.text, schema)
                checks[mode]["answers"] += 1
            for mode in MODES:
                checks[mode]["equal_to_ar"] += tokens[mode] == tokens["ar"]
    report = {}
    for mode in MODES:
        per_rep = [totals[rep][mode] for rep in range(args.repetitions)]
        stats = per_rep[0][3]
        calls = stats.num_drafts + stats.num_ar_steps
        report[mode] = {
            "tok_s": round(statistics.median(n / s for n, s, _, _ in per_rep), 1),
            "decode_tok_s": round(statistics.median((n - len(SCHEMA_TASKS)) / d for n, _, d, _ in per_rep), 1),
            "output_tokens": per_rep[0][0],
            "target_calls_per_token": round(calls / stats.num_output_tokens, 3),
            "acceptance_rate": round(stats.acceptance_rate, 3),
            "mean_acceptance_length": round(stats.mean_acceptance_length, 2),
            **checks[mode],
        }
    print(json.dumps({"modes": report, "repetitions": args.repetitions, "block_size": args.block_size,
                      "tasks": len(SCHEMA_TASKS), "load_before": load_before, "load_after": os.getloadavg(),
                      "foreign_cores_median": round(statistics.median(foreign), 2),
                      "foreign_cores_mean": round(statistics.fmean(foreign), 2)}, indent=1))


if __name__ == "__main__":
    main()
