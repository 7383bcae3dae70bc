"""`ovdflash bench --concurrency 1,2,4,8`: several requests at once, batched DFlash against batched AR.

Contract:
- Modes (`CONCURRENCY_MODES`; `DEFAULT_CONCURRENCY_MODES`: all but the oracle), all greedy on the
  same target IR, each given the same C prompts:
  `batch-dflash@B` (`DFlashPipeline.generate_batch` of the C prompts at block size B, lookup drafts
  as the pipeline's default), `batch-ar` (generate_batch with draft=False), `genai-cb`
  (openvino.genai's ContinuousBatchingPipeline, autoregressive, the C prompts in one generate call,
  prefix caching off as in every genai mode of the bench, and off for ours too), `seq-dflash@B` (our single-sequence
  DFlash, `runners.OursRunner`, over the C prompts one after another: the baseline a batch must
  beat), and `batch-oracle@B` (batch-dflash@B with every sequence's drafter replaced by
  `modes.PerfectDrafter`: the real drafter's calls paid, the known greedy continuation proposed,
  no lookup drafts; the batched runtime's ceiling). A mode that cannot run here is skipped with a note.
- `run_concurrency(pipe, prompts, concurrency, max_new_tokens, modes, block_sizes, repetitions,
  warmup, genai_cb=None, progress=None)` -> the summary below plus `runs`. `prompts` maps a prompt
  set to token-id prompts; the batch of concurrency C in repetition r is prompts
  [(r*C + j) mod N for j < C]. Interleaving: warm-up calls untimed (min(16, max_new_tokens)
  tokens, every C and mode), then for each repetition, each set, each C: every mode once, the
  order `rotated` by the repetition, so drift in machine load hits all modes alike.
- Per set, C and mode: `tokens_per_s` = median over repetitions of (output tokens of all C
  requests / wall time of the whole batch, or of the C calls in a row for seq-dflash); `tpot_ms`
  and `ttft_ms` = medians over every request, TTFT counted from the moment all C arrived (a
  seq-dflash request's includes its wait for the ones before it); acceptance pooled over runs (GenerationStats.merge);
  `profile` = where the time goes, per decode round: `target_ms_per_round` (one target inference),
  `target_tokens_per_round` (tokens sent to it), `draft_ms_per_round` (every sequence's drafter
  calls), `host_ms_per_round` (the rest of the wall time after prefill calls, target and drafts),
  `tokens_per_round` (tokens emitted). `TargetCallMeter` counts and times the target inferences at
  the runner's forward: batched modes at the batched runner's (`num_steps`, `num_batched_tokens`
  as the Scheduler counts them; an inference holding a prefill is a prefill call), seq-dflash at
  the single-sequence target's; genai-cb counts its `step()`s (stepped here, one target inference
  each; the first prefills every request; its target time holds its host work).
- `ratios` per C: each batch-dflash over the faster of batch-ar and genai-cb ("best batched AR"),
  over seq-dflash at the same B, each batch-oracle over the best batched AR (`... / best batched AR,
  ceiling`, never a goal's value), and batch-ar over genai-cb. `goals`: the three targets
  (>= 1.0x best batched AR at every C, >= 2.0x seq-dflash at C=4, >= 1.5x batch-ar at C <= 2 on
  `code`) with the measured value (the best block size) and whether it is met. DFlash entries
  also count the drafts and accepted tokens that came from n-gram lookup (`num_lookup_*`).
  `agreement`: per C and mode, the fraction of requests whose tokens equal batch-ar's.
- `run_concurrency_bench(model_dir, ...)` loads the pipeline (and genai's pipeline) and the prompt
  sets as `ovdflash bench` does; `concurrency_command(...)` is the CLI's branch: it writes
  `OUT/bench_concurrency.json` (+ `settings` with the drafter's kind, `host` =
  `ovdflash.ov.host.collect()`) and `OUT/bench_concurrency.png` (aggregate tok/s against C) and
  prints the tables.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import click
import numpy as np

from ..decode.stats import GenerationStats
from ..pipeline import DFlashPipeline
from .measure import CpuMeter, rotated
from .modes import GreedyReferences, OursRunner, PerfectDrafter

CONCURRENCY_MODES = ("batch-dflash", "batch-ar", "genai-cb", "seq-dflash", "batch-oracle")
DEFAULT_CONCURRENCY_MODES = CONCURRENCY_MODES[:4]  # the oracle, a ceiling, runs when asked
BATCHED_AR = ("batch-ar", "genai-cb")  # the rivals of batch-dflash; the faster one is "best batched AR"
GOAL_SEQUENTIAL_AT = 4                 # the concurrency of the "against the same requests in a row" goal
GOAL_CODE_AT = (1, 2)                  # the concurrencies of the "on code" goal


def parse_concurrency(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8]; each at least 1."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise click.BadParameter(f"concurrency levels must be integers >= 1, got {text!r}")
    return values


@dataclass
class BatchRun:
    mode: str
    prompt_set: str
    concurrency: int
    repetition: int
    prompt_indices: list[int]
    wall_s: float
    token_ids: list[list[int]]
    ttft_s: list[float]
    tpot_s: list[float]
    profile: dict                            # counters of this run (see the module doc), summed later
    spec: GenerationStats | None = None      # ours: every request's stats merged
    foreign_cores: float = float("nan")

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def prompt_index(self) -> str:  # for the bench's progress line
        return f"C={self.concurrency} rep {self.repetition}"


def _batched_call(batch) -> tuple[int, bool]:
    """A batched forward's (tokens sent, holds a prefill): a prefill asks for its last row only."""
    return sum(len(ids) for _, ids, _ in batch), any(len(rows) != len(ids) for _, ids, rows in batch)


def _single_call(token_ids, all_logits: bool = True) -> tuple[int, bool]:
    """A single-sequence forward's (tokens sent, is the prefill): only the prefill skips all logits."""
    return len(token_ids), not all_logits


class TargetCallMeter:
    """Counts and times a target's inferences while it is entered (its forward wrapped);
    `classify(*args, **kwargs)` -> (tokens sent, is a prefill call)."""

    def __init__(self, target, classify=_batched_call):
        self.target, self.classify = target, classify
        self.calls = self.tokens = self.prefill_calls = self.prefill_tokens = 0
        self.seconds = self.prefill_seconds = 0.0

    def __enter__(self):
        forward = self.target.forward

        def counted(*args, **kwargs):
            t0 = time.perf_counter()
            out = forward(*args, **kwargs)
            dt = time.perf_counter() - t0
            num_tokens, prefill = self.classify(*args, **kwargs)
            self.calls += 1
            self.tokens += num_tokens
            if prefill:
                self.prefill_calls += 1
                self.prefill_tokens += num_tokens
                self.prefill_seconds += dt
            else:
                self.seconds += dt
            return out

        self.target.forward = counted  # an instance attribute: the class's method comes back on exit
        return self

    def __exit__(self, *exc):
        del self.target.forward

    def profile(self, draft_s: float, wall_s: float, num_tokens: int, num_requests: int) -> dict:
        """The run's counters for `_per_round`: each request's first token comes from its prefill."""
        return _profile(self.calls - self.prefill_calls, self.seconds, self.tokens - self.prefill_tokens, draft_s,
                        self.prefill_seconds, wall_s, num_tokens - num_requests, self.prefill_calls)


def _profile(rounds: int, target_s: float, target_tokens: int, draft_s: float, prefill_s: float, wall_s: float,
             decode_tokens: int, prefill_calls: int) -> dict:
    """A run's raw counters; `_per_round` turns pooled counters into per-round figures."""
    return {"rounds": rounds, "target_s": target_s, "target_tokens": target_tokens, "draft_s": draft_s,
            "prefill_s": prefill_s, "prefill_calls": prefill_calls, "wall_s": wall_s, "decode_tokens": decode_tokens}


def _per_round(p: dict) -> dict:
    r = p["rounds"]
    host = p["wall_s"] - p["prefill_s"] - p["target_s"] - p["draft_s"]
    return {"rounds": r, "prefill_calls": p["prefill_calls"], "prefill_ms": 1e3 * p["prefill_s"],
            "target_ms_per_round": 1e3 * p["target_s"] / r if r else 0.0,
            "target_tokens_per_round": p["target_tokens"] / r if r else 0.0,
            "draft_ms_per_round": 1e3 * p["draft_s"] / r if r else 0.0,
            "host_ms_per_round": 1e3 * host / r if r else 0.0,
            "tokens_per_round": p["decode_tokens"] / r if r else 0.0}


class BatchedRunner:
    """`batch-dflash@B` (block_size B) or `batch-ar` (block_size None): generate_batch of all prompts."""

    prompt_lookup: bool | None = None  # None: the pipeline's default

    def __init__(self, pipe: DFlashPipeline, block_size: int | None):
        self.pipe, self.block_size = pipe, block_size

    def __call__(self, prompts: list[list[int]], max_new_tokens: int):
        draft = self.block_size is not None
        with TargetCallMeter(self.pipe.batch_target()) as meter:
            t0 = time.perf_counter()
            results = self.pipe.generate_batch(prompts, max_new_tokens=max_new_tokens,
                                               block_size=self.block_size if draft else 1, draft=draft,
                                               max_batch_size=len(prompts), prefix_cache=False,
                                               prompt_lookup=self.prompt_lookup)
            wall = time.perf_counter() - t0
        stats = GenerationStats()
        for r in results:
            stats.merge(r.stats)
        tokens = [list(r.token_ids) for r in results]
        profile = meter.profile(stats.draft_s, wall, sum(len(t) for t in tokens), len(tokens))
        profile["num_steps"], profile["num_batched_tokens"] = meter.calls, meter.tokens
        return tokens, wall, [r.stats.ttft_s for r in results], [r.stats.tpot_s for r in results], profile, stats


class OracleDrafterPool:
    """The pipeline's drafter pool with each drafter taken wrapped in a `PerfectDrafter` that knows
    the next reference in admission order (the scheduler admits the prompts in order)."""

    def __init__(self, pool, sequences: list[list[int]], pad_token_id: int):
        self.pool, self.sequences, self.pad_token_id = pool, sequences, pad_token_id
        self.num_taken = 0

    def take(self) -> PerfectDrafter:
        drafter = PerfectDrafter(self.pool.take(), self.pad_token_id)
        drafter.sequence = self.sequences[self.num_taken]
        self.num_taken += 1
        return drafter

    def give(self, drafter: PerfectDrafter) -> None:
        self.pool.give(drafter.drafter)

    def propose_many(self, calls: list[tuple]) -> list[np.ndarray]:
        """The real drafters' calls (in one, where the pool batches them), then the known drafts."""
        real = [(d.drafter, *args) for d, *args in calls]
        if hasattr(self.pool, "propose_many"):
            self.pool.propose_many(real)
        else:
            for drafter, *args in real:
                drafter.propose(*args)
        return [d.known(start, k) for d, _, _, start, k in calls]


class BatchedOracleRunner(BatchedRunner):
    """`batch-oracle@B`: generate_batch at block size B, every sequence drafting its own greedy
    continuation (computed once per prompt, outside the timed run) at the real drafter's cost."""

    prompt_lookup = False  # only the perfect drafter drafts

    def __init__(self, pipe: DFlashPipeline, block_size: int):
        super().__init__(pipe, block_size)
        self.references = GreedyReferences(pipe)

    def __call__(self, prompts: list[list[int]], max_new_tokens: int):
        sequences = [self.references(ids, max_new_tokens) for ids in prompts]
        pool = self.pipe.drafter_pool()
        # generate_batch takes its drafters from the pipeline's pool: swapped for this run only
        self.pipe._batch.drafter_pool = OracleDrafterPool(pool, sequences, self.pipe.mask_token_id or 0)
        try:
            return super().__call__(prompts, max_new_tokens)
        finally:
            self.pipe._batch.drafter_pool = pool


class SequentialRunner:
    """`seq-dflash@B`: our single-sequence DFlash over the prompts, one request after another."""

    def __init__(self, pipe: DFlashPipeline, block_size: int):
        self.single = OursRunner(pipe, block_size)

    def __call__(self, prompts: list[list[int]], max_new_tokens: int):
        tokens, ttfts, tpots, stats = [], [], [], GenerationStats()
        with TargetCallMeter(self.single.pipe.target, _single_call) as meter:
            t0 = time.perf_counter()
            for ids in prompts:
                queued = time.perf_counter() - t0  # every request arrived at t0 and waits its turn
                out, _, ttft, call = self.single(ids, max_new_tokens)
                tokens.append(out)
                ttfts.append(queued + ttft)
                tpots.append(call.tpot_s)
                stats.merge(call)
            wall = time.perf_counter() - t0
        return tokens, wall, ttfts, tpots, meter.profile(stats.draft_s, wall, sum(len(t) for t in tokens),
                                                         len(tokens)), stats


class GenaiCBRunner:
    """`genai-cb`: openvino.genai's ContinuousBatchingPipeline, autoregressive, all prompts in one call."""

    def __init__(self, model_dir: Path, manifest: dict, config: dict, eos_ids: list[int]):
        import openvino as ov
        import openvino_genai as og

        self.og, self.ov, self.eos_ids = og, ov, eos_ids
        sc = og.SchedulerConfig()
        sc.enable_prefix_caching = False  # as GenaiRunner: every run pays its prefill (see its comment)
        sc.max_num_batched_tokens = 4096
        sc.cache_size = 1
        props = {k: v for k, v in config.items() if k != "CACHE_DIR"}
        target_dir = str(model_dir / manifest.get("target", {}).get("path", "target"))
        self.pipe = og.ContinuousBatchingPipeline(target_dir, sc, "CPU", props)

    def __call__(self, prompts: list[list[int]], max_new_tokens: int):
        cfg = self.og.GenerationConfig()
        cfg.max_new_tokens = max_new_tokens
        cfg.stop_token_ids = set(self.eos_ids)
        tokens = [[] for _ in prompts]
        first, last = [0.0] * len(prompts), [0.0] * len(prompts)
        # stepped here, not generate(): per-request token times measured as ours are (its own TPOT
        # for a batch is not per request)
        t0 = time.perf_counter()
        handles = [self.pipe.add_request(i, self.ov.Tensor(np.asarray([p], dtype=np.int64)), cfg)
                   for i, p in enumerate(prompts)]
        steps, first_step_s = 0, 0.0
        while self.pipe.has_non_finished_requests():
            self.pipe.step()
            steps += 1
            now = time.perf_counter()
            first_step_s = first_step_s or now - t0
            for i, handle in enumerate(handles):
                if handle.can_read():
                    for output in handle.read().values():
                        if len(output.generated_ids):
                            first[i] = first[i] or now - t0
                            last[i] = now - t0
                            tokens[i].extend(int(t) for t in output.generated_ids)
        wall = time.perf_counter() - t0
        tpots = [(last[i] - first[i]) / (len(t) - 1) if len(t) > 1 else 0.0 for i, t in enumerate(tokens)]
        # a step is one target inference with its host work (not separable here); step 1 prefills all,
        # then each step sends one token a running request: as many as it emits
        decode_tokens = sum(len(t) for t in tokens) - len(tokens)
        profile = _profile(steps - 1, wall - first_step_s, decode_tokens, 0.0, first_step_s, wall, decode_tokens, 1)
        return tokens, wall, first, tpots, profile, None


def build_concurrency_runners(pipe: DFlashPipeline, modes: list[str], block_sizes: list[int], notes: list[str],
                              genai_cb: Callable[[], GenaiCBRunner] | None = None) -> dict:
    """{mode name: runner}; `genai_cb` builds the genai runner (None: openvino_genai is missing)."""
    runners = {}
    for mode in modes:
        if mode not in CONCURRENCY_MODES:
            raise click.ClickException(f"unknown concurrency mode {mode!r} (choose from {', '.join(CONCURRENCY_MODES)})")
        if mode in ("batch-dflash", "seq-dflash", "batch-oracle"):
            if pipe.drafter is None:
                notes.append(f"{mode}: skipped, the model has no drafter")
                continue
            for b in block_sizes:
                if mode == "batch-oracle":
                    if b == "auto":
                        notes.append("batch-oracle@auto: skipped, the oracle runs fixed block sizes only")
                    else:
                        runners[f"{mode}@{b}"] = BatchedOracleRunner(pipe, b)
                    continue
                if mode == "batch-dflash" and b == "auto":
                    try:  # generate_batch may not choose drafts by itself: ask it with one token
                        pipe.generate_batch([[pipe.eos_token_ids[0] if pipe.eos_token_ids else 0]], max_new_tokens=1,
                                            block_size="auto")
                    except ValueError as exc:
                        notes.append(f"batch-dflash@auto: skipped, {exc}")
                        continue
                if b == "auto":
                    pipe.auto_block_policy()  # measure its cost curves now, not inside a timed run
                runners[f"{mode}@{b}"] = (BatchedRunner if mode == "batch-dflash" else SequentialRunner)(pipe, b)
        elif mode == "batch-ar":
            runners[mode] = BatchedRunner(pipe, None)
        elif genai_cb is None:
            notes.append("genai-cb: skipped, openvino_genai is not installed")
        else:
            try:
                runners[mode] = genai_cb()
            except Exception as exc:  # report why, keep benchmarking the rest
                notes.append(f"genai-cb: could not be built: {str(exc).splitlines()[0][:200]}")
    return runners


def batch_of(prompts: list, concurrency: int, repetition: int) -> list[int]:
    """Indices of the C prompts of one repetition (prompts cycle when there are fewer than C)."""
    return [(repetition * concurrency + j) % len(prompts) for j in range(concurrency)]


def run_concurrency(pipe: DFlashPipeline, prompts: dict[str, list[list[int]]], concurrency: list[int],
                    max_new_tokens: int, modes: list[str], block_sizes: list[int], repetitions: int, warmup: int,
                    genai_cb: Callable[[], GenaiCBRunner] | None = None, notes: list[str] | None = None,
                    progress: Callable | None = None) -> dict:
    notes = [] if notes is None else notes
    runners = build_concurrency_runners(pipe, modes, block_sizes, notes, genai_cb)
    names = list(runners)
    first = next(iter(prompts.values()))
    for _ in range(warmup):  # first-shape costs of every batch width
        for c in concurrency:
            for name in names:
                runners[name]([first[i] for i in batch_of(first, c, 0)], min(16, max_new_tokens))
    meter, runs = CpuMeter(), []
    total, done = repetitions * len(prompts) * len(concurrency) * len(names), 0
    for rep in range(repetitions):
        order = rotated(names, rep)
        for set_name, set_prompts in prompts.items():
            for c in concurrency:
                indices = batch_of(set_prompts, c, rep)
                batch = [set_prompts[i] for i in indices]
                for name in order:
                    started = meter.start()
                    tokens, wall, ttfts, tpots, profile, stats = runners[name](batch, max_new_tokens)
                    runs.append(BatchRun(name, set_name, c, rep, indices, wall, tokens, ttfts, tpots, profile, stats,
                                         meter.foreign_cores(started)))
                    done += 1
                    if progress:
                        progress(done, total, runs[-1])
    result = summarize_concurrency(runs, names, list(prompts), concurrency, notes)
    result["runs"] = [{"mode": r.mode, "prompt_set": r.prompt_set, "concurrency": r.concurrency,
                       "repetition": r.repetition, "prompts": r.prompt_indices,
                       "tokens": [len(t) for t in r.token_ids], "wall_s": round(r.wall_s, 4),
                       "foreign_cores": round(r.foreign_cores, 2)} for r in runs]
    return result


def _median(xs):
    return statistics.median(xs) if xs else None


def summarize_concurrency(runs: list[BatchRun], names: list[str], prompt_sets: list[str], concurrency: list[int],
                          notes: list[str]) -> dict:
    out = {"modes": names, "concurrency": concurrency, "prompt_sets": {}, "notes": notes}
    for set_name in prompt_sets:
        per_c = {}
        for c in concurrency:
            per_mode = {}
            for name in names:
                rs = [r for r in runs if r.mode == name and r.prompt_set == set_name and r.concurrency == c]
                if not rs:
                    continue
                entry = {"tokens_per_s": _median([r.tokens_per_s for r in rs]),
                         "tpot_ms": 1e3 * _median([t for r in rs for t in r.tpot_s]),
                         "ttft_ms": 1e3 * _median([t for r in rs for t in r.ttft_s]),
                         "num_runs": len(rs), "num_requests": sum(len(r.token_ids) for r in rs),
                         "num_tokens": sum(r.num_tokens for r in rs),
                         "foreign_cores": _median([r.foreign_cores for r in rs])}
                if rs[0].profile:
                    pooled = {k: sum(r.profile[k] for r in rs) for k in rs[0].profile}
                    entry["profile"] = _per_round(pooled)
                    for k in ("num_steps", "num_batched_tokens"):
                        if k in pooled:
                            entry["profile"][k] = pooled[k]
                if rs[0].spec is not None and ("dflash" in name or "oracle" in name):
                    spec = GenerationStats()
                    for r in rs:
                        spec.merge(r.spec)
                    entry.update({"mean_acceptance_length": spec.mean_acceptance_length,
                                  "acceptance_rate": spec.acceptance_rate, "num_drafts": spec.num_drafts,
                                  "num_ar_steps": spec.num_ar_steps, "num_lookup_drafts": spec.num_lookup_drafts,
                                  "num_accepted_tokens": spec.num_accepted_tokens,
                                  "num_lookup_accepted_tokens": spec.num_lookup_accepted_tokens})
                per_mode[name] = entry
            per_c[str(c)] = {"modes": per_mode, "ratios": _ratios(per_mode)}
        out["prompt_sets"][set_name] = per_c
    out["agreement"] = _agreement(runs, names)
    out["goals"] = _goals(out["prompt_sets"], concurrency)
    return out


def _best_batched_ar(per_mode: dict) -> float | None:
    rivals = [per_mode[m]["tokens_per_s"] for m in BATCHED_AR if m in per_mode]
    return max(rivals) if rivals else None


def _ratios(per_mode: dict) -> dict:
    tps = {name: e["tokens_per_s"] for name, e in per_mode.items()}
    best, out = _best_batched_ar(per_mode), {}
    for name, value in tps.items():
        if name.startswith("batch-dflash@"):
            if best:
                out[f"{name} / best batched AR"] = value / best
            seq = "seq-dflash@" + name.split("@", 1)[1]
            if tps.get(seq):
                out[f"{name} / {seq}"] = value / tps[seq]
        elif name.startswith("batch-oracle@") and best:
            out[f"{name} / best batched AR, ceiling"] = value / best
    if tps.get("batch-ar") and tps.get("genai-cb"):
        out["batch-ar / genai-cb"] = tps["batch-ar"] / tps["genai-cb"]
    return out


def _best_ratio(ratios: dict, suffix: str) -> float | None:
    """The best block size's ratio among keys 'batch-dflash@B / <suffix>' (suffix may end in '@')."""
    values = [v for k, v in ratios.items()
              if k.startswith("batch-dflash@") and k.split(" / ", 1)[1].startswith(suffix)]
    return max(values) if values else None


def _goals(sets: dict, concurrency: list[int]) -> dict:
    def goal(values, need):
        values = [v for v in values if v is not None]
        return {"value": min(values), "target": need, "met": min(values) >= need} if values else None

    every_c = [_best_ratio(per_c[str(c)]["ratios"], "best batched AR") for per_c in sets.values() for c in concurrency]
    seq = [_best_ratio(per_c[str(GOAL_SEQUENTIAL_AT)]["ratios"], "seq-dflash@") for per_c in sets.values()
           if str(GOAL_SEQUENTIAL_AT) in per_c]
    code = []
    for c in GOAL_CODE_AT:
        per_mode = sets.get("code", {}).get(str(c), {}).get("modes", {})
        dflash = [e["tokens_per_s"] for n, e in per_mode.items() if n.startswith("batch-dflash@")]
        if dflash and per_mode.get("batch-ar"):
            code.append(max(dflash) / per_mode["batch-ar"]["tokens_per_s"])
    goals = {"batch-dflash >= 1.0x best batched AR at every concurrency (worst case)": goal(every_c, 1.0),
             f"batch-dflash >= 2.0x seq-dflash at concurrency {GOAL_SEQUENTIAL_AT}": goal(seq, 2.0),
             "batch-dflash >= 1.5x batch-ar on code at concurrency 1-2 (worst case)": goal(code, 1.5)}
    return {k: v for k, v in goals.items() if v is not None}


def _agreement(runs: list[BatchRun], names: list[str]) -> dict:
    """Per C and mode: fraction of requests whose tokens equal batch-ar's for the same prompt and repetition."""
    ref = {}
    for r in runs:
        if r.mode == "batch-ar":
            for i, tokens in zip(r.prompt_indices, r.token_ids):
                ref[(r.prompt_set, r.concurrency, r.repetition, i)] = tokens
    out = {}
    for name in names:
        for c in sorted({r.concurrency for r in runs}):
            same = [tokens == ref[(r.prompt_set, c, r.repetition, i)]
                    for r in runs if r.mode == name and r.concurrency == c
                    for i, tokens in zip(r.prompt_indices, r.token_ids) if (r.prompt_set, c, r.repetition, i) in ref]
            if same:
                out.setdefault(name, {})[str(c)] = sum(same) / len(same)
    return out


def run_concurrency_bench(model_dir: Path, concurrency: list[int], prompt_sets: list[str], num_prompts: int,
                          max_new_tokens: int, modes: list[str], block_sizes: list[int | str] | None,
                          repetitions: int, warmup: int, config: dict, progress: Callable | None = None,
                          target_runner: str | None = None, wide_target: bool | None = None) -> dict:
    """Loads the pipeline, prompts and genai's pipeline as `ovdflash bench` does, then `run_concurrency`.
    `block_sizes=None`: the manifest's default block size."""
    from ..manifest import drafter_kind, load_manifest
    from ..ov.precision import compile_config
    from .prompts import encode_prompts

    manifest, notes = load_manifest(model_dir), []
    # every mode prefills every prompt whole, as genai-cb does with its prefix caching off
    pipe = DFlashPipeline.from_pretrained(model_dir, target_runner=target_runner, prefix_cache=False,
                                          wide_target=wide_target, **config)
    block_sizes = block_sizes or [pipe.default_block_size]
    prompts = {name: encode_prompts(pipe, name, num_prompts) for name in prompt_sets}
    if num_prompts < max(concurrency):
        notes.append(f"{num_prompts} prompts a set: batches above C={num_prompts} repeat prompts")
    if getattr(pipe.target, "wide_request", None) is not None:
        notes.append(f"our modes run target calls of {pipe.target.wide_from}+ tokens on the f32-weight copy")
    genai_cb = None
    try:
        import openvino_genai  # noqa: F401

        full, _ = compile_config(manifest, config)
        genai_cb = lambda: GenaiCBRunner(model_dir, manifest, full, pipe.eos_token_ids)  # noqa: E731
    except ImportError:
        pass
    result = run_concurrency(pipe, prompts, concurrency, max_new_tokens, modes, block_sizes, repetitions, warmup,
                             genai_cb, notes, progress)
    result["target_runner"] = pipe.target.kind
    result["drafter_kind"] = drafter_kind(manifest) if pipe.drafter is not None else None
    result["block_sizes"] = block_sizes
    return result


def host_line(host: dict) -> str:
    cpu = host.get("cpu", {})
    return (f"host: {cpu.get('model')}; OPTIMIZATION_CAPABILITIES {' '.join(cpu.get('optimization_capabilities', []))}; "
            f"{host.get('cores', {}).get('usable_cpus')} usable CPUs")


def render_concurrency(result: dict, console) -> None:
    from rich.table import Table

    for set_name, per_c in result["prompt_sets"].items():
        table = Table(title=f"{set_name}: concurrent requests (aggregate tok/s = all requests' tokens / wall)")
        for col in ("C", "mode", "agg tok/s", "TPOT ms", "TTFT ms", "accept len", "rounds", "target ms/rd",
                    "target tok/rd", "draft ms/rd", "host ms/rd", "tok/rd", "busy"):
            table.add_column(col, justify="right")
        for c, data in per_c.items():
            for name, e in data["modes"].items():
                p = e.get("profile", {})

                def f(d, key, fmt="{:.1f}"):
                    return fmt.format(d[key]) if d.get(key) is not None else "-"
                table.add_row(c, name, f(e, "tokens_per_s"), f(e, "tpot_ms"), f(e, "ttft_ms", "{:.0f}"),
                              f(e, "mean_acceptance_length", "{:.2f}"), f(p, "rounds", "{:d}"),
                              f(p, "target_ms_per_round"), f(p, "target_tokens_per_round"), f(p, "draft_ms_per_round"),
                              f(p, "host_ms_per_round"), f(p, "tokens_per_round", "{:.2f}"),
                              f(e, "foreign_cores"))
        console.print(table)
        console.print("  per round = per decode round (a target inference for every running request); busy = "
                      "median CPU cores used by other processes during a run")
        for c, data in per_c.items():
            if data["ratios"]:
                console.print(f"  C={c}: " + ", ".join(f"{k} = {v:.2f}x" for k, v in data["ratios"].items()))
    for goal, g in result.get("goals", {}).items():
        console.print(f"goal: {goal}: {g['value']:.2f}x ({'met' if g['met'] else 'not met'})")
    for note in result["notes"]:
        console.print(f"note: {note}")
    if result.get("agreement"):
        console.print("token agreement with batch-ar: " + "; ".join(
            f"{name} " + " ".join(f"C={c} {v:.0%}" for c, v in per.items()) for name, per in result["agreement"].items()))
    if result.get("settings", {}).get("drafter_kind"):
        console.print(f"drafter kind: {result['settings']['drafter_kind']}")
    if result.get("host"):
        console.print(host_line(result["host"]))


def plot_concurrency(result: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(result["prompt_sets"])
    fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 4), squeeze=False)
    for ax, set_name in zip(axes[0], sets):
        per_c = result["prompt_sets"][set_name]
        for i, name in enumerate(result["modes"]):
            cs = [int(c) for c, d in per_c.items() if name in d["modes"]]
            ax.plot(cs, [per_c[str(c)]["modes"][name]["tokens_per_s"] for c in cs], marker="o", color=f"C{i}",
                    linestyle="-" if name.startswith("batch-dflash") else "--", label=name)
        ax.set(xlabel="concurrent requests", ylabel="aggregate output tok/s", title=set_name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["concurrency"], [str(c) for c in result["concurrency"]])
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


def concurrency_command(model_dir: Path, concurrency: list[int], prompt_sets: list[str], num_prompts: int,
                        max_new_tokens: int, modes: list[str], block_sizes, repetitions: int, warmup: int,
                        out_dir: Path, config: dict, target_runner: str | None, console, progress,
                        wide_target: bool | None = None) -> dict:
    """The CLI's --concurrency branch: run, write OUT/bench_concurrency.{json,png}, print the tables."""
    from ..ov.host import collect

    unknown = [m for m in modes if m not in CONCURRENCY_MODES]
    if unknown:  # before anything compiles
        raise click.ClickException(f"unknown concurrency mode {unknown[0]!r} (choose from {', '.join(CONCURRENCY_MODES)})")
    try:
        result = run_concurrency_bench(model_dir, concurrency, prompt_sets, num_prompts, max_new_tokens, modes,
                                       block_sizes, repetitions, warmup, config, progress, target_runner,
                                       wide_target)
    except ValueError as exc:  # e.g. a block size generate_batch refuses: one line
        raise click.ClickException(str(exc)) from None
    result["settings"] = dict(model_dir=str(model_dir), concurrency=concurrency, prompt_sets=prompt_sets,
                              num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                              block_sizes=result.pop("block_sizes"), repetitions=repetitions, warmup=warmup,
                              config=config, target_runner=result.pop("target_runner"),
                              drafter_kind=result.pop("drafter_kind"), wide_target=wide_target,
                              machine=f"{os.cpu_count()} CPUs", date=time.strftime("%Y-%m-%d %H:%M:%S"))
    result["host"] = collect()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_concurrency.json").write_text(json.dumps(result, indent=1))
    plot_concurrency(result, out_dir / "bench_concurrency.png")
    render_concurrency(result, console)
    console.print(f"wrote {out_dir / 'bench_concurrency.json'} and {out_dir / 'bench_concurrency.png'}")
    return result
