"""The bench's measurements: the interleaved timed runs, the CPU meter and the memory probe.

Contract: `run_benchmark(model_dir, prompt_sets, num_prompts, max_new_tokens, modes, block_sizes,
repetitions, warmup, config, progress=None, target_runner=None)` -> the summary of
`report.summarize` plus `target_runner`, `drafter_kind` (the manifest's, None without a drafter),
`block_policy` (with dflash@auto) and `runs` (one entry per timed run). Order: warm-up calls
untimed, then for each repetition, for each prompt set and prompt, every mode once, the order of
modes `rotated` by the repetition.
`progress(done, total, run)` is called after every timed run with its `Run`.
`CpuMeter` reads the CPU time other processes used during a run (/proc/stat); `rss_mb()` is
this process's resident memory; `measure_memory` loads pipelines in fresh processes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from ..decode.stats import GenerationStats
from ..ov.memory import resident_bytes
from .modes import build_runners
from .prompts import encode_prompts
from .report import Run, summarize


def rotated(items, rep: int) -> list:
    """`items` starting at position `rep` (mod len): A B C, B C A, ... so drift hits each alike."""
    items = list(items)
    return items[rep % len(items):] + items[: rep % len(items)]


class CpuMeter:
    """CPU time of other processes: system busy time (/proc/stat) minus this process's own."""

    def __init__(self):
        self.tick = os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _busy_jiffies() -> int:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return -1
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]) - idle

    def start(self):
        t = os.times()
        return self._busy_jiffies(), t.user + t.system, time.perf_counter()

    def foreign_cores(self, started) -> float:
        busy0, own0, wall0 = started
        busy1, t, wall = self._busy_jiffies(), os.times(), time.perf_counter() - wall0
        if busy0 < 0 or busy1 < 0 or wall <= 0:
            return float("nan")
        return max(0.0, ((busy1 - busy0) / self.tick - (t.user + t.system - own0)) / wall)


def rss_mb() -> float:
    resident = resident_bytes()
    return resident / 2 ** 20 if resident else float("nan")


def measure_memory(model_dir: Path, config: dict | None = None, target_runner: str | None = None,
                   wide_target: bool | None = None) -> dict:
    """Resident memory of a pipeline without / with its drafter (and with the full-vocabulary
    head when the drafter ships a draft vocabulary), each in a fresh process after one call.

    The call has a 64-token prompt in every variant: the CPU plugin allocates ~100 MB more for
    the target's first multi-token forward (SmolLM2 int8), so a 3-token prompt would charge
    that to the drafter's verify blocks."""
    code = ("import sys, json, ovdflash.bench.measure as m; from ovdflash import DFlashPipeline; "
            "draft = sys.argv[2] != 'none'; "
            "p = DFlashPipeline.from_pretrained(sys.argv[1], draft=draft, use_draft_vocab=sys.argv[2] == 'vocab', "
            "target_runner=sys.argv[4] or None, wide_target=json.loads(sys.argv[5]), **json.loads(sys.argv[3])); "
            "list(p.generate_tokens(list(range(100, 164)), 16, draft=draft)); print(m.rss_mb())")
    variants = {"target_only_mb": "none", "with_drafter_mb": "vocab"}
    if (model_dir / "drafter" / "draft_vocab.json").exists():
        variants["with_drafter_full_vocab_mb"] = "full"
    out = {}
    for name, flag in variants.items():
        proc = subprocess.run([sys.executable, "-c", code, str(model_dir), flag, json.dumps(config or {}),
                               target_runner or "", json.dumps(wide_target)],
                              capture_output=True, text=True)
        out[name] = float(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    if out["target_only_mb"] and out["with_drafter_mb"]:
        out["drafter_overhead"] = out["with_drafter_mb"] / out["target_only_mb"] - 1
    return out


def run_benchmark(model_dir: Path, prompt_sets: list[str], num_prompts: int, max_new_tokens: int,
                  modes: list[str], block_sizes: list[int | str], repetitions: int, warmup: int,
                  config: dict, progress: Callable[[int, int, Run], None] | None = None,
                  target_runner: str | None = None, wide_target: bool | None = None) -> dict:
    notes = []
    built = build_runners(model_dir, modes, block_sizes, config, notes, target_runner, wide_target)
    pipe, runners = built["pipe"], built["runners"]
    prompts = {name: encode_prompts(pipe, name, num_prompts) for name in prompt_sets}
    names = list(runners)
    first = next(iter(prompts.values()))[0]
    for _ in range(warmup):  # compile caches, first-shape costs
        for name in names:
            runners[name](first, min(16, max_new_tokens))
    runs: list[Run] = []
    meter = CpuMeter()
    total = repetitions * sum(len(p) for p in prompts.values()) * len(names)
    done = 0
    for rep in range(repetitions):
        order = rotated(names, rep)
        for set_name, set_prompts in prompts.items():
            for i, ids in enumerate(set_prompts):
                for name in order:
                    started = meter.start()
                    tokens, wall, ttft, stats = runners[name](ids, max_new_tokens)
                    spec = stats if isinstance(stats, GenerationStats) else None
                    runs.append(Run(name, set_name, i, len(tokens), wall, ttft, tokens,
                                    spec.as_dict() if spec else stats, meter.foreign_cores(started), spec))
                    done += 1
                    if progress:
                        progress(done, total, runs[-1])
    result = summarize(runs, names, prompt_sets, notes)
    result["target_runner"] = pipe.target.kind
    result["drafter_kind"] = built["drafter_kind"]
    if pipe.block_policy is not None:  # what "auto" measured and learned, to explain its choices
        policy = pipe.block_policy
        result["block_policy"] = {"round_ms_by_drafts": [1e3 * c for c in policy.round_cost_s],
                                  "switch_ms": 1e3 * policy.switch_cost_s,
                                  "acceptance_by_position": policy.acceptance()}
    result["runs"] = [{"mode": r.mode, "prompt_set": r.prompt_set, "prompt": r.prompt_index, "tokens": r.num_tokens,
                       "wall_s": round(r.wall_s, 4), "foreign_cores": round(r.foreign_cores, 2)} for r in runs]
    return result
