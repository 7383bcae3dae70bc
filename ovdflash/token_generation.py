"""The pipeline's token level: one call's options checked and resolved, the engine run under the lock.

Contract:
- `generate_tokens(pipe, prompt_ids, max_new_tokens=256, ...)` is `DFlashPipeline.generate_tokens`:
  it checks the call (token ids, max_new_tokens, `check_block_size`), picks the drafter, the "auto"
  block policy (`pipe.auto_block_policy()`), the n-gram lookup and the prefix cache as the
  pipeline's contract says, the confidence cut (the "auto" policy's `cut`, else
  `block_policy.ConfidenceCut(pipe.confidence_threshold)`), and returns the engine's events
  (ovdflash.decode.sequence.TokenEvent) as a generator that holds `pipe`'s GenerationLock while it
  runs and, once finished, broken off or interrupted, records the call's stats (`last_stats`,
  cumulative `stats`, the caller's `stats`).
- `sampling_params(pipe, temperature, top_p, top_k, seed, **processing)`: the call's SamplingParams
  (penalties, logit_bias, logprobs as decode.sampling's), a logit_bias token id checked against the
  pipeline's vocabulary; one-line ValueErrors.
- `structured` (None, or a decode.structured spec: {"json": schema}, {"regex": ...}, {"choice": [...]},
  {"grammar": lark}, {"json_object": True}) holds the output to a grammar (`call_grammar(pipe, structured)`,
  compiled by ovdflash.grammar with the pipeline's tokenizer, vocabulary and EOS ids); greedy output
  equals AR's under the same grammar, seeded sampling too; a bad spec is a one-line ValueError.
- `check_block_size(pipe, block_size, draft)`: a call's block size (None: `default_block_size`),
  an integer no larger than the trained block while drafting, or "auto"; ValueError otherwise.
- `GenerationLock().hold()`: one generation at a time. Another thread waits its turn; the same
  thread (an unfinished stream, then another call) gets RuntimeError.

Imports: decode/, grammar, text; never ov/ (the runners come in with the pipeline), the pipeline, server/,
bench/ or cli/.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from .decode import sequence
from .decode.block_policy import ConfidenceCut
from .decode.lookup import NgramLookup
from .decode.prefix_cache import PrefixCache
from .decode.sampling import SamplingParams
from .decode.stats import GenerationStats
from .grammar import grammar_state
from .text import check_positive_int, check_token_ids


class GenerationLock:
    """Held for one generation: the runners hold one sequence's caches."""

    def __init__(self):
        self._lock = threading.Lock()
        self._thread: int | None = None

    @contextmanager
    def hold(self):
        """Another thread waits its turn; the same thread is refused, since its generation would be lost."""
        me = threading.get_ident()
        if self._thread == me:
            raise RuntimeError("this pipeline is already generating in this thread (an unfinished stream or "
                               "generator?); finish or close() it before starting another call")
        with self._lock:
            self._thread = me
            try:
                yield
            finally:
                self._thread = None


def sampling_params(pipe, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                    presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                    logit_bias=None, logprobs: int | None = None) -> SamplingParams:
    params = SamplingParams(temperature, top_p, top_k, seed, presence_penalty, frequency_penalty, repetition_penalty,
                            logit_bias or (), logprobs)
    if params.logit_bias and pipe.vocab_size is not None and params.logit_bias[-1][0] >= pipe.vocab_size:
        raise ValueError(f"logit_bias names token id {params.logit_bias[-1][0]}; the vocabulary has "
                         f"{pipe.vocab_size} tokens")
    return params


def call_grammar(pipe, structured):
    """A fresh decode.structured.GrammarState for a call's `structured` spec (None: unconstrained)."""
    if structured is None:
        return None
    if pipe.tokenizer is None:
        raise ValueError("structured outputs need the model's tokenizer; this pipeline has none")
    return grammar_state(pipe.tokenizer, structured, pipe.vocab_size, pipe.eos_token_ids)


def check_block_size(pipe, block_size, draft: bool | None):
    """block_size as a call asked for it (None: the manifest's default), checked against the drafter."""
    if draft and pipe.drafter is None:
        raise ValueError("draft=True, but this pipeline was loaded without a drafter")
    block_size = pipe.default_block_size if block_size is None else block_size
    if block_size != "auto":
        check_positive_int("block_size", block_size, "an integer or 'auto'")
        if block_size > pipe.block_size and draft is not False:
            raise ValueError(f"block_size {block_size} exceeds the drafter's trained block size {pipe.block_size}")
    return block_size


def generate_tokens(pipe, prompt_ids: Sequence[int], max_new_tokens: int = 256, temperature: float = 0.0,
                    top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                    block_size: int | str | None = None, draft: bool | None = None,
                    eos_token_ids: Sequence[int] | None = None,
                    stats: GenerationStats | None = None,
                    prompt_lookup: bool | None = None,
                    prefix_cache: bool | None = None, presence_penalty: float = 0.0,
                    frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, logit_bias=None,
                    logprobs: int | None = None, structured=None) -> Iterator[sequence.TokenEvent]:
    params = sampling_params(pipe, temperature, top_p, top_k, seed, presence_penalty, frequency_penalty,
                             repetition_penalty, logit_bias, logprobs)
    prompt_ids = check_token_ids(prompt_ids, pipe.vocab_size)
    check_positive_int("max_new_tokens", max_new_tokens)
    block_size = check_block_size(pipe, block_size, draft)
    auto = block_size == "auto"
    use_drafter = pipe.drafter if draft is not False and (auto or block_size > 1) else None
    policy = pipe.auto_block_policy() if auto and use_drafter is not None else None
    if auto:
        block_size = pipe.block_size
    eos = pipe.eos_token_ids if eos_token_ids is None else eos_token_ids
    call_stats = GenerationStats()
    use_lookup = pipe.prompt_lookup if prompt_lookup is None else prompt_lookup
    lookup = NgramLookup() if use_lookup and use_drafter is not None else None
    reuse = pipe.prefix_cache if prefix_cache is None else prefix_cache
    if pipe.prefix_store.target is not pipe.target or pipe.prefix_store.drafter is not pipe.drafter:
        pipe.prefix_store = PrefixCache(pipe.target, pipe.drafter)  # the runners were replaced
    grammar = call_grammar(pipe, structured)
    events = sequence.generate(pipe.target, use_drafter, prompt_ids, max_new_tokens, params, eos,
                               block_size if use_drafter is not None else 1, call_stats, policy, lookup,
                               pipe.prefix_store, reuse_prefix=bool(reuse), grammar=grammar,
                               draft_cut=policy if hasattr(policy, "cut") else ConfidenceCut(pipe.confidence_threshold))
    return _recorded(pipe, events, call_stats, stats)


def _recorded(pipe, events, call_stats: GenerationStats, caller_stats: GenerationStats | None):
    with pipe._lock.hold():
        try:
            yield from events
        finally:  # finished, broken off, or interrupted: the engine has recorded its times
            events.close()
            pipe.last_stats = call_stats
            pipe.stats.merge(call_stats)
            if caller_stats is not None:
                caller_stats.merge(call_stats)
