"""Continuous batching for DFlash: many sequences, one target inference per round (no OpenVINO here).

Contract:
- A `BatchTarget` (paged_batch.OVPagedBatchTarget, or a mock) holds the KV cache of every sequence
  in one pool: `reserve(seq_id, num_tokens, prompt_ids) -> bool` (False: not now; ValueError: never),
  `release(seq_id)`, `committed(seq_id)`, `blocks_for(num_tokens)` against `pool_blocks`,
  `forward([(seq_id, token_ids, rows)]) -> [(logits rows, features)]` in ONE inference, and
  `commit(seq_id, k, token_ids, features)`; `max_length` is the context limit. A target with a
  prefix cache shares the cached blocks of `prompt_ids` at `reserve` (None: share none), after
  which `committed(seq_id)` is the cached prompt tokens and `cached_features(seq_id)` their target
  features, and records the kept ids and features at every commit; one without ignores them.
  Such a sequence prefills only the rest of its prompt (`stats.num_cached_prompt_tokens`), and its
  drafter's context is the cached features followed by the prefill's, as a full prefill gives.
- `Scheduler(target, drafters=None, max_batch_size=8, draft_policy=None, max_num_batched_tokens=None,
  prefill_batch_tokens=None)`:
  `drafters` hands out one
  `round.DrafterRunner` per sequence (`take()`, `give(d)`; ov.drafter_rows.DrafterRows, or
  ov.paged_batch.DrafterPool) or is None (AR only). A source with `propose_many([(drafter, last,
  ctx_feats, start, num_drafts), ...]) -> [proposals, ...]` gets every drafter call of a round in one
  call (one inference), each call's arguments and proposals as its drafter's `propose`.
  `add(request_id, prompt_ids, max_new_tokens, params, block_size, prompt_lookup, eos,
  load_aware=False, reuse_prefix=True, grammar=None, draft_cut=None)` queues a request (`grammar`: a fresh
  `structured.GrammarState` holding its output to a grammar, as `round.SequenceState` says; `draft_cut`:
  `block_policy.ConfidenceCut`, which shortens the proposals of a drafter reporting confidences) and
  returns the `GenerationStats` it fills; it waits (FIFO) until the pool can book prompt + max_new_tokens tokens (less the cached
  blocks it shares) and a batch slot is free. A prompt that leaves no room for a
  token is `round.PromptTooLongError`, a request larger than the whole pool a ValueError, both at add.
- `step()` runs one round for every running sequence: new ones prefill, the others verify
  `[last, drafts...]` (drafter proposals, n-gram lookup drafts, or none = an AR step), all in one
  target call (a prefilling sequence the round's token budget leaves out sits the round out); each sequence's round is its `round.SequenceState`'s, as in `sequence.generate`
  (drafts, acceptance with its own SamplingParams and per-position randomness, stop rules), and
  it keeps only its accepted slots. It returns [(request_id, [TokenEvent, ...])] for the round: the
  same events, token for token, that `sequence.generate` yields for that request alone (greedy, or
  seeded sampling). A sequence leaves after its last event and its blocks and drafter go back at
  once; waiting ones join next round.
- Drafts per round: a sequence with a fixed block verifies block_size - 1 drafts (fewer near its
  limits); a `load_aware` one gets the drafts `draft_policy` (block_policy.BatchDraftPolicy; set
  it before adding such a request) chooses for the whole batch each round, 0..block_size - 1, from
  the batch's cost curve and each sequence's acceptance, a sequence whose n-gram lookup matches
  weighed by the lookup's acceptance and no drafter call; a sequence it holds at AR still verifies
  its lookup drafts where the call has free room (`free_tokens`). The policy learns the costs in
  use: each decode call's time (`observe_call`; the other calls' sizes, `saw_call`) and each
  drafter call it chose (`observe_draft`; a policy with `shared_draft_call` and a `propose_many`
  source: the round's one call). Either way a `draft_cut` may then verify fewer of the drafter's
  drafts, and output is unchanged.
- Whole prompts (`max_num_batched_tokens` None): `prefill_batch_tokens` (None: every waiting prompt
  in one round) groups the prompts a round prefills, beside the verifies: earlier admitted first,
  shortest first among those admitted together, while their sum stays within it (the first always
  goes, however long). A burst of k long prompts then gives its first token after one prefill
  instead of k, the others a round apart; no prompt waits behind later ones. The server uses
  `DEFAULT_PREFILL_BATCH_TOKENS` (docs/BENCHMARKS.md, First token under a burst).
- Chunked prefill: `max_num_batched_tokens` (None: a prompt prefills whole in its first round) is
  each round's token budget. The verifying sequences are scheduled first and never cut; the
  prefilling ones share the rest (at least `min(budget, MIN_PREFILL_CHUNK)`, so a prefill moves
  on when verifies fill the budget), fewest remaining prompt tokens first (arrival order between
  equals), so a short prompt is not held behind a long one. A prompt longer than its share
  prefills over several rounds: each chunk's KV is committed (and joins the prefix cache), its
  features kept, and only the last chunk's final logits row is sampled, with the drafter's context
  the cached features and every chunk's, as one full prefill gives them; a round that ends no
  prefill gives that sequence no events. Output is unchanged by the budget. The load-aware
  policy's fixed tokens count each prefill's chunk, not its whole prompt.
- `abort(request_id)` drops a waiting or running request (True if it was there); `has_work()`.
- Timing stats: the shared target call is counted in full in every sequence's verify_s; a shared
  drafter call (`propose_many`) gives each of its sequences an equal share in draft_s.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Protocol, Sequence

import numpy as np

from .lookup import NgramLookup
from .round import NO_DRAFTS, DrafterRunner, SequenceState, TokenEvent, check_count, check_prompt, verify_ids
from .sampling import SamplingParams
from .stats import GenerationStats
from .structured import GrammarState

# the smallest prefill share of a round whose verifies fill the budget (tokens)
MIN_PREFILL_CHUNK = 16
# the server's prefill_batch_tokens: the best value measured (docs/BENCHMARKS.md, First token under a burst)
DEFAULT_PREFILL_BATCH_TOKENS = 48


class BatchTarget(Protocol):
    max_length: int
    pool_blocks: int  # KV blocks the pool can ever hold

    def blocks_for(self, num_tokens: int) -> int: ...

    def reserve(self, seq_id, num_tokens: int, prompt_ids: np.ndarray | None = None) -> bool: ...
    def cached_features(self, seq_id) -> np.ndarray | None: ...  # asked only when reserve shared blocks
    def release(self, seq_id) -> None: ...
    def committed(self, seq_id) -> int: ...
    def forward(self, batch: list) -> list[tuple[np.ndarray, np.ndarray]]: ...
    def commit(self, seq_id, num_kept: int, token_ids: np.ndarray | None = None,
               features: np.ndarray | None = None) -> None: ...


class DrafterSource(Protocol):
    def take(self) -> DrafterRunner: ...
    def give(self, drafter: DrafterRunner) -> None: ...
    # optional: propose_many(calls) -> proposals, a round's drafter calls at once (module doc)


@dataclass
class _Sequence:
    request_id: Hashable
    prompt: np.ndarray
    state: SequenceState  # sampling, stop rules, drafter context, lookup: the round's side
    use_lookup: bool
    t_added: float
    policy_state: dict | None = None  # load-aware: the draft policy's view of this sequence
    reuse_prefix: bool = True
    prefilled: bool = False
    num_cached: int = 0  # prompt tokens whose KV the pool's prefix cache gave
    num_prefilled: int = 0  # prompt tokens with committed KV (cached ones included)
    admitted_at: int = 0  # the round it joined the running sequences
    prefill_feats: list = field(default_factory=list)  # target features of the committed prompt, chunk by chunk
    drafts: np.ndarray = field(default_factory=lambda: NO_DRAFTS)  # this round's
    from_lookup: bool = False


class Scheduler:
    def __init__(self, target: BatchTarget, drafters: DrafterSource | None = None, max_batch_size: int = 8,
                 draft_policy=None, max_num_batched_tokens: int | None = None,
                 prefill_batch_tokens: int | None = None):
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        self.max_num_batched_tokens = check_token_budget(max_num_batched_tokens)
        self.prefill_batch_tokens = check_token_budget(prefill_batch_tokens, "prefill_batch_tokens")
        self.target = target
        self.drafters = drafters
        self.max_batch_size = max_batch_size
        self.draft_policy = draft_policy
        self.waiting: deque[_Sequence] = deque()
        self.running: dict[Hashable, _Sequence] = {}
        self.num_steps = 0
        self.num_batched_tokens = 0  # tokens sent to the target, all steps
        self.num_batched_sequences = 0  # sequences in the target calls, all steps

    # -- requests --------------------------------------------------------------------------------
    def add(self, request_id: Hashable, prompt_ids: Sequence[int], max_new_tokens: int,
            params: SamplingParams | None = None, block_size: int = 1, prompt_lookup: bool = False,
            eos: Sequence[int] = (), load_aware: bool = False, reuse_prefix: bool = True,
            grammar: GrammarState | None = None, draft_cut=None) -> GenerationStats:
        prompt = check_prompt(prompt_ids, self.target.max_length)
        max_new_tokens = check_count("max_new_tokens", max_new_tokens)
        block_size = check_count("block_size", block_size)
        if block_size > 1 and self.drafters is None:
            raise ValueError(f"block_size {block_size} needs a drafter; this scheduler has none")
        if load_aware and (self.draft_policy is None or block_size < 2):
            raise ValueError("a load-aware request needs the scheduler's draft_policy and a block_size >= 2")
        if request_id in self.running or any(s.request_id == request_id for s in self.waiting):
            raise ValueError(f"request {request_id!r} is already queued")
        if self.target.blocks_for(self._tokens_needed(len(prompt), max_new_tokens)) > self.target.pool_blocks:
            raise ValueError(f"request {request_id!r} needs more KV cache than the whole pool holds "
                             f"({len(prompt)} prompt + {max_new_tokens} new tokens)")
        state = SequenceState(params or SamplingParams(), max_new_tokens, frozenset(int(t) for t in eos),
                              GenerationStats(), block_size, grammar=grammar, draft_cut=draft_cut)
        self.waiting.append(_Sequence(request_id, prompt, state, bool(prompt_lookup), time.perf_counter(),
                                      policy_state=self.draft_policy.new_sequence() if load_aware else None,
                                      reuse_prefix=bool(reuse_prefix)))
        return state.stats

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
            need = self._tokens_needed(len(seq.prompt), seq.state.max_new_tokens)
            if not self.target.reserve(seq.request_id, need, seq.prompt if seq.reuse_prefix else None):
                return  # FIFO: the head waits for blocks, nobody overtakes it
            self.waiting.popleft()
            seq.num_cached = seq.num_prefilled = self.target.committed(seq.request_id)
            seq.admitted_at = self.num_steps
            state = seq.state
            if state.block_size > 1:
                state.drafter = self.drafters.take()
                state.drafter.reset()
                state.lookup = NgramLookup() if seq.use_lookup else None
            state.stats.num_calls += 1
            state.stats.num_prompt_tokens += len(seq.prompt)
            state.stats.num_cached_prompt_tokens += seq.num_cached
            self.running[seq.request_id] = seq

    def _finish(self, seq: _Sequence) -> None:
        del self.running[seq.request_id]
        self.target.release(seq.request_id)
        if seq.state.drafter is not None:
            self.drafters.give(seq.state.drafter)
            seq.state.drafter = None
        seq.state.stats.total_s += time.perf_counter() - seq.t_added

    # -- rounds ----------------------------------------------------------------------------------
    def step(self) -> list[tuple[Hashable, list[TokenEvent]]]:
        """One round for every running sequence (see module doc)."""
        self._admit()
        if not self.running:
            return []
        seqs = list(self.running.values())
        chosen = self._load_aware_drafts(seqs)
        verifies = self._verify_entries([seq for seq in seqs if seq.prefilled], chosen)
        chunks = self._prefill_chunks(seqs, sum(len(ids) for _, ids, _ in verifies.values()))
        seqs = [seq for seq in seqs if seq.request_id in verifies or seq.request_id in chunks]
        batch = [verifies[seq.request_id] if seq.prefilled else self._chunk_entry(seq, chunks[seq.request_id])
                 for seq in seqs]
        t_call = time.perf_counter()
        outputs = self.target.forward(batch)
        call_s = time.perf_counter() - t_call
        self.num_steps += 1
        num_tokens = sum(len(ids) for _, ids, _ in batch)
        self.num_batched_tokens += num_tokens
        self.num_batched_sequences += len(batch)
        if chosen and not chunks:  # a prefill's cost is not a verify's
            self.draft_policy.observe_call(num_tokens, call_s)
        elif self.draft_policy is not None:
            self.draft_policy.saw_call(num_tokens)
        events = []
        for seq, (_, ids, _), (logits, feats) in zip(seqs, batch, outputs):
            if seq.prefilled:
                accepted = self._verified(seq, ids, logits, feats, call_s)
            elif not self._prefilled(seq, ids, logits, feats, call_s):
                continue  # a chunk short of the prompt's end: nothing to sample yet
            else:
                accepted = []
            context_full = self.target.committed(seq.request_id) >= self.target.max_length - 1
            events.append((seq.request_id, list(seq.state.events(accepted, context_full))))
            if seq.state.done:
                self._finish(seq)
        return events

    def _verify_entries(self, seqs: list[_Sequence], chosen: dict) -> dict:
        """request id -> (seq_id, `[last, *drafts]`, logit rows) for this round's call, with at most
        chosen[id] drafts where the batch policy chose them. The sequences that need a drafter call get
        it in one inference where the drafter source can (`propose_many`), each paying an equal share."""
        calls = []
        for seq in seqs:
            t0 = time.perf_counter()
            num_drafts = chosen.get(seq.request_id)
            max_drafts = self._room(seq) - 1 if num_drafts is None else num_drafts
            planned = seq.state.planned_drafts(max_drafts)
            if planned is None:
                calls.append((seq, max_drafts))
            else:
                seq.drafts, seq.from_lookup = planned
            seq.state.stats.draft_s += time.perf_counter() - t0
        args = [seq.state.drafter_call(self.target.committed(seq.request_id), k) for seq, k in calls]
        many = getattr(self.drafters, "propose_many", None)
        shared = many is not None and getattr(self.draft_policy, "shared_draft_call", False)
        if many is not None and calls:
            t0 = time.perf_counter()
            proposals = many([(seq.state.drafter, *a) for (seq, _), a in zip(calls, args)])
            call_s = time.perf_counter() - t0
            shares = [call_s / len(calls)] * len(calls)
            chosen_ks = [k for seq, k in calls if seq.policy_state is not None]
            if shared and chosen_ks:  # the policy's model of a shared call: one call, its largest k
                self.draft_policy.observe_draft(max(chosen_ks), call_s)
        else:
            proposals, shares = [], []
            for (seq, _), a in zip(calls, args):
                t0 = time.perf_counter()
                proposals.append(seq.state.drafter.propose(*a))
                shares.append(time.perf_counter() - t0)
        for (seq, k), proposal, draft_s in zip(calls, proposals, shares):
            seq.drafts, seq.from_lookup = seq.state.drafted(proposal, k), False
            seq.state.stats.draft_s += draft_s
            if seq.policy_state is not None and not shared:  # the policy's drafter call, or its share of one
                self.draft_policy.observe_draft(k, draft_s)
        return {seq.request_id: (seq.request_id, verify_ids(seq.state.last, seq.drafts), np.arange(len(seq.drafts) + 1))
                for seq in seqs}

    @staticmethod
    def _chunk_entry(seq: _Sequence, num_tokens: int) -> tuple:
        """(seq_id, the prompt's next num_tokens, the chunk's last row): only the prompt's last row is sampled."""
        return seq.request_id, seq.prompt[seq.num_prefilled:seq.num_prefilled + num_tokens], [num_tokens - 1]

    def _prefill_chunks(self, seqs: list[_Sequence], num_verify_tokens: int) -> dict:
        """request id -> prompt tokens each prefilling sequence sends this round (module doc: the budget)."""
        prefilling = [seq for seq in seqs if not seq.prefilled]
        budget = self.max_num_batched_tokens
        if budget is None:  # whole prompts while they fit prefill_batch_tokens (module doc)
            chunks, total = {}, 0
            for seq in sorted(prefilling, key=lambda s: (s.admitted_at, len(s.prompt) - s.num_prefilled)):
                num = len(seq.prompt) - seq.num_prefilled
                if chunks and self.prefill_batch_tokens is not None and total + num > self.prefill_batch_tokens:
                    break
                chunks[seq.request_id] = num
                total += num
            return chunks
        share = max(budget - num_verify_tokens, min(budget, MIN_PREFILL_CHUNK))
        chunks = {}
        for seq in sorted(prefilling, key=lambda s: len(s.prompt) - s.num_prefilled):  # stable: arrival order
            num = min(len(seq.prompt) - seq.num_prefilled, share)
            if num < 1:
                break
            chunks[seq.request_id] = num
            share -= num
        return chunks

    def _room(self, seq: _Sequence) -> int:
        return seq.state.room(self.target.committed(seq.request_id), self.target.max_length)

    def _load_aware_drafts(self, seqs: list[_Sequence]) -> dict:
        """request id -> drafts the batch policy chose for each load-aware sequence this round."""
        aware = [s for s in seqs if s.prefilled and s.policy_state is not None]
        if not aware:
            return {}
        verify = sum(self._room(s) for s in seqs if s.prefilled and s.policy_state is None)
        # the prefills' chunks as they would be with every load-aware sequence at an AR step
        fixed = verify + sum(self._prefill_chunks(seqs, verify + len(aware)).values())
        caps = [self._room(s) - 1 for s in aware]
        # a lookup match is drafts without a drafter call: the policy weighs them by the lookup's own acceptance
        offers = [self._lookup_offer(s, cap) for s, cap in zip(aware, caps)]
        ks = self.draft_policy.choose([s.policy_state for s in aware], caps, fixed, offers)
        chosen = {s.request_id: k for s, k in zip(aware, ks)}
        if not any(n and not k for k, n in zip(ks, offers)):
            return chosen
        # lookup drafts cost no drafter call: where the call has free room, a sequence held at AR verifies them
        free = self.draft_policy.free_tokens(fixed + sum(k + 1 for k in ks), fixed + len(ks))
        for s, k, n in zip(aware, ks, offers):
            taken = 0 if k else min(n, free)  # its lookup's first drafts, as planned_drafts finds them
            if taken:
                chosen[s.request_id] = taken
                free -= taken
        return chosen

    @staticmethod
    def _lookup_offer(seq: _Sequence, cap: int) -> int:
        """How many drafts the sequence's n-gram lookup offers this round, at most cap (0: no match)."""
        lookup = seq.state.lookup
        found = lookup.propose(cap) if lookup is not None and cap >= 1 else None
        return 0 if found is None else len(found)

    def _prefilled(self, seq: _Sequence, ids: np.ndarray, logits, feats, call_s: float) -> bool:
        """Commit a prompt chunk; at the prompt's end, begin the sequence's round state (True)."""
        self.target.commit(seq.request_id, len(ids), ids, feats)
        seq.num_prefilled += len(ids)
        seq.state.stats.prefill_s += call_s
        if seq.num_prefilled < len(seq.prompt):
            seq.prefill_feats.append(np.array(feats))  # the target's outputs are views valid until its next call
            return False
        cached = self.target.cached_features(seq.request_id) if seq.num_cached else None
        earlier = ([] if cached is None else [cached]) + seq.prefill_feats
        seq.state.begin(seq.prompt, logits[-1], feats, np.concatenate(earlier) if earlier else None)
        seq.prefill_feats = []
        seq.prefilled = True
        seq.state.stats.ttft_s += time.perf_counter() - seq.t_added
        return True

    def _verified(self, seq: _Sequence, ids: np.ndarray, logits, feats, call_s: float) -> list[int]:
        start = self.target.committed(seq.request_id)  # `last` sits at position start
        accepted = seq.state.accept(seq.drafts, logits, feats, start, seq.from_lookup)
        kept = len(accepted) + 1  # the rejected slots are overwritten next call
        self.target.commit(seq.request_id, kept, ids[:kept], feats)
        if seq.policy_state is not None and len(seq.drafts):  # each draft source teaches its own acceptance
            self.draft_policy.observe(seq.policy_state, len(seq.drafts), len(accepted), seq.from_lookup)
        seq.state.stats.verify_s += call_s
        return accepted


def check_token_budget(value, name: str = "max_num_batched_tokens") -> int | None:
    """A round's token count: None (no limit) or an integer >= 1; else a one-line ValueError."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
        raise ValueError(f"{name} must be an integer >= 1 (or None: no limit), got {value!r}")
    return None if value is None else int(value)
