"""The bench's runners: each mode as a callable `runner(prompt_ids, max_new_tokens)` ->
(tokens, wall seconds, TTFT seconds, stats), and `build_runners` making them by mode name.

Contract: `OursRunner` = this pipeline (`block_size=None`: autoregressive; "auto": block_policy);
`OracleRunner` = this pipeline with `PerfectDrafter` (the real drafter's cost, the known greedy
continuation as its drafts); `GenaiRunner` = openvino.genai's LLMPipeline (ar, dflash, prompt
lookup) with prefix caching off, as ours (`prefix_cache=False`). Our runners' stats are a
`GenerationStats`, genai's a dict of round counters. `build_runners(model_dir, modes, block_sizes, config, notes, target_runner)`
-> {"pipe", "runners": {mode name: runner}, "drafter_kind": the manifest's drafter kind, None
without a drafter}; a mode that cannot run here is skipped with a line appended to `notes`
(genai-dflash with a drafter kind other than "dflash", which openvino.genai does not run), an
unknown mode is a one-line ClickException.
"""
from __future__ import annotations

import time
from pathlib import Path

import click
import numpy as np

from ..decode.stats import GenerationStats
from ..manifest import drafter_kind, load_manifest
from ..ov.precision import compile_config
from ..pipeline import DFlashPipeline


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
        return self.known(start, num_drafts)

    def known(self, start: int, num_drafts: int) -> np.ndarray:
        known = self.sequence[start + 1:start + 1 + num_drafts]
        return np.array(known + [self.pad_token_id] * (num_drafts - len(known)), dtype=np.int64)

    def __getattr__(self, name):  # the rest (its context, block size) is the real drafter's
        return getattr(self.drafter, name)


class GreedyReferences:
    """What a perfect drafter knows: a prompt followed by the pipeline's greedy AR continuation,
    computed once per (prompt, max_new_tokens) and outside any timed run."""

    def __init__(self, pipe: DFlashPipeline):
        self.pipe = pipe
        self.continuations: dict[tuple, list[int]] = {}

    def __call__(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self.continuations:
            self.continuations[key] = [e.token for e in self.pipe.generate_tokens(
                prompt_ids, max_new_tokens, draft=False, stats=GenerationStats())]
        return list(prompt_ids) + self.continuations[key]


class OracleRunner:
    """`oracle@B`: this pipeline at block size B with `PerfectDrafter` (the runtime's ceiling)."""

    def __init__(self, pipe: DFlashPipeline, block_size: int):
        self.references = GreedyReferences(pipe)
        self.drafter = PerfectDrafter(pipe.drafter, pipe.mask_token_id or 0)
        self.pipe = DFlashPipeline(pipe.target, self.drafter, pipe.tokenizer, pipe.eos_token_ids, pipe.block_size,
                                   pipe.mask_token_id, pipe.model_dir, pipe.bos_token_id,
                                   prefix_cache=pipe.prefix_cache)  # as the modes it is compared with
        self.runner = OursRunner(self.pipe, block_size, prompt_lookup=False)  # only the perfect drafter

    def __call__(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float, float, GenerationStats]:
        self.drafter.sequence = self.references(prompt_ids, max_new_tokens)
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


def build_runners(model_dir: Path, modes: list[str], block_sizes: list[int | str], config: dict,
                  notes: list[str], target_runner: str | None = None, wide_target: bool | None = None) -> dict:
    manifest = load_manifest(model_dir)
    # every run prefills its prompt whole, as genai's modes do with their prefix caching off
    pipe = DFlashPipeline.from_pretrained(model_dir, target_runner=target_runner, wide_target=wide_target,
                                          prefix_cache=False, **config)
    drafter = drafter_kind(manifest) if pipe.drafter is not None else None
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
            if mode == "genai-dflash" and drafter not in (None, "dflash"):
                notes.append(f"genai-dflash: skipped, openvino.genai runs DFlash 1 drafters and this one is {drafter!r}")
                continue
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
    return {"pipe": pipe, "runners": runners, "drafter_kind": drafter}
