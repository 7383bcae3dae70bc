"""Continuous batching for DFlash: many sequences, one target inference per round (no OpenVINO here).

Contract:
- A `BatchTarget` (paged_batch.OVPagedBatchTarget, or a mock) holds the KV cache of every sequence
  in one pool: `reserve(seq_id, num_tokens) -> bool` (False: not now; ValueError: never),
  `release(seq_id)`, `committed(seq_id)`, `blocks_for(num_tokens)` against `pool_blocks`,
  `forward([(seq_id, token_ids, rows)]) -> [(logits rows, features)]` in ONE inference, and
  `commit(seq_id, k)`; `max_length` is the context limit. A target
  whose `caches_prefixes` is True shares cached prompt blocks: `reserve(seq_id, n, prompt_ids)`,
  after which `committed(seq_id)` is the cached prompt tokens and `cached_features(seq_id)` their
  target features; every commit then passes the kept token ids and features.
  Such a sequence prefills only the rest of its prompt (`stats.num_cached_prompt_tokens`), and its
  drafter's context is the cached features followed by the prefill's, as a full prefill gives.
- `Scheduler(target, drafters=None, max_batch_size=8, draft_policy=None)`: `drafters` hands out one
  `engine.DrafterRunner` per sequence (`take()`, `give(d)`; paged_batch.DrafterPool) or is None
  (AR only). `add(request_id, prompt_ids, max_new_tokens, params, block_size, prompt_lookup, eos,
  load_aware=False, reuse_prefix=True)` queues a request and returns the `GenerationStats` it
  fills; it waits (FIFO) until the pool can book prompt + max_new_tokens tokens (less the cached
  blocks it shares) and a batch slot is free. A prompt that leaves no room for a
  token is `engine.PromptTooLongError`, a request larger than the whole pool a ValueError, both at add.
- `step()` runs one round for every running sequence: new ones prefill, the others verify
  `[last, drafts...]` (drafter proposals, n-gram lookup drafts, or none = an AR step), all in one
  target call; each sequence then accepts with its own SamplingParams and per-position randomness
  (`sampling.accept_at_positions` / `sample_token`, as engine.speculative_round and
  engine.autoregressive_step do) and keeps only its accepted slots. It returns
  [(request_id, [TokenEvent, ...])] for the round: the same events, token for token, that
  `engine.generate` yields for that request alone (greedy, or seeded sampling). A sequence leaves
  after its last event (finish_reason "stop" at EOS, "length" at exactly max_new_tokens, "context"
  when the context is full) and its blocks and drafter go back at once; waiting ones join next round.
- Drafts per round: a sequence with a fixed block verifies block_size - 1 drafts (fewer near its
  limits); a `load_aware` one gets the drafts `draft_policy` (block_policy.BatchDraftPolicy; set
  it before adding such a request) chooses for the whole batch each round, 0..block_size - 1, from
  the batch's cost curve and each sequence's acceptance; a sequence it holds at AR still verifies
  its n-gram lookup drafts where the call has free room (`free_tokens`). Either way output is
  unchanged.
- `abort(request_id)` drops a waiting or running request (True if it was there); `has_work()`.
- Timing stats: the shared target call is counted in full in every sequence's verify_s.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Protocol, Sequence

import numpy as np

from .lookup import NgramLookup
from .sampling import PositionRandomness, SamplingParams, accept_at_positions, sample_token
from .sequence import DrafterRunner, PromptTooLongError, TokenEvent
from .stats import GenerationStats


class BatchTarget(Protocol):
    max_length: int
    pool_blocks: int  # KV blocks the pool can ever hold

    def blocks_for(self, num_tokens: int) -> int: ...

    def reserve(self, seq_id, num_tokens: int) -> bool: ...
    def release(self, seq_id) -> None: ...
    def committed(self, seq_id) -> int: ...
    def forward(self, batch: list) -> list[tuple[np.ndarray, np.ndarray]]: ...
    def commit(self, seq_id, num_kept: int) -> None: ...


class DrafterSource(Protocol):
    def take(self) -> DrafterRunner: ...
    def give(self, drafter: DrafterRunner) -> None: ...


@dataclass
class _Sequence:
    request_id: Hashable
    prompt: np.ndarray
    max_new_tokens: int
    params: SamplingParams
    randomness: PositionRandomness
    eos: set
    block_size: int
    use_lookup: bool
    stats: GenerationStats
    t_added: float
    drafter: DrafterRunner | None = None
    lookup: NgramLookup | None = None
    prefilled: bool = False
    num_out: int = 0
    last: int = -1
    ctx_feats: np.ndarray | None = None
    drafts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    from_lookup: bool = False
    policy_state: dict | None = None  # load-aware: the draft policy's view of this sequence
    reuse_prefix: bool = True
    num_cached: int = 0  # prompt tokens whose KV the pool's prefix cache gave


class Scheduler:
    def __init__(self, target: BatchTarget, drafters: DrafterSource | None = None, max_batch_size: int = 8,
                 draft_policy=None):
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        self.target = target
        self.drafters = drafters
        self.max_batch_size = max_batch_size
        self.draft_policy = draft_policy
        self.caches_prefixes = bool(getattr(target, "caches_prefixes", False))
        self.waiting: deque[_Sequence] = deque()
        self.running: dict[Hashable, _Sequence] = {}
        self.num_steps = 0
        self.num_batched_tokens = 0  # tokens sent to the target, all steps
        self.num_batched_sequences = 0  # sequences in the target calls, all steps

    # -- requests --------------------------------------------------------------------------------
    def add(self, request_id: Hashable, prompt_ids: Sequence[int], max_new_tokens: int,
            params: SamplingParams | None = None, block_size: int = 1, prompt_lookup: bool = False,
            eos: Sequence[int] = (), load_aware: bool = False, reuse_prefix: bool = True) -> GenerationStats:
        prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        if len(prompt) == 0:
            raise ValueError("empty prompt")
        if len(prompt) >= self.target.max_length:
            raise PromptTooLongError(f"prompt has {len(prompt)} tokens; the model's context limit is "
                                     f"{self.target.max_length} (prompt + at least 1 new token must fit)")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        if block_size > 1 and self.drafters is None:
            raise ValueError(f"block_size {block_size} needs a drafter; this scheduler has none")
        if load_aware and (self.draft_policy is None or block_size < 2):
            raise ValueError("a load-aware request needs the scheduler's draft_policy and a block_size >= 2")
        if request_id in self.running or any(s.request_id == request_id for s in self.waiting):
            raise ValueError(f"request {request_id!r} is already queued")
        params = params or SamplingParams()
        if self.target.blocks_for(self._tokens_needed(len(prompt), max_new_tokens)) > self.target.pool_blocks:
            raise ValueError(f"request {request_id!r} needs more KV cache than the whole pool holds "
                             f"({len(prompt)} prompt + {max_new_tokens} new tokens)")
        stats = GenerationStats()
        self.waiting.append(_Sequence(request_id, prompt, int(max_new_tokens), params, params.make_randomness(),
                                      set(int(t) for t in eos), int(block_size), bool(prompt_lookup), stats,
                                      time.perf_counter(),
                                      policy_state=self.draft_policy.new_sequence() if load_aware else None,
                                      reuse_prefix=bool(reuse_prefix)))
        return stats

    def abort(self, request_id: Hashable) -> bool:
        seq = self.running.get(request_id)
        if seq is not None:
            self._finish(seq)
            return True
        for s in self.waiting:
            if s.request_id == request_id:
                self.waiting.remove(s)
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def _tokens_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        # the last token sampled never gets KV: prompt + max_new_tokens - 1 slots, capped by the context
        return min(prompt_len + max_new_tokens - 1, self.target.max_length)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            need = self._tokens_needed(len(seq.prompt), seq.max_new_tokens)
            booked = (self.target.reserve(seq.request_id, need, seq.prompt if seq.reuse_prefix else None)
                      if self.caches_prefixes else self.target.reserve(seq.request_id, need))
            if not booked:
                return  # FIFO: the head waits for blocks, nobody overtakes it
            self.waiting.popleft()
            seq.num_cached = self.target.committed(seq.request_id)
            if seq.block_size > 1:
                seq.drafter = self.drafters.take()
                seq.drafter.reset()
                seq.lookup = NgramLookup() if seq.use_lookup else None
            seq.stats.num_calls += 1
            seq.stats.num_prompt_tokens += len(seq.prompt)
            seq.stats.num_cached_prompt_tokens += seq.num_cached
            self.running[seq.request_id] = seq

    def _finish(self, seq: _Sequence) -> None:
        del self.running[seq.request_id]
        self.target.release(seq.request_id)
        if seq.drafter is not None:
            self.drafters.give(seq.drafter)
            seq.drafter = None
        seq.stats.total_s += time.perf_counter() - seq.t_added

    # -- rounds ----------------------------------------------------------------------------------
    def step(self) -> list[tuple[Hashable, list[TokenEvent]]]:
        """One round for every running sequence (see module doc)."""
        self._admit()
        if not self.running:
            return []
        batch, seqs = [], list(self.running.values())
        chosen = self._load_aware_drafts(seqs)
        for seq in seqs:
            t0 = time.perf_counter()
            if not seq.prefilled:
                batch.append((seq.request_id, seq.prompt[seq.num_cached:], [len(seq.prompt) - seq.num_cached - 1]))
                continue
            self._choose_drafts(seq, chosen.get(seq.request_id))
            seq.stats.draft_s += time.perf_counter() - t0
            ids = np.concatenate(([seq.last], seq.drafts)).astype(np.int64)
            batch.append((seq.request_id, ids, np.arange(len(ids))))
        t_call = time.perf_counter()
        outputs = self.target.forward(batch)
        call_s = time.perf_counter() - t_call
        self.num_steps += 1
        num_tokens = sum(len(ids) for _, ids, _ in batch)
        self.num_batched_tokens += num_tokens
        self.num_batched_sequences += len(batch)
        if chosen and all(seq.prefilled for seq in seqs):  # a prefill's cost is not a verify's
            self.draft_policy.observe_call(num_tokens, call_s)
        events = []
        for seq, (logits, feats) in zip(seqs, outputs):
            pending = self._prefilled(seq, logits, feats, call_s) if not seq.prefilled else \
                self._verified(seq, logits, feats, call_s)
            events.append((seq.request_id, self._emit(seq, pending)))
        return events

    def _block_room(self, seq: _Sequence) -> int:
        """Tokens this round may verify: never past the context limit nor past max_new_tokens."""
        committed = self.target.committed(seq.request_id)
        return min(seq.block_size, seq.max_new_tokens - seq.num_out, self.target.max_length - 1 - committed)

    def _load_aware_drafts(self, seqs: list[_Sequence]) -> dict:
        """request id -> drafts the batch policy chose for each load-aware sequence this round."""
        aware = [s for s in seqs if s.prefilled and s.policy_state is not None]
        if not aware:
            return {}
        fixed = sum(len(s.prompt) - s.num_cached if not s.prefilled else self._block_room(s)
                    for s in seqs if s.policy_state is None or not s.prefilled)
        caps = [self._block_room(s) - 1 for s in aware]
        ks = self.draft_policy.choose([s.policy_state for s in aware], caps, fixed)
        chosen = {s.request_id: k for s, k in zip(aware, ks)}
        # lookup drafts cost no drafter call: where the call has free room, a sequence held at AR verifies them
        free = self.draft_policy.free_tokens(fixed + sum(k + 1 for k in ks))
        for s, k, cap in zip(aware, ks, caps):
            proposal = s.lookup.propose(min(cap, free)) if k == 0 and s.lookup is not None else None
            if proposal is not None and len(proposal):
                chosen[s.request_id] = len(proposal)
                free -= len(proposal)
        return chosen

    def _choose_drafts(self, seq: _Sequence, num_drafts: int | None = None) -> None:
        """Drafts to verify this round: lookup's, the drafter's, or none (an AR step); at most
        num_drafts when the batch policy chose them."""
        committed = self.target.committed(seq.request_id)
        block = self._block_room(seq) if num_drafts is None else num_drafts + 1
        seq.from_lookup = False
        if seq.drafter is None or block < 2:
            seq.drafts = np.zeros(0, dtype=np.int64)
            return
        lookup_drafts = seq.lookup.propose(block - 1) if seq.lookup is not None else None
        if lookup_drafts is not None:  # the drafter is skipped: its unseen features wait in ctx_feats
            seq.drafts, seq.from_lookup = np.asarray(lookup_drafts, dtype=np.int64), True
            return
        seq.drafts = np.asarray(seq.drafter.propose(seq.last, seq.ctx_feats, committed, block - 1), dtype=np.int64)
        seq.ctx_feats = seq.ctx_feats[:0]

    def _prefilled(self, seq: _Sequence, logits, feats, call_s: float) -> list[tuple[int, bool]]:
        n, rest = len(seq.prompt), seq.prompt[seq.num_cached:]
        self._commit(seq, rest, feats)
        seq.last = sample_token(logits[-1], seq.params, seq.randomness.at(n))
        cached = self.target.cached_features(seq.request_id) if seq.num_cached else None
        seq.ctx_feats = np.array(feats) if cached is None else np.concatenate([cached, feats])
        if seq.lookup is not None:
            seq.lookup.reset(np.append(seq.prompt, seq.last))
        seq.prefilled = True
        seq.stats.prefill_s += call_s
        return [(seq.last, False)]

    def _verified(self, seq: _Sequence, logits, feats, call_s: float) -> list[tuple[int, bool]]:
        start = self.target.committed(seq.request_id)  # `last` sits at position start
        drafts = seq.drafts
        if len(drafts) == 0:  # an AR step, as engine.autoregressive_step
            next_token = sample_token(logits[0], seq.params, seq.randomness.at(start + 1))
            num_accepted = 0
            seq.stats.num_ar_steps += 1
        else:
            num_accepted, next_token = accept_at_positions(drafts, logits, seq.params, seq.randomness, start + 1)
            seq.stats.record_round(len(drafts), num_accepted, from_lookup=seq.from_lookup)
            if seq.policy_state is not None and not seq.from_lookup:  # lookup hits say nothing of the drafter
                self.draft_policy.observe(seq.policy_state, len(drafts), num_accepted)
        # rejected slots: overwritten next call
        self._commit(seq, np.concatenate(([seq.last], drafts[:num_accepted])), feats)
        if seq.drafter is not None:  # the drafter's context stays complete: a copy, the view dies next call
            seq.ctx_feats = np.concatenate([seq.ctx_feats, feats[: num_accepted + 1]])
        seq.stats.verify_s += call_s
        accepted = [int(d) for d in drafts[:num_accepted]]
        seq.last = int(next_token)
        if seq.lookup is not None:
            seq.lookup.extend(accepted + [seq.last])
        return [(t, True) for t in accepted] + [(seq.last, False)]

    def _commit(self, seq: _Sequence, kept_ids: np.ndarray, feats: np.ndarray) -> None:
        if self.caches_prefixes:
            self.target.commit(seq.request_id, len(kept_ids), kept_ids, feats)
        else:
            self.target.commit(seq.request_id, len(kept_ids))

    def _emit(self, seq: _Sequence, pending: list[tuple[int, bool]]) -> list[TokenEvent]:
        """The round's events with engine.generate's stop rules; a finished sequence leaves."""
        out = []
        committed = self.target.committed(seq.request_id)
        for i, (token, from_draft) in enumerate(pending):
            seq.num_out += 1
            seq.stats.num_output_tokens += 1
            if seq.num_out == 1:
                seq.stats.ttft_s += time.perf_counter() - seq.t_added
            context_full = i == len(pending) - 1 and committed >= self.target.max_length - 1
            reason = ("stop" if token in seq.eos else "length" if seq.num_out == seq.max_new_tokens
                      else "context" if context_full else None)
            out.append(TokenEvent(token, from_draft, reason))
            if reason:
                self._finish(seq)
                break
        return out
