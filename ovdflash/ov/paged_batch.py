"""The paged target for several sequences per inference, its pool's sizing, and a pool of per-sequence drafters.

Contract:
- `OVPagedBatchTarget(compiled, max_length, pool_blocks=None, prefix_caching=True)` implements
  `decode.scheduler.BatchTarget` on the compiled paged target (the one `OVPagedTarget` runs, through its
  own InferRequest). Its KV tensors, requests and flattened inference are `paged.PagedKV`'s; the
  books of its blocks are `pool`'s, a `block_pool.BlockPool` (bookings, block tables, free list,
  prefix cache: its contract), read through the target (`reserve`, `release`, `committed`,
  `blocks_for`, `pool_usage`, `pool_blocks`, `free_blocks`, and the pool's counters). KV blocks of
  every sequence come from ONE pool: `pool_blocks` blocks of `block_tokens` tokens (default
  `default_pool_blocks`: one full-context sequence's blocks, shared by the whole batch, at most
  `MAX_POOL_SHARE` of the memory available; `blocks_for_bytes`). The host tensors start small and
  grow by doubling up to the limit (the used blocks are copied once per growth).
- Prefix caching (`prefix_caching=True`, the default; `caches_prefixes`): the pool keeps every full
  block of committed tokens, and the target the features of its positions in
  `features[block, slot, H]` (grown with the KV tensors, counted in `pool_bytes_per_block`).
  `cached_features(seq_id)` holds those of the tokens `reserve` found cached for a sequence, for the
  drafter's context. A prompt that parts from a cached block mid-block starts from a copy of its KV
  and features (`_copy_block`, the pool's reuse within a block). Outputs are those of a full prefill,
  since a block is found only by its exact tokens.
  A hybrid target also needs the linear-attention state after the shared prefix: its sequences keep
  the state at every multiple of `linear.checkpoint_every` tokens (whole blocks) and share it under
  the digest of the block it ends (`linear.share`, at most `linear.max_shared`: about the pool's KV
  memory). A sequence also shares its state when it has committed its whole prompt, and when it is
  released, each under the chain digest of its committed tokens then (`pool.end_digest`): a
  conversation's next turn, whose prompt extends every committed token of the last one (or only its
  prompt, as templates that drop a reply's reasoning give), reuses them all. The pool copies a
  block's tokens only up to such a state (`copy_state`). `reserve` shares the blocks up to the last
  one with a shared state (or all matched ones and such a copy) and starts the sequence from that
  state (`linear.adopt`), so a prompt that parts from a cached one elsewhere reuses the prefix up to
  the last kept state before.
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
  its own state, exactly as the single-sequence drafter does (DFlash drafters batch their calls
  instead: `drafter_rows.DrafterRows`).
May import: numpy, openvino, `.paged`, `.block_pool`, `.runners`.
"""
from __future__ import annotations

import os
from operator import attrgetter

import numpy as np
import openvino as ov

from .block_pool import BlockPool
from .linear_states import MAX_CHECKPOINTS, state_table_inputs
from .memory import available_memory_bytes
from .paged import (
    WIDE_FROM,
    OVPagedTarget,
    PagedKV,
    block_tokens_of,
    bytes_per_block,
    checkpoint_interval,
    paged_cache_inputs,
)
from .runners import OVDrafter

# the default pool takes at most this share of the memory available when it is sized
MAX_POOL_SHARE = 0.25
NO_CACHE_INPUTS = "this target has no key_cache.* inputs: batching needs the paged target runner"


def cache_inputs_of(compiled: ov.CompiledModel) -> list:
    """(name, element type, per-block shape) of every key_cache.* / value_cache.* input of a paged target."""
    inputs = paged_cache_inputs(compiled)
    if not inputs:
        raise ValueError(NO_CACHE_INPUTS)
    return inputs


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
    block_tokens = block_tokens_of(cache_inputs)
    kv_types = sorted({element_type.get_type_name() for _, element_type, _ in cache_inputs})
    per_token = pool_bytes_per_block(compiled, prefix_caching) / block_tokens
    kv = bytes_per_block(cache_inputs) / block_tokens
    features = f" + {(per_token - kv) / 1024:.1f} KiB of f32 prefix features" if prefix_caching else ""
    text = (f"KV cache pool: {pool_blocks * block_tokens} tokens in {pool_blocks} blocks, "
            f"{pool_blocks * block_tokens * per_token / 2 ** 20:.1f} MiB at most "
            f"({'/'.join(kv_types)} KV, {kv / 1024:.1f} KiB a token{features})")
    tables = state_table_inputs(compiled)
    if tables:  # a hybrid target: its linear-attention states live beside the pool
        slot = sum(int(np.prod(shape)) * element_type.size for _, element_type, shape in tables)
        text += (f"; linear-attention state {slot / 2 ** 20:.2f} MiB a slot, a sequence holds 1 "
                 f"(+1 a verified token during a verify of up to {MAX_CHECKPOINTS})")
        if prefix_caching:
            every, most = shared_states(slot, bytes_per_block(cache_inputs), block_tokens, pool_blocks)
            text += (f", and prefixes share the state every {every} tokens, at most {most} slots, and as many "
                     "more where finished prompts and requests ended, for conversations' next turns")
    return text


def shared_states(bytes_per_slot: int, block_bytes: int, block_tokens: int, pool_blocks: int) -> tuple[int, int]:
    """A hybrid pool's prefix sharing: (tokens between kept linear-attention states, most states
    shared), so that the shared states take at most about the pool's KV memory."""
    every = checkpoint_interval(bytes_per_slot, block_bytes, block_tokens)
    return every, max(1, pool_blocks * block_tokens // every)


def blocks_for_bytes(compiled: ov.CompiledModel, num_bytes: int, prefix_caching: bool = True) -> int:
    """Pool blocks that fit in num_bytes."""
    return max(1, num_bytes // pool_bytes_per_block(compiled, prefix_caching))


def default_pool_blocks(compiled: ov.CompiledModel, max_length: int, prefix_caching: bool = True,
                        available: int | None = None) -> int:
    """The default pool: one full-context sequence's blocks, which the batch shares (shorter
    requests run side by side in them), at most MAX_POOL_SHARE of the memory available now. A pool
    capped below one context lowers the server's context limit to what it holds."""
    one_context = -(-max_length // block_tokens_of(cache_inputs_of(compiled)))
    if available is None:  # no /proc/meminfo: the physical memory
        available = available_memory_bytes() or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = int(MAX_POOL_SHARE * available)
    return max(1, min(one_context, blocks_for_bytes(compiled, share, prefix_caching)))


def _pooled(*names: str) -> tuple:
    """Properties reading `pool.<name>` (dotted names too): the pool's books, seen through the target
    (the scheduler, the metrics and the tests ask the target)."""
    return tuple(property(attrgetter(f"pool.{name}")) for name in names)


class OVPagedBatchTarget(PagedKV):
    """decode.scheduler.BatchTarget on the paged target (module contract): its KV tensors and inference are
    `PagedKV`'s, the books of its blocks `pool`'s (a `BlockPool`), and with prefix caching `features`
    holds the target features of every block's tokens."""

    kind = "paged-batch"
    no_cache_inputs = NO_CACHE_INPUTS
    committed, blocks_for, pool_usage = _pooled("committed", "blocks_for", "pool_usage")
    pool_blocks, free_blocks, num_reserved, num_referenced, num_budgeted = _pooled(
        "pool_blocks", "free_blocks", "num_reserved", "num_referenced", "num_budgeted")
    seqs, refs, free = _pooled("seqs", "refs", "free")
    cached, digest_of, evictable = _pooled("prefixes.cached", "prefixes.digest_of", "prefixes.evictable")
    num_evicted, num_prefix_queries, num_prefix_hits = _pooled("num_evicted", "num_prefix_queries", "num_prefix_hits")

    def __init__(self, compiled: ov.CompiledModel, max_length: int, pool_blocks: int | None = None,
                 initial_blocks: int = 16, prefix_caching: bool = True, wide: ov.CompiledModel | None = None,
                 wide_from: int = WIDE_FROM):
        super().__init__(compiled, max_length, wide, wide_from)
        self.caches_prefixes = bool(prefix_caching)
        if pool_blocks is None:
            pool_blocks = default_pool_blocks(compiled, max_length, self.caches_prefixes)
        width = feature_width_of(compiled) if self.caches_prefixes else 0
        self.features = np.zeros((0, self.block_tokens, width), dtype=np.float32)  # [block, slot, H]
        # a hybrid sequence starts from a shared linear state: a copy must end where one was kept
        copy_state = None if self.linear is None else self.linear.shared.__contains__
        self.pool = BlockPool(pool_blocks, self.block_tokens, max_length, self.fit_blocks, initial_blocks,
                              self.caches_prefixes, copy_block=self._copy_block, copy_state=copy_state)
        self.prompt_ends: dict = {}  # hybrid seq -> its prompt's length, where its state is shared once reached
        if self.linear is not None and self.caches_prefixes:  # shared prefixes need their linear-attention state
            self.linear.checkpoint_every, self.linear.max_shared = shared_states(
                self.linear.bytes_per_slot, self.bytes_per_block, self.block_tokens, pool_blocks)
            self.pool.match_limit = self._blocks_with_state

    def _blocks_with_state(self, digests: list[bytes]) -> int:
        """Leading matched blocks a hybrid sequence may share: up to the last one whose state is shared
        (kept every `checkpoint_every` tokens, or where a finished sequence ended on a block's end)."""
        for num in range(len(digests), 0, -1):
            if digests[num - 1] in self.linear.shared:
                return num
        return 0

    def reserve(self, seq_id, num_tokens: int, prompt_ids=None) -> bool:
        """Book a sequence's blocks (`BlockPool.reserve`); a hybrid one that shares cached blocks starts
        from the linear-attention state after them."""
        if not self.pool.reserve(seq_id, num_tokens, prompt_ids):
            return False
        if self.linear is not None:
            key = self.pool.copied_key(seq_id) or (self.pool.digests(seq_id)[-1]
                                                    if self.pool.matched_blocks(seq_id) else None)
            if key is not None:
                self.linear.adopt(seq_id, key)
            if self.caches_prefixes and prompt_ids is not None:
                self.prompt_ends[seq_id] = len(prompt_ids)
        return True

    def _grow(self, num_blocks: int) -> None:
        allocated = self.num_blocks
        super()._grow(num_blocks)
        if self.caches_prefixes:  # a block's features grow with its KV
            grown = np.zeros((num_blocks, *self.features.shape[1:]), dtype=np.float32)
            grown[:allocated] = self.features[:allocated]
            self.features = grown

    def release(self, seq_id) -> None:
        """Free a sequence's KV blocks (to the prefix cache where kept) and its linear-attention slots; a
        hybrid one shares its last state under the digest its last block is cached by (a next turn's start)."""
        end = self.pool.end_digest(seq_id) if self.linear is not None and self.caches_prefixes else None
        self.prompt_ends.pop(seq_id, None)
        self.pool.release(seq_id)
        if self.linear is not None:
            self.linear.release(seq_id, share_as=end)

    def _copy_block(self, source: int, block: int) -> None:
        """The pool's copy of a cached block into a sequence's own one: its KV and its features."""
        for tensor in self.caches.values():
            tensor.data[block] = tensor.data[source]
        self.features[block] = self.features[source]

    def cached_features(self, seq_id) -> np.ndarray | None:
        """Target features of the cached prefix `reserve` gave this sequence (None: nothing cached)."""
        reused = self.pool.reused(seq_id)
        if not reused:
            return None
        blocks, slots = self.pool.slots(seq_id, 0, reused)
        return self.features[blocks, slots]

    def forward(self, batch) -> list[tuple[np.ndarray, np.ndarray]]:
        num_seqs = len(batch)
        past_lens = np.zeros(num_seqs, dtype=np.int32)
        subsequence_begins = np.zeros(num_seqs + 1, dtype=np.int32)
        block_indices_begins = np.zeros(num_seqs + 1, dtype=np.int32)
        ids, positions, tables, rows_flat, linear_calls = [], [], [], [], []
        max_context = 0
        for i, (seq_id, token_ids, rows) in enumerate(batch):
            num = len(token_ids)
            past, table = self.pool.write(seq_id, num)
            past_lens[i] = past
            rows_flat.append(subsequence_begins[i] + np.asarray(rows, dtype=np.int64))
            subsequence_begins[i + 1] = subsequence_begins[i] + num
            block_indices_begins[i + 1] = block_indices_begins[i] + len(table)
            ids.append(np.asarray(token_ids, dtype=np.int64))
            positions.append(self.positions[past:past + num])
            tables.extend(table)
            linear_calls.append((seq_id, past, num))
            max_context = max(max_context, past + num)
        self.run_flat(np.concatenate(ids), np.concatenate(positions), past_lens, subsequence_begins,
                      block_indices_begins, np.array(tables, dtype=np.int32), max_context, np.concatenate(rows_flat),
                      linear_calls)
        logits, hidden = self.outputs()
        out, row = [], 0
        for i, (_, _, rows) in enumerate(batch):
            out.append((logits[row:row + len(rows)], hidden[subsequence_begins[i]:subsequence_begins[i + 1]]))
            row += len(rows)
        return out

    def commit(self, seq_id, num_kept: int, token_ids=None, features=None) -> None:
        """Keep the first num_kept tokens of the last forward. With their token_ids and target
        features (prefix caching), every block they fill joins the prefix cache."""
        start = self.pool.committed(seq_id)
        self.pool.commit(seq_id, num_kept, token_ids)
        if self.linear is not None:
            self.linear.commit(seq_id, num_kept)
            digests = self.pool.digests(seq_id) if token_ids is not None else []
            for position in list(self.linear.kept_at.get(seq_id, {})):  # kept states go to the shared ones
                block = position // self.block_tokens
                self.linear.share(seq_id, position, digests[block - 1] if 0 < block <= len(digests) else None)
            if self.prompt_ends.get(seq_id) == self.pool.committed(seq_id):  # the prompt's end: a next turn may part here
                del self.prompt_ends[seq_id]
                self.linear.share_committed(seq_id, self.pool.end_digest(seq_id))
        if self.caches_prefixes and token_ids is not None:  # the features stay with their block
            assert len(features) >= num_kept
            blocks, slots = self.pool.slots(seq_id, start, start + num_kept)
            self.features[blocks, slots] = features[:num_kept]


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
                         f"{getattr(target, 'kind', type(target).__name__)!r} (load it with target_runner=\"paged\", "
                         "on the command line --target-runner paged)")
    return target.compiled


def batch_target_for(target, pool_blocks: int | None = None, prefix_caching: bool = True) -> OVPagedBatchTarget:
    """The batch runner beside a pipeline's single-sequence target (its compiled paged model, and its
    f32-weight copy for wide calls where it has one)."""
    batch = OVPagedBatchTarget(paged_compiled(target), target.max_length, pool_blocks, prefix_caching=prefix_caching,
                               wide=target.wide_compiled, wide_from=target.wide_from)
    if batch.linear is not None:
        batch.linear.max_checkpoints = target.linear.max_checkpoints
    return batch
