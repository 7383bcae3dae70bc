"""DFlashPipeline: the public object. Text in, text out, lossless speculative decoding inside.

Contract:
- `DFlashPipeline.from_pretrained(model_dir=None, device="CPU", draft=True, cache_dir=None,
  precision=None, **compile_options)` reads an exported directory (ovdflash.manifest) and
  compiles both models with CACHE_DIR set. `precision` ("f32", the default, or "bf16") and the
  compile options decide the numerics as `ovdflash.ov.precision` says; `numerics` records them.
  `release_weight_pages` (default True) primes every kernel shape once and then drops the mapped IR
  files' resident pages, which the plugin no longer reads once it has repacked the weights.
  `wide_target` (None: where memory allows): a paged target with fp16 weights under f32 inference
  also gets an f32-weight copy for its calls of many tokens, timed at load (ovdflash.ov.wide_target;
  output unchanged: the same f32 arithmetic on the same weight values). No directory = the
  embedded default model (`ovdflash_models.default.ensure_default_model()`). `draft=False`
  compiles the target only (autoregressive baseline). `use_draft_vocab=False` ignores a
  shipped `drafter/draft_vocab.json` (full-vocabulary drafting head).
- `generate(prompt_or_messages, max_new_tokens, temperature, top_p, top_k, seed, stop,
  block_size, draft, apply_chat_template)` -> `GenerationResult(text, token_ids, finish_reason, stats)`.
  `stream(...)` yields text once per accepted block (the same text, in pieces);
  `stream_rounds(prompt, result, stop, **kwargs)` once per round, filling `result`. `draft=None`
  uses the drafter when one is loaded; `draft=False` (or block_size=1) is plain autoregressive.
  `block_size="auto"`: a `block_policy.BlockPolicy` picks the drafts per round (0 = AR step, at
  most the trained block - 1); its cost curves are measured on the real models at the first
  "auto" call (`auto_block_policy()`, ~2-6 s on SmolLM2) and it keeps learning acceptance
  across calls. `block_size=None` means `default_block_size`: from `from_pretrained`, the
  manifest's `default_block_size` ("auto" when absent; `ovdflash export --default-block-size`;
  the embedded default model fixes 4, ahead of 2 and level with "auto" on Zen 3-5 hosts:
  docs/BENCHMARKS.md), the trained block size (`block_size`) for a pipeline built directly.
  `generate_tokens(prompt_ids, ...)` is the token-level API (sequence.TokenEvent per token).
- `prompt_lookup` (from_pretrained, default True; per call: None = the pipeline's): rounds whose
  text so far ends with an n-gram seen earlier in it verify the tokens that followed it instead
  of the drafter's (ovdflash.decode.lookup; output unchanged). Only with the drafter in use.
- A prompt is a string (encoded with the tokenizer's special tokens, and the manifest's
  `bos_token_id` in front if the tokenizer did not add it), a list of chat messages (rendered
  with the chat template, which carries its own special tokens), or a list of token ids.
  `apply_chat_template=True` renders a string as one user message instead, as openvino.genai's
  LLMPipeline does by default (ours stays a raw completion by default, like vLLM's `generate`
  and transformers' text pipelines: a string is the model's input as written); it has no effect
  on messages or token ids.
- Stops: an EOS id ends generation at that token (kept in token_ids, not in text); a stop
  string ends it at the token that completes it, mid-block or not, and is cut from the text;
  streaming holds back text that could be the start of a stop string. `max_new_tokens` is
  exact. Tokens equal to `mask_token_id` are ordinary output.
- `prefix_cache` (from_pretrained / constructor, default True; per call: None = the pipeline's):
  a call keeps the KV (and drafter context) of the longest prefix of its prompt that the previous
  call left in the runners (its prompt and committed output: a chat's earlier turns) and prefills
  only the rest (ovdflash.decode.prefix_cache; `stats.num_cached_prompt_tokens`). Output is unchanged.
  On a hybrid target it reuses only a prompt that extends the cached tokens. `prefix_store` is that
  cache; code that runs `target` or `drafter` itself calls `prefix_store.invalidate()`.
- Stats: `last_stats` for the latest call, `stats` cumulative (ovdflash.decode.stats).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from .decode import sequence
from .decode.block_policy import BatchDraftPolicy, BlockPolicy, measure_batch_costs, measure_costs
from .decode.lookup import NgramLookup
from .decode.prefix_cache import PrefixCache
from .decode.sampling import SamplingParams
from .decode.stats import GenerationStats
from .manifest import load_manifest, parse_target_runner
from .ov.precision import Numerics, compile_config
from .text import (
    GenerationResult,
    check_messages,
    check_positive_int,
    check_stops,
    check_token_ids,
    extend_text,
    held_back,
)
from .tokenizer import IncrementalDetokenizer, Tokenizer

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "ovdflash" / "ov_cache"


CALIBRATION_PROMPT = "Explain in a few sentences how a CPU cache speeds up a program."


# drafts per round that "auto" times on first use; longer blocks extend the cost curve linearly
# (block_policy.measure_costs: each shape run costs resident memory). 4 drafts: a 5-token verify,
# because 1-4 tokens cost about an AR step and a fifth a step more (docs/BENCHMARKS.md, Verify cost);
# timed only up to 4 tokens, that jump was invisible and "auto" verified blocks past it.
CALIBRATED_DRAFTS = 4


def default_model_dir() -> Path:
    try:
        from ovdflash_models.default import ensure_default_model
    except ImportError as exc:
        raise RuntimeError("no model directory given and the embedded default model is not available "
                           f"({exc}); pass a directory made by `ovdflash export`") from exc
    return Path(ensure_default_model())


class DFlashPipeline:
    def __init__(self, target, drafter, tokenizer: Tokenizer | None, eos_token_ids: Sequence[int],
                 block_size: int, mask_token_id: int | None = None, model_dir: Path | None = None,
                 bos_token_id: int | None = None, default_block_size: int | str | None = None,
                 prompt_lookup: bool = True, prefix_cache: bool = True):
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.block_size = block_size  # the drafter's trained block: the largest "auto" verifies
        self.default_block_size = default_block_size if default_block_size is not None else block_size
        self.mask_token_id = mask_token_id
        self.model_dir = model_dir
        self.bos_token_id = bos_token_id  # prepended to plain-text prompts when the tokenizer does not
        self.stats = GenerationStats()       # cumulative
        self.last_stats = GenerationStats()  # latest call
        self.block_policy: BlockPolicy | None = None  # for block_size="auto"; built on first use
        self.prompt_lookup = prompt_lookup  # n-gram lookup drafts beside the drafter's (ovdflash.decode.lookup)
        self.prefix_cache = prefix_cache  # reuse the KV of the previous call's tokens (ovdflash.decode.prefix_cache)
        self.prefix_store = PrefixCache(target, drafter)  # what the runners hold between calls
        self.numerics: Numerics | None = None  # the target's precisions, when built by from_pretrained
        self.vocab_size: int | None = None  # token ids must be below it, when known
        self._busy = threading.Lock()  # one generation at a time: the runners hold one sequence's caches
        self._batch_target = None  # batched runner and drafter pool, made on the first generate_batch
        self._drafter_pool = None
        self._batch_draft_policy = None
        self._busy_thread: int | None = None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path | None = None, device: str = "CPU", draft: bool = True,
                        cache_dir: str | Path | None = None, use_draft_vocab: bool = True,
                        target_runner: str | None = None, prompt_lookup: bool = True,
                        precision: str | None = None, release_weight_pages: bool = True,
                        prefix_cache: bool = True, wide_target: bool | None = None,
                        **compile_options) -> "DFlashPipeline":
        from .ov.compile import compile_runners  # openvino is only needed from here on

        if isinstance(model_dir, str) and not model_dir.strip():  # Path("") would quietly mean "."
            raise ValueError("model_dir is empty: give an ovdflash model directory, or None for the embedded default")
        model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
        manifest = load_manifest(model_dir)
        # the caller's runner, else the model directory's (load_manifest fills in the default)
        target_runner = parse_target_runner(target_runner or manifest["target_runner"])
        config, numerics = compile_config(manifest, compile_options, precision, target_runner)
        config.setdefault("CACHE_DIR", str(cache_dir or DEFAULT_CACHE_DIR))
        target, drafter = compile_runners(model_dir, manifest, device, config, with_drafter=draft,
                                          use_draft_vocab=use_draft_vocab,
                                          target_runner=target_runner, wide_target=wide_target)
        if getattr(target, "wide_request", None) is not None:
            target.calibrate_wide()  # which call sizes the f32-weight copy runs, on this host
        tokenizer = Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").exists() else None
        pipe = cls(target, drafter, tokenizer, manifest["eos_token_ids"], manifest["block_size"],
                   manifest["mask_token_id"], model_dir, manifest.get("bos_token_id"),
                   manifest["default_block_size"], prompt_lookup, prefix_cache)
        pipe.numerics = numerics
        pipe.vocab_size = manifest.get("vocab_size")
        if release_weight_pages:
            pipe.release_weight_pages()
        return pipe

    def release_weight_pages(self) -> int:
        """Run every kernel shape once (a prefill, a verify, an AR step), so the plugin has repacked
        its weights, then drop the resident pages of the mapped IR files (ovdflash.ov.memory)."""
        from .ov.memory import release_mapped_files

        kept = self.stats, self.last_stats  # not a user call: leave the stats alone
        self.stats = GenerationStats()
        prompt = [self.eos_token_ids[0] if self.eos_token_ids else 0] * 32
        for block in ((2, 1) if self.drafter is not None else (1,)):
            for _ in self.generate_tokens(prompt, 3, block_size=block, eos_token_ids=(), prompt_lookup=False):
                pass
        self.stats, self.last_stats = kept
        for runner in (self.target, self.drafter):  # leave them as freshly loaded
            if runner is not None:
                runner.reset()
        self.prefix_store.invalidate()
        files = [self.model_dir / "target" / "openvino_model.bin",
                 self.model_dir / "drafter" / "openvino_model.bin"] if self.model_dir is not None else []
        wide_xml = getattr(self.target, "wide_xml", None)
        if wide_xml is not None:
            files.append(wide_xml.with_suffix(".bin"))
        return release_mapped_files(files)

    # -- token level ---------------------------------------------------------------------------
    def generate_tokens(self, prompt_ids: Sequence[int], max_new_tokens: int = 256, temperature: float = 0.0,
                        top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                        block_size: int | str | None = None, draft: bool | None = None,
                        eos_token_ids: Sequence[int] | None = None,
                        stats: GenerationStats | None = None,
                        prompt_lookup: bool | None = None,
                        prefix_cache: bool | None = None) -> Iterator[sequence.TokenEvent]:
        params = SamplingParams(temperature, top_p, top_k, seed)
        prompt_ids = check_token_ids(prompt_ids, self.vocab_size)
        check_positive_int("max_new_tokens", max_new_tokens)
        block_size = self._check_block_size(block_size, draft)
        auto = block_size == "auto"
        use_drafter = self.drafter if draft is not False and (auto or block_size > 1) else None
        policy = self.auto_block_policy() if auto and use_drafter is not None else None
        if auto:
            block_size = self.block_size
        eos = self.eos_token_ids if eos_token_ids is None else eos_token_ids
        call_stats = GenerationStats()
        use_lookup = self.prompt_lookup if prompt_lookup is None else prompt_lookup
        lookup = NgramLookup() if use_lookup and use_drafter is not None else None
        reuse = self.prefix_cache if prefix_cache is None else prefix_cache
        if self.prefix_store.target is not self.target or self.prefix_store.drafter is not self.drafter:
            self.prefix_store = PrefixCache(self.target, self.drafter)  # the runners were replaced
        events = sequence.generate(self.target, use_drafter, prompt_ids, max_new_tokens, params, eos,
                                 block_size if use_drafter is not None else 1, call_stats, policy, lookup,
                                 self.prefix_store, reuse_prefix=bool(reuse))
        return self._recorded(events, call_stats, stats)

    def _check_block_size(self, block_size, draft: bool | None):
        """block_size as a call asked for it (None: the manifest's default), checked against the drafter."""
        if draft and self.drafter is None:
            raise ValueError("draft=True, but this pipeline was loaded without a drafter")
        block_size = self.default_block_size if block_size is None else block_size
        if block_size != "auto":
            check_positive_int("block_size", block_size, "an integer or 'auto'")
            if block_size > self.block_size and draft is not False:
                raise ValueError(f"block_size {block_size} exceeds the drafter's trained block size {self.block_size}")
        return block_size

    @contextmanager
    def _exclusive(self):
        """Hold the pipeline for one generation. Another thread waits its turn; the same thread
        (an unfinished stream, then another call) is refused, since its generation would be lost."""
        me = threading.get_ident()
        if self._busy_thread == me:
            raise RuntimeError("this pipeline is already generating in this thread (an unfinished stream or "
                               "generator?); finish or close() it before starting another call")
        with self._busy:
            self._busy_thread = me
            try:
                yield
            finally:
                self._busy_thread = None

    def auto_block_policy(self) -> BlockPolicy:
        """The policy behind block_size="auto": on first use, measures the verify cost of
        1..CALIBRATED_DRAFTS + 1 tokens and the draft cost on the real models, extended linearly
        to the trained block size."""
        if self.block_policy is None:
            if self.drafter is None:
                raise ValueError("block_size='auto' needs a drafter")
            prompt = (self.encode_prompt([{"role": "user", "content": CALIBRATION_PROMPT}]) if self.tokenizer
                      else list(range(1, 33)))
            with self._exclusive():  # the measurement runs the models
                step_cost_s, draft_cost_s, switch_cost_s = measure_costs(
                    self.target, self.drafter, prompt, self.block_size - 1, measured_drafts=CALIBRATED_DRAFTS)
                self.prefix_store.invalidate()  # the measurement ran the runners outside the engine
            self.block_policy = BlockPolicy(step_cost_s, draft_cost_s, switch_cost_s)
        return self.block_policy

    def _recorded(self, events, call_stats: GenerationStats, caller_stats: GenerationStats | None):
        with self._exclusive():
            try:
                yield from events
            finally:  # finished, broken off, or interrupted: the engine has recorded its times
                events.close()
                self.last_stats = call_stats
                self.stats.merge(call_stats)
                if caller_stats is not None:
                    caller_stats.merge(call_stats)

    def warm_up(self, num_tokens: int = 4, block_size: int | str | None = None) -> None:
        """One short generation, so first-call costs (worker threads, first-shape kernels, and for
        "auto" the cost measurement) are paid now."""
        prompt = [self.eos_token_ids[0] if self.eos_token_ids else 0]
        kept = self.stats, self.last_stats  # a warm-up is not a user call: leave the stats alone
        self.stats = GenerationStats()
        for _ in self.generate_tokens(prompt, num_tokens, block_size=block_size, eos_token_ids=()):
            pass
        self.stats, self.last_stats = kept

    # -- text level ----------------------------------------------------------------------------
    def encode_prompt(self, prompt_or_messages, apply_chat_template: bool = False) -> list[int]:
        if isinstance(prompt_or_messages, str) and apply_chat_template:  # then as any message list
            prompt_or_messages = [{"role": "user", "content": prompt_or_messages}]
        if isinstance(prompt_or_messages, str):
            ids = self._tok().encode(prompt_or_messages)
            if self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
                ids = [self.bos_token_id] + ids
            return ids
        if isinstance(prompt_or_messages, (bytes, bytearray, dict)) or not hasattr(prompt_or_messages, "__iter__"):
            raise TypeError("prompt must be a string, a list of chat messages, or a list of token ids, "
                            f"got {type(prompt_or_messages).__name__}")
        items = list(prompt_or_messages)
        if items and any(isinstance(m, dict) for m in items):
            return self._tok().encode_chat(check_messages(items))
        return check_token_ids(items, self.vocab_size)

    def _tok(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this pipeline has no tokenizer; use generate_tokens()")
        return self.tokenizer

    def _blocks(self, prompt_or_messages, stop, result, apply_chat_template: bool, every_round: bool = False,
                **kwargs) -> Iterator[str]:
        """Text per accepted block (with `every_round`, one item per round, "" while text is held
        back); fills `result` (token_ids, text, finish_reason) as it goes."""
        stops = check_stops(stop)
        prompt_ids = self.encode_prompt(prompt_or_messages, apply_chat_template)
        detok = IncrementalDetokenizer(self._tok())
        eos = set(self.eos_token_ids if kwargs.get("eos_token_ids") is None else kwargs["eos_token_ids"])
        events = self.generate_tokens(prompt_ids, **kwargs)
        text, emitted = "", 0
        try:
            for event in events:
                result.token_ids.append(event.token)
                text, stopped = extend_text(text, event, detok, eos, stops)
                if stopped:  # this token completed a stop string: end here, mid-block or not
                    result.finish_reason = "stop"
                    break
                result.finish_reason = event.finish_reason
                if not event.from_draft or event.finish_reason:  # end of an accepted block
                    safe = len(text) if event.finish_reason else len(text) - held_back(text, stops)
                    if safe > emitted or every_round:
                        yield text[emitted:safe]
                        emitted = safe
        finally:
            events.close()  # also on Ctrl-C / consumer break: stats are recorded on close
            result.text = text
            result.stats = self.last_stats
        if len(text) > emitted:
            yield text[emitted:]

    def stream(self, prompt_or_messages, max_new_tokens: int = 256, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop=None,
               block_size: int | str | None = None, draft: bool | None = None,
               apply_chat_template: bool = False, prompt_lookup: bool | None = None,
               prefix_cache: bool | None = None) -> Iterator[str]:
        result = GenerationResult("", [], "", GenerationStats())
        yield from self._blocks(prompt_or_messages, stop, result, apply_chat_template,
                                max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=seed, block_size=block_size, draft=draft,
                                prompt_lookup=prompt_lookup, prefix_cache=prefix_cache)

    def stream_rounds(self, prompt_or_messages, result: GenerationResult, stop=None,
                      apply_chat_template: bool = False, **kwargs) -> Iterator[str]:
        """`stream` with one item per round ("" when its text is held back), filling `result` as it
        goes: a caller stepping it (the server's scheduler) can stop between any two rounds."""
        return self._blocks(prompt_or_messages, stop, result, apply_chat_template, every_round=True, **kwargs)

    def generate(self, prompt_or_messages, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop=None,
                 block_size: int | str | None = None, draft: bool | None = None,
                 apply_chat_template: bool = False, prompt_lookup: bool | None = None,
                 prefix_cache: bool | None = None) -> GenerationResult:
        result = GenerationResult("", [], "", GenerationStats())
        for _ in self._blocks(prompt_or_messages, stop, result, apply_chat_template,
                              max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                              top_k=top_k, seed=seed, block_size=block_size, draft=draft,
                              prompt_lookup=prompt_lookup, prefix_cache=prefix_cache):
            pass
        return result

    # -- several sequences at once ---------------------------------------------------------------
    def batch_target(self, pool_blocks: int | None = None):
        """The batched paged runner beside this pipeline's target (made once; same compiled model). It
        keeps a prefix cache of KV blocks across requests and calls while `prefix_cache` is on."""
        current = self._batch_target
        if current is None or (pool_blocks is not None and pool_blocks != current.pool_blocks) \
                or current.caches_prefixes != bool(self.prefix_cache):
            from .ov.paged_batch import batch_target_for

            self._batch_target = batch_target_for(self.target, pool_blocks, prefix_caching=bool(self.prefix_cache))
        return self._batch_target

    def drafter_pool(self):
        """Drafters for batched sequences, on this pipeline's compiled drafter (made once; None without one)."""
        if self._drafter_pool is None and self.drafter is not None:
            from .ov.paged_batch import DrafterPool

            self._drafter_pool = DrafterPool(self.drafter)
        return self._drafter_pool

    def batch_draft_policy(self, max_batch_size: int = 8):
        """The load-aware policy behind generate_batch's block_size="auto" (block_policy.BatchDraftPolicy):
        on first use, measures batched target calls up to max_batch_size full blocks and the
        drafter's cost; it keeps learning costs across calls (acceptance is per sequence)."""
        if self._batch_draft_policy is None:
            if self.drafter is None:
                raise ValueError("block_size='auto' needs a drafter")
            pool = self.drafter_pool()
            drafter = pool.take()
            try:
                tokens, call_cost_s, draft_cost_s = measure_batch_costs(
                    self.batch_target(), drafter, max_batch_size * self.block_size, self.block_size - 1)
            finally:
                pool.give(drafter)
            self._batch_draft_policy = BatchDraftPolicy(tokens, call_cost_s, draft_cost_s)
        return self._batch_draft_policy

    def generate_batch(self, prompts, max_new_tokens: int = 256, temperature: float = 0.0,
                       top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop=None,
                       block_size: int | str | None = None, draft: bool | None = None,
                       apply_chat_template: bool = False, prompt_lookup: bool | None = None,
                       max_batch_size: int = 8, pool_blocks: int | None = None,
                       prefix_cache: bool | None = None) -> list[GenerationResult]:
        """`generate` for every prompt, verified together: one target inference per round for all
        running sequences (continuous batching, at most max_batch_size at once; batch_generation).
        Each result equals that prompt's `generate` alone with the same arguments (greedy exactly;
        sampled with the same seed, the same draws). block_size="auto": each round's drafts are
        chosen for the whole batch from its cost curve (`batch_draft_policy`). With prefix caching
        (None: the pipeline's `prefix_cache`), a prompt starting with full KV blocks that an earlier
        or concurrent sequence computed (a shared system prompt) prefills only the rest."""
        from .batch_generation import BatchGeneration

        if isinstance(prompts, (str, dict)) or not hasattr(prompts, "__iter__"):
            raise TypeError("prompts must be a list of prompts (strings, message lists or token-id lists)")
        prompts = list(prompts)
        params = SamplingParams(temperature, top_p, top_k, seed)
        encoded = [self.encode_prompt(p, apply_chat_template) for p in prompts]
        with self._exclusive():
            batch = BatchGeneration(self, max_batch_size, pool_blocks)
            try:
                results = [batch.add(i, ids, max_new_tokens, params, stop, block_size, draft, prompt_lookup,
                                     prefix_cache) for i, ids in enumerate(encoded)]
                while batch.has_work():
                    batch.step()
            finally:
                for i in list(batch.requests):  # an interrupted batch gives its blocks and drafters back
                    batch.abort(i)
        return results

