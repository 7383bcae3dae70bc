"""The paged target for several sequences per inference, and a pool of per-sequence drafters.

Contract:
- `OVPagedBatchTarget(compiled, max_length, pool_blocks=None)` implements `scheduler.BatchTarget` on
  the compiled paged target (the one `OVPagedTarget` runs, through its own InferRequest). KV blocks of
  every sequence come from ONE pool: `pool_blocks` blocks of `block_tokens` tokens (default: the
  blocks of `DEFAULT_POOL_BYTES` of cache, at least one full-context sequence; `blocks_for_bytes`).
  The host tensors start small and grow by doubling up to the limit (the used blocks are copied
  once per growth); freed blocks go on a free list and are reused.
- `reserve(seq_id, num_tokens)` books the blocks a sequence can ever write; False when the pool has
  too few free blocks now (the scheduler keeps it waiting); a booking larger than the whole pool is a
  ValueError. `release(seq_id)` returns them. Blocks are assigned to a sequence as it grows, always
  within its booking, so no inference ever runs out of cache.
- `forward(batch)`: batch = [(seq_id, token_ids, rows)], one inference for all: per sequence
  `past_lens` = its committed tokens, its block table, `subsequence_begins` / `block_indices_begins`
  over the flattened tokens, and `logits_indices` only for each sequence's `rows` (indices into its
  own tokens). Returns per sequence (logits[len(rows), V], features[T, H]), views valid until the
  next call. `commit(seq_id, k)` keeps the first k tokens of its last forward; the next forward
  overwrites the rest (rollback is free, as in OVPagedTarget).
- `DrafterPool(drafter)`: `OVDrafter`s on the same compiled drafter, one InferRequest each, handed
  out per sequence (`take()`, reset) and returned (`give(d)`); each keeps its sequence's context in
  its own state, exactly as the single-sequence drafter does.
"""
from __future__ import annotations

import numpy as np
import openvino as ov

from .runners import OVDrafter, OVPagedTarget, run_request

# KV cache the pool may hold by default, across all sequences
DEFAULT_POOL_BYTES = 1 << 30


def cache_inputs_of(compiled: ov.CompiledModel) -> list:
    """(name, element type, per-block shape) of every key_cache.* / value_cache.* input of a paged target."""
    inputs = [(i.get_any_name(), i.get_element_type(), [d.get_length() for d in i.get_partial_shape()[1:]])
              for i in compiled.inputs if i.get_any_name().startswith(("key_cache.", "value_cache."))]
    if not inputs:
        raise ValueError("this target has no key_cache.* inputs: batching needs the paged target runner")
    return inputs


def block_tokens_of(cache_inputs) -> int:
    return next(shape[1] for name, _, shape in cache_inputs if name.startswith("value_cache."))


def bytes_per_block(cache_inputs) -> int:
    """Bytes one KV block takes across every key/value cache input."""
    return sum(int(np.prod(shape)) * element_type.size for _, element_type, shape in cache_inputs)


def blocks_for_bytes(cache_inputs, num_bytes: int) -> int:
    """Blocks of every key/value cache input that fit in num_bytes."""
    return max(1, num_bytes // bytes_per_block(cache_inputs))


class PoolExhaustedError(ValueError):
    pass


class OVPagedBatchTarget:
    kind = "paged-batch"

    def __init__(self, compiled: ov.CompiledModel, max_length: int, pool_blocks: int | None = None,
                 initial_blocks: int = 16):
        self.compiled = compiled
        self.request = compiled.create_infer_request()
        self.max_length = max_length
        self.logits_out = compiled.output("logits")
        self.hidden_out = compiled.output("target_hidden")
        self.cache_inputs = cache_inputs_of(compiled)
        self.block_tokens = block_tokens_of(self.cache_inputs)
        blocks_per_sequence = -(-max_length // self.block_tokens)
        if pool_blocks is None:
            pool_blocks = max(blocks_per_sequence, blocks_for_bytes(self.cache_inputs, DEFAULT_POOL_BYTES))
        if isinstance(pool_blocks, bool) or not isinstance(pool_blocks, (int, np.integer)) or pool_blocks < 1:
            raise ValueError(f"pool_blocks must be an integer >= 1, got {pool_blocks!r}")
        self.pool_blocks = int(pool_blocks)
        self.positions = np.arange(max_length + 1, dtype=np.int64)
        self.caches: dict[str, ov.Tensor] = {}
        self.num_blocks = 0        # allocated in the host tensors
        self.free: list[int] = []  # allocated and unused block ids
        self.num_reserved = 0      # blocks booked by all sequences
        self.num_cache_grows = 0
        self.seqs: dict = {}       # seq_id -> [committed, pending, reserved blocks, block ids]
        self._grow(min(initial_blocks, self.pool_blocks))

    # -- pool ------------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_tokens)

    @property
    def free_blocks(self) -> int:
        """Blocks not booked by any sequence."""
        return self.pool_blocks - self.num_reserved

    def _grow(self, num_blocks: int) -> None:
        allocated = self.num_blocks
        OVPagedTarget._grow(self, num_blocks)  # the same host tensors and fields as the single-sequence runner
        self.free.extend(range(allocated, num_blocks))

    def reserve(self, seq_id, num_tokens: int) -> bool:
        need = self.blocks_for(min(num_tokens, self.max_length))
        if need > self.pool_blocks:
            raise PoolExhaustedError(f"a sequence of {num_tokens} tokens needs {need} KV blocks; the pool holds "
                                     f"{self.pool_blocks} (raise pool_blocks)")
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already in the batch")
        if need > self.free_blocks:
            return False
        self.seqs[seq_id] = [0, 0, need, []]
        self.num_reserved += need
        return True

    def release(self, seq_id) -> None:
        _, _, reserved, blocks = self.seqs.pop(seq_id)
        self.free.extend(blocks)
        self.num_reserved -= reserved

    def committed(self, seq_id) -> int:
        return self.seqs[seq_id][0]

    def _blocks_up_to(self, seq, end: int) -> list[int]:
        need = self.blocks_for(end)
        if need > seq[2]:
            raise PoolExhaustedError(f"a sequence wrote past its booking ({end} tokens, {seq[2]} blocks)")
        while len(seq[3]) < need:
            if not self.free:
                self._grow(min(max(2 * self.num_blocks, self.num_blocks + 1), self.pool_blocks))
            seq[3].append(self.free.pop())
        return seq[3]

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
            assert seq[1] == 0, "commit() the previous forward of this sequence first"
            num = len(token_ids)
            past, end = seq[0], seq[0] + num
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
            seq[1] = num
        run_request(self.request, {
            "input_ids": np.concatenate(ids),
            "position_ids": np.concatenate(positions),
            "past_lens": past_lens,
            "subsequence_begins": subsequence_begins,
            "block_indices_begins": block_indices_begins,
            "block_indices": np.array(tables, dtype=np.int32),
            "max_context_len": np.array(max_context, dtype=np.int32),
            "logits_indices": np.concatenate(rows_flat),
        })
        logits = self.request.get_tensor(self.logits_out).data[:, 0]
        hidden = self.request.get_tensor(self.hidden_out).data[:, 0]
        out, row = [], 0
        for i, (_, _, rows) in enumerate(batch):
            out.append((logits[row:row + len(rows)], hidden[subsequence_begins[i]:subsequence_begins[i + 1]]))
            row += len(rows)
        return out

    def commit(self, seq_id, num_kept: int) -> None:
        seq = self.seqs[seq_id]
        assert 0 < num_kept <= seq[1]
        seq[0] += num_kept
        seq[1] = 0


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


def batch_target_for(target, pool_blocks: int | None = None) -> OVPagedBatchTarget:
    """The batch runner beside a pipeline's single-sequence target (its compiled paged model)."""
    return OVPagedBatchTarget(paged_compiled(target), target.max_length, pool_blocks)
