"""The speculative loop, on token ids only (no text, no OpenVINO).

Contract:
- A target runner (`TargetRunner`) holds the target KV cache. `forward(ids, all_logits)` runs
  the tokens at logical positions `committed..committed+T-1` on top of the cache and returns
  (logits rows, features): all T rows of logits, or only the last one; features for all T rows.
  The returned arrays may be views valid until the next call. `commit(n)` keeps the first n of
  those tokens and rolls the rest back (the OpenVINO runners move `past_lens` back or mask them;
  no cache copy).
- A drafter runner (`DrafterRunner`) holds the drafter's context cache. `propose(last, ctx_feats,
  start, num_drafts)` adds the features of the tokens at positions `start-len(ctx_feats)..start-1`
  to its context and returns `num_drafts` argmax proposals for positions `start+1..`.
- `generate(...)` is a generator of `TokenEvent(token, from_draft, finish_reason)`: every token
  the target committed to, in order, the drafted-and-accepted ones flagged `from_draft`. Each
  round ends with one target token (`from_draft=False`), so a consumer can flush per block. It
  stops at EOS (the EOS token is yielded), at exactly `max_new_tokens`, or when the context is
  full; the last event carries the reason ("stop", "length", "context"). Rounds are lazy: a
  consumer that stops early (a stop string) never pays for the next round.
- With no drafter (or draft=False) it is plain autoregressive decoding on the same target and
  the same sampling function: the baseline that greedy DFlash must match token for token.
- With a `policy` (`block_policy.BlockPolicy` or anything with `begin_sequence()`,
  `choose(max_drafts) -> k`, `observe_round(drafted, accepted, seconds)`), each round verifies
  the k drafts it chooses, up to block_size - 1; k = 0 is an AR step that still feeds the
  drafter's context; `begin_sequence()` is called after each prefill. Every round and
  step it chose is reported back with its wall time. Only the number of verified tokens
  changes, so output is the same as with any fixed block.
- With a `lookup` (`lookup.NgramLookup`), a round whose text so far ends with an n-gram seen
  earlier verifies the tokens that followed it instead of the drafter's, and skips the drafter's
  call; the drafter gets the features it missed at its next call. Output is unchanged.
- With a `prefix_cache` (`prefix_cache.PrefixCache` on the same runners), the runners are not
  reset: the longest prefix of the prompt they already hold (from the previous call: its prompt and
  committed output) is kept, and only the rest is prefilled (`stats.num_cached_prompt_tokens`).
  Output is unchanged: the sampling randomness is keyed by position, and the kept KV and drafter
  context are those of the same tokens at the same positions. `reuse_prefix=False` prefills the
  whole prompt but still records it, for a later call.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

import numpy as np

from .lookup import NgramLookup
from .prefix_cache import PrefixCache
from .sampling import PositionRandomness, SamplingParams, accept_at_positions, sample_token
from .stats import GenerationStats


class BlockSizePolicy(Protocol):
    max_drafts: int

    def begin_sequence(self) -> None: ...
    def choose(self, max_drafts: int) -> int: ...
    def observe_round(self, num_drafted: int, num_accepted: int, seconds: float | None = None) -> None: ...


class TargetRunner(Protocol):
    committed: int       # logical tokens with KV in the cache
    max_length: int      # context limit (positions 0..max_length-1)
    num_compactions: int

    def reset(self) -> None: ...
    def forward(self, token_ids: np.ndarray, all_logits: bool) -> tuple[np.ndarray, np.ndarray]: ...
    def commit(self, num_kept: int) -> None: ...


class DrafterRunner(Protocol):
    block_size: int  # the block it was trained with (drafts per round = block_size - 1)

    def reset(self) -> None: ...
    def propose(self, last: int, ctx_feats: np.ndarray, start: int, num_drafts: int) -> np.ndarray: ...


@dataclass(frozen=True)
class TokenEvent:
    token: int
    from_draft: bool
    finish_reason: str | None = None  # set on the last event only


class PromptTooLongError(ValueError):
    pass


def speculative_round(target: TargetRunner, drafter: DrafterRunner, last: int, ctx_feats: np.ndarray,
                      block_size: int, params: SamplingParams, randomness: PositionRandomness,
                      stats: GenerationStats, lookup_drafts: np.ndarray | None = None
                      ) -> tuple[list[int], int, np.ndarray]:
    """One DFlash round. `lookup_drafts` (at most block_size - 1 tokens copied by n-gram lookup
    from the sequence so far) replace the drafter's proposal, and the drafter is not called: the
    context features it has not seen wait for its next call. Returns (accepted drafts, next target
    token, context features the drafter has not seen yet)."""
    start = target.committed  # `last` sits at logical position `start`, not yet in the target cache
    t0 = time.perf_counter()
    if lookup_drafts is None:
        drafts = drafter.propose(last, ctx_feats, start, block_size - 1)   # argmax proposals for start+1..
        unseen = ctx_feats[:0]
    else:
        drafts, unseen = lookup_drafts, ctx_feats
    t1 = time.perf_counter()
    verify_ids = np.concatenate(([last], drafts)).astype(np.int64)
    logits, feats = target.forward(verify_ids, all_logits=True)       # row i scores position start+i+1
    num_accepted, next_token = accept_at_positions(drafts, logits, params, randomness, start + 1)
    new_feats = np.concatenate([unseen, feats[: num_accepted + 1]])  # a copy: the view dies next call
    target.commit(num_accepted + 1)   # rejected slots are masked out, never copied
    stats.draft_s += t1 - t0
    stats.verify_s += time.perf_counter() - t1
    stats.record_round(len(drafts), num_accepted, from_lookup=lookup_drafts is not None)
    return [int(d) for d in drafts[:num_accepted]], next_token, new_feats


def autoregressive_step(target: TargetRunner, feed_drafter: bool, last: int, ctx_feats: np.ndarray,
                        params: SamplingParams, randomness: PositionRandomness) -> tuple[int, np.ndarray]:
    """One plain target step on `last`. Returns (next token, ctx_feats with `last`'s features
    appended when a drafter will need them later)."""
    position = target.committed + 1  # of the token this step samples
    logits, feats = target.forward(np.array([last], dtype=np.int64), all_logits=True)
    target.commit(1)
    if feed_drafter:  # keep the drafter's context complete for later rounds
        ctx_feats = np.concatenate([ctx_feats, feats[:1]])
    return sample_token(logits[0], params, randomness.at(position)), ctx_feats


def generate(target: TargetRunner, drafter: DrafterRunner | None, prompt_ids: Sequence[int],
             max_new_tokens: int, params: SamplingParams, eos_token_ids: Sequence[int] = (),
             block_size: int | None = None, stats: GenerationStats | None = None,
             policy: BlockSizePolicy | None = None, lookup: NgramLookup | None = None,
             prefix_cache: PrefixCache | None = None, reuse_prefix: bool = True) -> Iterator[TokenEvent]:
    """Speculative (drafter given, block_size >= 2) or autoregressive generation; see module doc."""
    stats = stats if stats is not None else GenerationStats()
    prompt = np.asarray(prompt_ids, dtype=np.int64)
    if len(prompt) == 0:
        raise ValueError("empty prompt")
    if len(prompt) >= target.max_length:
        raise PromptTooLongError(f"prompt has {len(prompt)} tokens; the model's context limit is "
                                 f"{target.max_length} (prompt + at least 1 new token must fit)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if drafter is not None and block_size is None:
        block_size = policy.max_drafts + 1 if policy is not None else drafter.block_size
    block_size = block_size or 1
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    eos = set(int(t) for t in eos_token_ids)
    randomness = params.make_randomness()  # per absolute position: seeded replies equal AR's
    t_start = time.perf_counter()
    stats.num_calls += 1
    stats.num_prompt_tokens += len(prompt)
    compactions_before = target.num_compactions

    if prefix_cache is None:
        target.reset()
        if drafter is not None:
            drafter.reset()
        num_cached, kept_feats = 0, None
    else:
        if prefix_cache.target is not target or drafter not in (None, prefix_cache.drafter):
            raise ValueError("prefix_cache belongs to other runners")
        num_cached, kept_feats = prefix_cache.restore(prompt, drafter is not None, reuse_prefix)
    stats.num_cached_prompt_tokens += num_cached
    logits, feats = target.forward(prompt[num_cached:], all_logits=False)
    target.commit(len(prompt) - num_cached)
    last = sample_token(logits[-1], params, randomness.at(len(prompt)))
    ctx_feats = np.array(feats) if kept_feats is None else np.concatenate([kept_feats, feats])
    if prefix_cache is not None:
        prefix_cache.record(prompt[num_cached:], ctx_feats if drafter is not None else None)
    if lookup is not None:
        lookup.reset(np.append(prompt, last))
    stats.prefill_s += time.perf_counter() - t_start
    if policy is not None:
        policy.begin_sequence()

    num_out = 0
    pending = [(last, False)]
    try:
        while True:
            for i, (token, from_draft) in enumerate(pending):
                num_out += 1
                stats.num_output_tokens += 1
                if num_out == 1:
                    stats.ttft_s += time.perf_counter() - t_start
                # the sequence so far is committed + 1 tokens (`last` has no KV yet)
                context_full = i == len(pending) - 1 and target.committed >= target.max_length - 1
                reason = ("stop" if token in eos else "length" if num_out == max_new_tokens
                          else "context" if context_full else None)
                yield TokenEvent(token, from_draft, reason)
                if reason:
                    return
            # never verify past the context limit nor past max_new_tokens: no wasted rounds
            block = min(block_size, max_new_tokens - num_out, target.max_length - 1 - target.committed)
            policy_decides = drafter is not None and policy is not None and block >= 2
            if policy_decides:
                block = 1 + policy.choose(block - 1)
            t_round = time.perf_counter()
            num_drafted = block - 1
            if prefix_cache is not None:
                prefix_cache.begin()
            kv_new = [last]  # `last` gets its KV this round, and so do the accepted drafts
            if drafter is None or block < 2:
                last, ctx_feats = autoregressive_step(target, drafter is not None, last, ctx_feats, params,
                                                     randomness)
                stats.num_ar_steps += 1
                accepted = []
            else:
                lookup_drafts = lookup.propose(block - 1) if lookup is not None else None
                if lookup_drafts is not None:  # a match near the end may offer fewer tokens
                    num_drafted = len(lookup_drafts)
                accepted, last, ctx_feats = speculative_round(target, drafter, last, ctx_feats, block,
                                                              params, randomness, stats, lookup_drafts)
            if policy_decides:
                policy.observe_round(num_drafted, len(accepted), time.perf_counter() - t_round)
            if prefix_cache is not None:
                prefix_cache.record(kv_new + accepted, ctx_feats if drafter is not None else None)
            pending = [(t, True) for t in accepted] + [(last, False)]
            if lookup is not None:
                lookup.extend(accepted + [last])
    finally:  # also runs when the consumer stops early (stop string, Ctrl-C)
        stats.num_compactions += target.num_compactions - compactions_before
        stats.total_s += time.perf_counter() - t_start
