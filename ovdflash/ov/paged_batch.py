"""The paged target for several sequences per inference, and a pool of per-sequence drafters.

Contract:
- `OVPagedBatchTarget(compiled, max_length, pool_blocks=None, prefix_caching=True)` implements
  `scheduler.BatchTarget` on the compiled paged target (the one `OVPagedTarget` runs, through its
  own InferRequest). KV blocks of every sequence come from ONE pool: `pool_blocks` blocks of
  `block_tokens` tokens (default `default_pool_blocks`: one full-context sequence's blocks, shared
  by the whole batch, at most `MAX_POOL_SHARE` of the memory available; `blocks_for_bytes`).
  The host tensors start small and grow by doubling up to the limit (the used blocks are copied
  once per growth); freed blocks go on a free list and are reused.
- `reserve(seq_id, num_tokens, prompt_ids=None)` books the blocks a sequence can ever write; False
  when the pool has too few free blocks now (the scheduler keeps it waiting); a booking larger than
  the whole pool is a ValueError. `release(seq_id)` returns them. Blocks are assigned to a sequence
  as it grows, always within its booking, so no inference ever runs out of cache.
- Prefix caching (`prefix_caching=True`, the default): every full block of committed tokens is
  kept under a digest of its tokens and all tokens before it (`block_digest`), with the target
  features of its positions in `features[block, slot, H]` (grown with the KV tensors, counted in
  `pool_bytes_per_block`). `reserve` with prompt_ids shares the cached blocks that begin the
  prompt (its last token excluded, so at least one token is prefilled): `committed(seq_id)` then
  starts at their tokens and `cached_features(seq_id)` holds their features, for the drafter's
  context. Shared blocks are only read: a sequence writes from its committed length on, which lies
  past every full block. A cached block nobody holds counts as free: it is evicted (least recently
  released first, a chain's tail before its head) when a sequence needs a block and the pool is at
  its limit. Outputs are those of a full prefill, since a block is found only by its exact tokens.
  `num_prefix_queries` / `num_prefix_hits` count the prompt tokens looked up and found.
- `wide`, `wide_from`: the target's f32-weight copy and the call size from which it runs, as in
  `OVPagedTarget` (`batch_target_for` passes the single-sequence target's); both share the pool.
- `forward(batch)`: batch = [(seq_id, token_ids, rows)], one inference for all: per sequence
  `past_lens` = its committed tokens, its block table, `subsequence_begins` / `block_indices_begins`
  over the flattened tokens, and `logits_indices` only for each sequence's `rows` (indices into its
  own tokens). Returns per sequence (logits[len(rows), V], features[T, H]), views valid until the
  next call. `commit(seq_id, k, token_ids=None, features=None)` keeps the first k tokens of its last
  forward (their ids and features feed the prefix cache); the next forward overwrites the rest
  (rollback is free, as in OVPagedTarget).
- `DrafterPool(drafter)`: `OVDrafter`s on the same compiled drafter, one InferRequest each, handed
  out per sequence (`take()`, reset) and returned (`give(d)`); each keeps its sequence's context in
  its own state, exactly as the single-sequence drafter does.
"""
from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import openvino as ov

from .runners import WIDE_FROM, OVDrafter, OVPagedTarget, paged_cache_inputs, run_request, wide_request_of

# the default pool takes at most this share of the memory available when it is sized
MAX_POOL_SHARE = 0.25


def cache_inputs_of(compiled: ov.CompiledModel) -> list:
    """(name, element type, per-block shape) of every key_cache.* / value_cache.* input of a paged target."""
    inputs = paged_cache_inputs(compiled)
    if not inputs:
        raise ValueError("this target has no key_cache.* inputs: batching needs the paged target runner")
    return inputs


def block_tokens_of(cache_inputs) -> int:
    return next(shape[1] for name, _, shape in cache_inputs if name.startswith("value_cache."))


def bytes_per_block(cache_inputs) -> int:
    """Bytes one KV block takes across every key/value cache input."""
    return sum(int(np.prod(shape)) * element_type.size for _, element_type, shape in cache_inputs)


def feature_width_of(compiled: ov.CompiledModel) -> int:
    """Width of a target's `target_hidden` output (the drafter's features of one position)."""
    return compiled.output("target_hidden").get_partial_shape()[-1].get_length()


def pool_bytes_per_block(compiled: ov.CompiledModel, prefix_caching: bool = True) -> int:
    """Bytes one pool block takes: its KV, and with prefix caching the target features of its tokens."""
    cache_inputs = cache_inputs_of(compiled)
    features = block_tokens_of(cache_inputs) * feature_width_of(compiled) * 4 if prefix_caching else 0
    return bytes_per_block(cache_inputs) + features


def describe_pool(compiled: ov.CompiledModel, pool_blocks: int, prefix_caching: bool = True) -> str:
    """What a pool of pool_blocks holds, for the start-up log: tokens, bytes, and the KV precision."""
    cache_inputs = cache_inputs_of(compiled)
    tokens = pool_blocks * block_tokens_of(cache_inputs)
    kv_types = sorted({element_type.get_type_name() for _, element_type, _ in cache_inputs})
    per_token = pool_bytes_per_block(compiled, prefix_caching) / block_tokens_of(cache_inputs)
    kv = bytes_per_block(cache_inputs) / block_tokens_of(cache_inputs)
    features = f" + {(per_token - kv) / 1024:.1f} KiB of f32 prefix features" if prefix_caching else ""
    return (f"KV cache pool: {tokens} tokens in {pool_blocks} blocks, {pool_blocks * block_tokens_of(cache_inputs) * per_token / 2 ** 20:.1f} MiB at most "
            f"({'/'.join(kv_types)} KV, {kv / 1024:.1f} KiB a token{features})")


def blocks_for_bytes(compiled: ov.CompiledModel, num_bytes: int, prefix_caching: bool = True) -> int:
    """Pool blocks that fit in num_bytes."""
    return max(1, num_bytes // pool_bytes_per_block(compiled, prefix_caching))


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (where there is none: the physical memory)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_pool_blocks(compiled: ov.CompiledModel, max_length: int, prefix_caching: bool = True,
                        available: int | None = None) -> int:
    """The default pool: one full-context sequence's blocks, which the batch shares (shorter
    requests run side by side in them), at most MAX_POOL_SHARE of the memory available now. A pool
    capped below one context lowers the server's context limit to what it holds."""
    one_context = -(-max_length // block_tokens_of(cache_inputs_of(compiled)))
    share = int(MAX_POOL_SHARE * (available_memory_bytes() if available is None else available))
    return max(1, min(one_context, blocks_for_bytes(compiled, share, prefix_caching)))


class PoolExhaustedError(ValueError):
    pass


def block_digest(previous: bytes, token_ids: np.ndarray) -> bytes:
    """The prefix cache's key of a full block: its tokens and, through `previous`, every token before it."""
    return hashlib.blake2b(previous + np.ascontiguousarray(token_ids, dtype=np.int64).tobytes(),
                           digest_size=16).digest()


@dataclass
class _SequenceBlocks:
    """One sequence's view of the pool."""
    committed: int = 0       # tokens with valid KV
    pending: int = 0         # tokens of the last forward not committed yet
    budget: int = 0          # blocks it may still take from the pool (its booking, less what it took)
    blocks: list = field(default_factory=list)  # its block table: shared cached blocks first
    num_hashed: int = 0      # leading blocks whose digest is known (matched or registered)
    digest: bytes = b""      # chain digest of those blocks
    tail_ids: list = field(default_factory=list)  # committed token ids after the hashed blocks
    num_matched: int = 0     # leading blocks shared from the prefix cache at reserve


class OVPagedBatchTarget:
    kind = "paged-batch"

    def __init__(self, compiled: ov.CompiledModel, max_length: int, pool_blocks: int | None = None,
                 initial_blocks: int = 16, prefix_caching: bool = True, wide: ov.CompiledModel | None = None,
                 wide_from: int = WIDE_FROM):
        self.compiled = compiled
        self.request = compiled.create_infer_request()
        self.max_length = max_length
        self.cache_inputs = cache_inputs_of(compiled)
        self.wide_request = wide_request_of(wide, self.cache_inputs)  # as OVPagedTarget's
        self.wide_from = wide_from
        self.num_wide_calls = 0
        self.block_tokens = block_tokens_of(self.cache_inputs)
        self.caches_prefixes = bool(prefix_caching)
        if pool_blocks is None:
            pool_blocks = default_pool_blocks(compiled, max_length, self.caches_prefixes)
        if isinstance(pool_blocks, bool) or not isinstance(pool_blocks, (int, np.integer)) or pool_blocks < 1:
            raise ValueError(f"pool_blocks must be an integer >= 1, got {pool_blocks!r}")
        self.pool_blocks = int(pool_blocks)
        self.positions = np.arange(max_length + 1, dtype=np.int64)
        self.caches: dict[str, ov.Tensor] = {}
        self.num_blocks = 0        # allocated in the host tensors
        self.free: list[int] = []  # allocated blocks holding nothing
        self.refs: dict[int, int] = {}  # block id -> sequences whose table holds it (absent: 0)
        self.num_referenced = 0    # blocks some sequence holds
        self.num_budgeted = 0      # blocks booked by sequences and not taken yet
        self.num_cache_grows = 0
        self.num_evicted = 0
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0     # of which found there
        self.cached: dict[bytes, int] = {}       # digest -> block id, full blocks of committed tokens
        self.digest_of: dict[int, bytes] = {}    # block id -> digest, cached blocks only
        self.evictable: OrderedDict[bytes, None] = OrderedDict()  # cached, held by nobody; oldest first
        width = feature_width_of(compiled) if self.caches_prefixes else 0
        self.features = np.zeros((0, self.block_tokens, width), dtype=np.float32)  # [block, slot, H]
        self.seqs: dict = {}       # seq_id -> _SequenceBlocks
        self._grow(min(initial_blocks, self.pool_blocks))

    # -- pool ------------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_tokens)

    @property
    def num_reserved(self) -> int:
        """Blocks the running sequences hold or may still take."""
        return self.num_referenced + self.num_budgeted

    @property
    def free_blocks(self) -> int:
        """Blocks a new booking may take (cached blocks nobody holds count: they are evicted on demand)."""
        return self.pool_blocks - self.num_reserved

    def pool_usage(self) -> dict[str, int]:
        """Blocks held by running sequences (`used`), cached ones nobody holds (`cached`, evicted on
        demand) and the rest (`free`), which add up to `pool_blocks`; `allocated`: in the host tensors."""
        used, cached = self.num_referenced, len(self.evictable)
        return {"used": used, "cached": cached, "free": self.pool_blocks - used - cached, "allocated": self.num_blocks}

    def _grow(self, num_blocks: int) -> None:
        allocated = self.num_blocks
        OVPagedTarget._grow(self, num_blocks)  # the same host tensors and fields as the single-sequence runner
        if self.caches_prefixes:
            grown = np.zeros((num_blocks, *self.features.shape[1:]), dtype=np.float32)
            grown[:allocated] = self.features[:allocated]
            self.features = grown
        self.free.extend(range(allocated, num_blocks))

    def _match(self, prompt_ids) -> list[tuple[bytes, int]]:
        """(digest, block id) of the cached full blocks that begin prompt_ids, its last token excluded."""
        matched, digest = [], b""
        ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        for b in range((len(ids) - 1) // self.block_tokens):
            digest = block_digest(digest, ids[b * self.block_tokens:(b + 1) * self.block_tokens])
            block = self.cached.get(digest)
            if block is None:
                break
            matched.append((digest, block))
        return matched

    def _hold(self, block: int) -> None:
        count = self.refs.get(block, 0)
        if count == 0:
            self.num_referenced += 1
            digest = self.digest_of.get(block)
            if digest is not None:
                self.evictable.pop(digest, None)
        self.refs[block] = count + 1

    def _drop(self, block: int) -> None:
        count = self.refs.pop(block) - 1
        if count:
            self.refs[block] = count
            return
        self.num_referenced -= 1
        digest = self.digest_of.get(block)
        if digest is None:
            self.free.append(block)
        else:
            self.evictable[digest] = None

    def reserve(self, seq_id, num_tokens: int, prompt_ids=None) -> bool:
        """Book the blocks of num_tokens tokens; with prompt_ids (and prefix caching), the cached full
        blocks that begin the prompt are shared instead, and `committed(seq_id)` starts at their tokens."""
        need = self.blocks_for(min(num_tokens, self.max_length))
        if need > self.pool_blocks:
            raise PoolExhaustedError(f"a sequence of {num_tokens} tokens needs {need} KV blocks; the pool holds "
                                     f"{self.pool_blocks} (raise pool_blocks)")
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already in the batch")
        looked_up = self.caches_prefixes and prompt_ids is not None
        matched = self._match(prompt_ids) if looked_up else []
        idle_matched = sum(1 for _, block in matched if self.refs.get(block, 0) == 0)
        if need - len(matched) + idle_matched > self.free_blocks:
            return False
        seq = _SequenceBlocks(committed=len(matched) * self.block_tokens, budget=need - len(matched),
                              num_hashed=len(matched), digest=matched[-1][0] if matched else b"",
                              num_matched=len(matched))
        for _, block in matched:
            self._hold(block)
            seq.blocks.append(block)
        if looked_up:
            self.num_prefix_queries += len(prompt_ids)
            self.num_prefix_hits += seq.committed
        self.num_budgeted += seq.budget
        self.seqs[seq_id] = seq
        return True

    def cached_features(self, seq_id) -> np.ndarray | None:
        """Target features of the cached prefix `reserve` shared with this sequence (None: nothing shared)."""
        seq = self.seqs[seq_id]
        if not seq.num_matched:
            return None
        return self.features[seq.blocks[:seq.num_matched]].reshape(-1, self.features.shape[-1])

    def release(self, seq_id) -> None:
        seq = self.seqs.pop(seq_id)
        for block in reversed(seq.blocks):  # a chain's tail is evicted before its head
            self._drop(block)
        self.num_budgeted -= seq.budget

    def committed(self, seq_id) -> int:
        return self.seqs[seq_id].committed

    def _take_block(self) -> int:
        if not self.free and self.num_blocks < self.pool_blocks:
            self._grow(min(max(2 * self.num_blocks, self.num_blocks + 1), self.pool_blocks))
        if self.free:
            return self.free.pop()
        digest, _ = self.evictable.popitem(last=False)  # bookings guarantee one: see free_blocks
        block = self.cached.pop(digest)
        del self.digest_of[block]
        self.num_evicted += 1
        return block

    def _blocks_up_to(self, seq: _SequenceBlocks, end: int) -> list[int]:
        need = self.blocks_for(end)
        while len(seq.blocks) < need:
            if seq.budget == 0:
                raise PoolExhaustedError(f"a sequence wrote past its booking ({end} tokens)")
            block = self._take_block()
            seq.budget -= 1
            self.num_budgeted -= 1
            self._hold(block)
            seq.blocks.append(block)
        return seq.blocks

    # -- inference -------------------------------------------------------------------------------
    def forward(self, batch) -> list[tuple[np.ndarray, np.ndarray]]:
        num_seqs = len(batch)
        past_lens = np.zeros(num_seqs, dtype=np.int32)
        subsequence_begins = np.zeros(num_seqs + 1, dtype=np.int32)
        block_indices_begins = np.zeros(num_seqs + 1, dtype=np.int32)
        ids, positions, tables, rows_flat = [], [], [], []
        max_context = 0
        for i, (seq_id, token_ids, rows) in enumerate(batch):
            seq = self.seqs[seq_id]
            assert seq.pending == 0, "commit() the previous forward of this sequence first"
            num = len(token_ids)
            past, end = seq.committed, seq.committed + num
            if end > self.max_length:
                raise ValueError(f"sequence {seq_id!r} would pass the context limit ({end} > {self.max_length})")
            table = self._blocks_up_to(seq, end)[: self.blocks_for(end)]
            past_lens[i] = past
            rows_flat.append(subsequence_begins[i] + np.asarray(rows, dtype=np.int64))
            subsequence_begins[i + 1] = subsequence_begins[i] + num
            block_indices_begins[i + 1] = block_indices_begins[i] + len(table)
            ids.append(np.asarray(token_ids, dtype=np.int64))
            positions.append(self.positions[past:end])
            tables.extend(table)
            max_context = max(max_context, end)
            seq.pending = num
        request = OVPagedTarget.request_for(self, int(subsequence_begins[-1]))
        run_request(request, {
            "input_ids": np.concatenate(ids),
            "position_ids": np.concatenate(positions),
            "past_lens": past_lens,
            "subsequence_begins": subsequence_begins,
            "block_indices_begins": block_indices_begins,
            "block_indices": np.array(tables, dtype=np.int32),
            "max_context_len": np.array(max_context, dtype=np.int32),
            "logits_indices": np.concatenate(rows_flat),
        })
        logits = request.get_tensor("logits").data[:, 0]
        hidden = request.get_tensor("target_hidden").data[:, 0]
        out, row = [], 0
        for i, (_, _, rows) in enumerate(batch):
            out.append((logits[row:row + len(rows)], hidden[subsequence_begins[i]:subsequence_begins[i + 1]]))
            row += len(rows)
        return out

    def commit(self, seq_id, num_kept: int, token_ids=None, features=None) -> None:
        """Keep the first num_kept tokens of the last forward. With their token_ids and target
        features (prefix caching), every block they fill joins the prefix cache."""
        seq = self.seqs[seq_id]
        assert 0 < num_kept <= seq.pending
        start = seq.committed
        seq.committed += num_kept
        seq.pending = 0
        if self.caches_prefixes and token_ids is not None:
            assert len(token_ids) == num_kept and len(features) >= num_kept
            positions = np.arange(start, seq.committed)  # the features stay with their block
            blocks = np.asarray(seq.blocks)[positions // self.block_tokens]
            self.features[blocks, positions % self.block_tokens] = features[:num_kept]
            seq.tail_ids.extend(int(t) for t in token_ids)
            self._register_full_blocks(seq)

    def _register_full_blocks(self, seq: _SequenceBlocks) -> None:
        b = self.block_tokens
        while len(seq.tail_ids) >= b:
            seq.digest = block_digest(seq.digest, np.asarray(seq.tail_ids[:b]))
            del seq.tail_ids[:b]
            block = seq.blocks[seq.num_hashed]
            seq.num_hashed += 1
            if seq.digest not in self.cached:  # else another sequence computed the same block: keep that one
                self.cached[seq.digest] = block
                self.digest_of[block] = seq.digest


class DrafterPool:
    """OVDrafters sharing one compiled drafter, one InferRequest (and context state) per sequence."""

    def __init__(self, drafter: OVDrafter):
        self.template = drafter
        self.idle: list[OVDrafter] = []

    @property
    def block_size(self) -> int:
        return self.template.block_size

    def take(self) -> OVDrafter:
        t = self.template
        d = self.idle.pop() if self.idle else OVDrafter(t.compiled, t.block_size, t.mask_token_id,
                                                        len(t.ones[0]) - 1, exact_passes=t.draft_block == 0,
                                                        seq_axes=t.seq_axes)
        d.reset()
        return d

    def give(self, drafter: OVDrafter) -> None:
        self.idle.append(drafter)


def paged_compiled(target) -> ov.CompiledModel:
    """A pipeline's single-sequence target's compiled paged model; a ValueError for any other runner."""
    if not isinstance(target, OVPagedTarget) or target.logits_out is None:
        raise ValueError(f"batched generation needs the paged target runner, this pipeline has "
                         f"{getattr(target, 'kind', type(target).__name__)!r}")
    return target.compiled


def batch_target_for(target, pool_blocks: int | None = None, prefix_caching: bool = True) -> OVPagedBatchTarget:
    """The batch runner beside a pipeline's single-sequence target (its compiled paged model, and its
    f32-weight copy for wide calls where it has one)."""
    return OVPagedBatchTarget(paged_compiled(target), target.max_length, pool_blocks, prefix_caching=prefix_caching,
                              wide=target.wide_compiled, wide_from=target.wide_from)
