"""The speculative loop of one sequence on its own runners, on token ids only (no text, no OpenVINO).

Contract:
- A target runner (`TargetRunner`) holds the target KV cache. `forward(ids, all_logits)` runs
  the tokens at logical positions `committed..committed+T-1` on top of the cache and returns
  (logits rows, features): all T rows of logits, or only the last one; features for all T rows.
  The returned arrays may be views valid until the next call. `commit(n)` keeps the first n of
  those tokens and rolls the rest back (the OpenVINO runners move `past_lens` back or mask them;
  no cache copy). The drafter is a `round.DrafterRunner`.
- `generate(...)` is a generator of `TokenEvent(token, from_draft, finish_reason)`: every token
  the target committed to, in order, the drafted-and-accepted ones flagged `from_draft`. Each
  round ends with one target token (`from_draft=False`), so a consumer can flush per block. The
  round and its stop rules are `round.SequenceState`'s (its contract); rounds are lazy: a
  consumer that stops early (a stop string) never pays for the next round.
- With no drafter (or draft=False) it is plain autoregressive decoding on the same target and
  the same sampling function: the baseline that greedy DFlash must match token for token.
- With a `policy` (`block_policy.BlockPolicy` or anything with `begin_sequence()`,
  `choose(max_drafts) -> k`, `observe_round(drafted, accepted, seconds)`), each round verifies
  the k drafts it chooses, up to block_size - 1; k = 0 is an AR step that still feeds the
  drafter's context; `begin_sequence()` is called after each prefill. Every round and
  step it chose is reported back with its wall time. Only the number of verified tokens
  changes, so output is the same as with any fixed block.
- With a `draft_cut` (`block_policy.BlockPolicy`, the "auto" policy, or `block_policy.ConfidenceCut`
  for a fixed block), a drafter that reports per-slot confidences (DSpark's confidence head) has
  its proposal shortened to the drafts the cut keeps (`round.SequenceState`); output is unchanged.
- With a `lookup` (`lookup.NgramLookup`), a round whose text so far ends with an n-gram seen
  earlier verifies the tokens that followed it instead of the drafter's, and skips the drafter's
  call; the drafter gets the features it missed at its next call. Output is unchanged.
- With a `prefix_cache` (`prefix_cache.PrefixCache` on the same runners), the runners are not
  reset: the longest prefix of the prompt they already hold (from the previous call: its prompt and
  committed output) is kept, and only the rest is prefilled (`stats.num_cached_prompt_tokens`).
  Output is unchanged: the sampling randomness is keyed by position, and the kept KV and drafter
  context are those of the same tokens at the same positions. `reuse_prefix=False` prefills the
  whole prompt but still records it, for a later call.
- With a `grammar` (`structured.GrammarState`, fresh for this call), every token is held to it as
  `round.SequenceState` says (structured outputs); output equals AR's under the same grammar.
- `speculative_round` and `autoregressive_step` are one round and one AR step on explicit state
  (what `block_policy.measure_costs` times).
"""
from __future__ import annotations

import time
from typing import Iterator, Protocol, Sequence

import numpy as np

from .lookup import NgramLookup
from .prefix_cache import PrefixCache
from .round import (NO_DRAFTS, DrafterRunner, PromptTooLongError, SequenceState, TokenEvent, accept_block, check_count,
                    check_prompt, verify_ids)
from .sampling import PositionRandomness, SamplingParams
from .stats import GenerationStats
from .structured import GrammarState

__all__ = ["BlockSizePolicy", "DrafterRunner", "PromptTooLongError", "TargetRunner", "TokenEvent",
           "autoregressive_step", "generate", "speculative_round"]


class BlockSizePolicy(Protocol):
    max_drafts: int

    def begin_sequence(self) -> None: ...
    def choose(self, max_drafts: int) -> int: ...
    def observe_round(self, num_drafted: int, num_accepted: int, seconds: float | None = None) -> None: ...


class TargetRunner(Protocol):
    committed: int        # logical tokens with KV in the cache
    pending: int          # tokens of the last forward not committed yet (0 between rounds)
    max_length: int       # context limit (positions 0..max_length-1)
    num_compactions: int
    rewinds_exactly: bool  # False (the safe default): `rewind` keeps only all committed tokens
    # optional, where rewinds_exactly is False: rewind_floor(n) -> the longest length <= n `rewind` accepts

    def reset(self) -> None: ...
    def forward(self, token_ids: np.ndarray, all_logits: bool) -> tuple[np.ndarray, np.ndarray]: ...
    def commit(self, num_kept: int) -> None: ...
    def rewind(self, num_kept: int) -> None: ...  # keep the first num_kept committed tokens (prefix reuse)


def _verify(target: TargetRunner, last: int, drafts: np.ndarray, ctx_feats: np.ndarray, params: SamplingParams,
            randomness: PositionRandomness, feeds_drafter: bool) -> tuple[int, int, np.ndarray]:
    start = target.committed  # `last` sits at logical position `start`, not yet in the target cache
    logits, feats = target.forward(verify_ids(last, drafts), all_logits=True)  # row i scores start+i+1
    num_accepted, next_token, kept_feats = accept_block(drafts, logits, feats, params, randomness, start, feeds_drafter)
    target.commit(num_accepted + 1)  # rejected slots are masked out or overwritten, never copied
    return num_accepted, next_token, ctx_feats if kept_feats is None else np.concatenate([ctx_feats, kept_feats])


def speculative_round(target: TargetRunner, drafter: DrafterRunner, last: int, ctx_feats: np.ndarray,
                      block_size: int, params: SamplingParams, randomness: PositionRandomness,
                      stats: GenerationStats, lookup_drafts: np.ndarray | None = None
                      ) -> tuple[list[int], int, np.ndarray]:
    """One DFlash round. `lookup_drafts` (at most block_size - 1 tokens copied by n-gram lookup
    from the sequence so far) replace the drafter's proposal, and the drafter is not called: the
    context features it has not seen wait for its next call. Returns (accepted drafts, next target
    token, context features the drafter has not seen yet)."""
    t0 = time.perf_counter()
    drafts = lookup_drafts
    if drafts is None:
        drafts, ctx_feats = drafter.propose(last, ctx_feats, target.committed, block_size - 1), ctx_feats[:0]
    t1 = time.perf_counter()
    num_accepted, next_token, ctx_feats = _verify(target, last, drafts, ctx_feats, params, randomness, True)
    stats.draft_s += t1 - t0
    stats.verify_s += time.perf_counter() - t1
    stats.record_round(len(drafts), num_accepted, from_lookup=lookup_drafts is not None)
    return [int(d) for d in drafts[:num_accepted]], next_token, ctx_feats


def autoregressive_step(target: TargetRunner, feed_drafter: bool, last: int, ctx_feats: np.ndarray,
                        params: SamplingParams, randomness: PositionRandomness) -> tuple[int, np.ndarray]:
    """One plain target step on `last`. Returns (next token, ctx_feats with `last`'s features
    appended when a drafter will need them later)."""
    _, next_token, ctx_feats = _verify(target, last, NO_DRAFTS, ctx_feats, params, randomness, feed_drafter)
    return next_token, ctx_feats


def generate(target: TargetRunner, drafter: DrafterRunner | None, prompt_ids: Sequence[int],
             max_new_tokens: int, params: SamplingParams, eos_token_ids: Sequence[int] = (),
             block_size: int | None = None, stats: GenerationStats | None = None,
             policy: BlockSizePolicy | None = None, lookup: NgramLookup | None = None,
             prefix_cache: PrefixCache | None = None, reuse_prefix: bool = True,
             grammar: GrammarState | None = None, draft_cut=None) -> Iterator[TokenEvent]:
    """Speculative (drafter given, block_size >= 2) or autoregressive generation; see module doc."""
    prompt = check_prompt(prompt_ids, target.max_length)
    if drafter is not None and block_size is None:
        block_size = policy.max_drafts + 1 if policy is not None else drafter.block_size
    eos = frozenset(int(t) for t in eos_token_ids)
    stats = stats if stats is not None else GenerationStats()
    seq = SequenceState(params, check_count("max_new_tokens", max_new_tokens), eos, stats,
                        check_count("block_size", block_size or 1), drafter, lookup, grammar, draft_cut)
    t_start = time.perf_counter()
    compactions_before = target.num_compactions
    _prefill(target, seq, prompt, prefix_cache, reuse_prefix)
    seq.stats.prefill_s += time.perf_counter() - t_start
    if policy is not None:
        policy.begin_sequence()
    accepted = []
    try:
        seq.stats.ttft_s += time.perf_counter() - t_start
        while True:
            yield from seq.events(accepted, target.committed >= target.max_length - 1)
            if seq.done:
                return
            accepted = _round(target, seq, policy, prefix_cache)
    finally:  # also runs when the consumer stops early (stop string, Ctrl-C)
        seq.stats.num_compactions += target.num_compactions - compactions_before
        seq.stats.total_s += time.perf_counter() - t_start


def _prefill(target: TargetRunner, seq: SequenceState, prompt: np.ndarray, prefix_cache: PrefixCache | None,
             reuse_prefix: bool) -> None:
    """Runs the prompt (less what the prefix cache kept) and samples the first token."""
    seq.stats.num_calls += 1
    seq.stats.num_prompt_tokens += len(prompt)
    if prefix_cache is None:
        target.reset()
        if seq.drafter is not None:
            seq.drafter.reset()
        num_cached, kept_feats = 0, None
    else:
        if prefix_cache.target is not target or seq.drafter not in (None, prefix_cache.drafter):
            raise ValueError("prefix_cache belongs to other runners")
        num_cached, kept_feats = prefix_cache.restore(prompt, seq.drafter is not None, reuse_prefix)
    seq.stats.num_cached_prompt_tokens += num_cached
    logits, feats = target.forward(prompt[num_cached:], all_logits=False)
    target.commit(len(prompt) - num_cached)
    seq.begin(prompt, logits[-1], feats, kept_feats)
    if prefix_cache is not None:
        prefix_cache.record(prompt[num_cached:], seq.ctx_feats if seq.drafter is not None else None)


def _round(target: TargetRunner, seq: SequenceState, policy: BlockSizePolicy | None,
           prefix_cache: PrefixCache | None) -> list[int]:
    """One round: drafts (as many as fit, or as the policy chose), one verify, accept, commit."""
    room = seq.room(target.committed, target.max_length)
    policy_decides = seq.drafter is not None and policy is not None and room >= 2
    max_drafts = policy.choose(room - 1) if policy_decides else room - 1
    t_round = time.perf_counter()
    if prefix_cache is not None:
        prefix_cache.begin()
    verified_last, start = seq.last, target.committed  # `last` gets its KV now, and so do the accepted drafts
    drafts, from_lookup = seq.choose_drafts(start, max_drafts)
    t_verify = time.perf_counter()
    logits, feats = target.forward(verify_ids(verified_last, drafts), all_logits=True)
    accepted = seq.accept(drafts, logits, feats, start, from_lookup)
    target.commit(len(accepted) + 1)
    if len(drafts):  # AR steps go untimed: the per-round costs divide by the drafted rounds
        seq.stats.draft_s += t_verify - t_round
        seq.stats.verify_s += time.perf_counter() - t_verify
    if policy_decides:
        policy.observe_round(len(drafts), len(accepted), time.perf_counter() - t_round)
    if prefix_cache is not None:
        prefix_cache.record([verified_last] + accepted, seq.ctx_feats if seq.drafter is not None else None)
    return accepted
