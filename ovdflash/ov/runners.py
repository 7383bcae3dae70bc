"""The compiled target and drafter behind decode's runner interfaces (decode.sequence.TargetRunner, DrafterRunner).

Contract:
- `run_request(request, inputs)`: one inference, inputs shared (no copies), start_async + wait.
- `OVPagedTarget` implements `TargetRunner` on the paged target: host-held block caches
  (one ov.Tensor per key_cache.i / value_cache.i, grown by doubling), `past_lens` = committed
  tokens, so a rollback is `commit(k)` alone and the next forward overwrites the rejected slots.
- `OVTarget` implements `TargetRunner` on the stateful target. Rollback is mask-based:
  a host-side physical 0/1 attention mask (rejected slots set to 0) with logical position_ids,
  so a rejected draft costs nothing and the KV cache is never copied per round. When the
  garbage (masked slots) exceeds `compact_fraction` of the cache and `compact_min_garbage`
  slots, `commit` compacts: every state is read once, the kept slots gathered into a dense
  tensor and written back. `state_reads`/`state_writes` count these, so tests can prove that
  ordinary rounds touch no state. `rewind(k)` keeps the first k committed tokens, by the mask too
  (prefix reuse across calls). Logits are computed only for the requested rows (prefill:
  the last row), and returned arrays are views into the output tensors, valid until the next call.
- `OVDrafter` implements `DrafterRunner`: it feeds the block `[last, mask*(B-1)]` as ids,
  the new context features, positions and an all-ones mask, and reads back only `draft_tokens`.
  A round that verifies k < B-1 drafts still runs the whole block and reads its first k
  (`draft_block` = B, manifest `draft_pass` "full_block"), or runs k + 1 tokens (`draft_block` 0,
  "exact"); near the end of the positions the pass shrinks to fit. `rewind(k)` cuts its context
  state to the first k positions (prefix reuse across calls).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import openvino as ov

# calls of this many tokens or more run on the paged target's f32-weight copy until calibrate_wide measures
WIDE_FROM = 5


def paged_cache_inputs(compiled: ov.CompiledModel) -> list:
    """(name, element type, per-block shape) of every key_cache.* / value_cache.* input of a paged target."""
    return [(i.get_any_name(), i.get_element_type(), [d.get_length() for d in i.get_partial_shape()[1:]])
            for i in compiled.inputs if i.get_any_name().startswith(("key_cache.", "value_cache."))]


def wide_request_of(wide: ov.CompiledModel | None, cache_inputs: list) -> ov.InferRequest | None:
    """An InferRequest of a paged target's f32-weight copy, which must take the same KV cache inputs."""
    if wide is None:
        return None
    if paged_cache_inputs(wide) != cache_inputs:
        raise ValueError("the wide target's KV cache inputs differ from the target's")
    return wide.create_infer_request()


def kv_seq_axes(model: ov.Model) -> dict[str, int]:
    """Variable id -> sequence axis of its state (the dynamic axis that is not the beam axis 0)."""
    axes = {}
    for op in model.get_ops():
        if op.get_type_name() != "ReadValue":
            continue
        shape = op.get_output_partial_shape(0)
        dynamic = [i for i in range(shape.rank.get_length()) if shape[i].is_dynamic and i != 0]
        axes[op.get_variable_id()] = dynamic[0] if len(dynamic) == 1 else 2
    return axes


def run_request(request: ov.InferRequest, inputs: dict) -> None:
    """One inference, inputs shared (no copies). start_async + wait, as openvino.genai's decode
    loop does, not infer(): infer() runs the graph on the calling Python thread, and with 2
    threads on a shared 2-vCPU VM our AR made fewer tokens/s that way
    (docs/BENCHMARKS.md, Compile settings; `tools/profile_round.py --sections loop`)."""
    request.start_async(inputs, share_inputs=True)
    request.wait()


class _LogitRows:
    """`logits_indices` for a forward of num tokens: all rows (a reused buffer), or the last."""

    row_indices = np.arange(256, dtype=np.int64)

    def _logit_rows(self, num: int, all_logits: bool) -> np.ndarray:
        if not all_logits:
            return np.array([num - 1], dtype=np.int64)
        if num > len(self.row_indices):
            self.row_indices = np.arange(num, dtype=np.int64)
        return self.row_indices[:num]


class OVTarget(_LogitRows):
    kind = "stateful"  # one of ovdflash.TARGET_RUNNERS
    rewinds_exactly = True  # `rewind` to any committed length (prefix reuse may cut the cached tokens)

    def __init__(self, compiled: ov.CompiledModel, max_length: int, seq_axes: dict[str, int] | None = None,
                 compact_fraction: float = 0.25, compact_min_garbage: int = 64):
        self.compiled = compiled
        self.request = compiled.create_infer_request()
        self.max_length = max_length
        self.seq_axes = seq_axes or {}
        self.compact_fraction = compact_fraction
        self.compact_min_garbage = compact_min_garbage
        self.logits_out = compiled.output("logits")
        self.hidden_out = compiled.output("target_hidden")
        # reused host buffers: inputs are views into these (share_inputs=True: no copies)
        self.positions = np.arange(max_length + 1, dtype=np.int64)[None, :]
        self.mask = np.ones((1, 256), dtype=np.int64)
        self.beam_idx = np.zeros(1, dtype=np.int32)
        self.state_reads = 0
        self.state_writes = 0
        self.num_compactions = 0
        self.reset()

    def reset(self) -> None:
        self.request.reset_state()
        self.committed = 0  # logical length
        self.physical = 0   # slots in the KV cache, masked ones included
        self.pending = 0    # tokens of the last forward not yet committed

    @property
    def garbage(self) -> int:
        return self.physical - self.committed - self.pending

    def forward(self, token_ids: np.ndarray, all_logits: bool) -> tuple[np.ndarray, np.ndarray]:
        assert self.pending == 0, "commit() the previous forward first"
        num = len(token_ids)
        end = self.physical + num
        if end > self.mask.shape[1]:
            grown = np.ones((1, max(2 * self.mask.shape[1], end)), dtype=np.int64)
            grown[:, : self.physical] = self.mask[:, : self.physical]
            self.mask = grown
        self.mask[0, self.physical:end] = 1
        rows = self._logit_rows(num, all_logits)
        run_request(self.request, {
            "input_ids": np.ascontiguousarray(token_ids, dtype=np.int64).reshape(1, num),
            "attention_mask": self.mask[:, :end],
            "position_ids": self.positions[:, self.committed:self.committed + num],  # logical
            "beam_idx": self.beam_idx,
            "logits_indices": rows,
        })
        self.physical, self.pending = end, num
        return self.request.get_tensor(self.logits_out).data[0], self.request.get_tensor(self.hidden_out).data[0]

    def commit(self, num_kept: int) -> None:
        """Keep the first num_kept tokens of the last forward; mask out the rest (no cache copy)."""
        assert 0 < num_kept <= self.pending
        self.mask[0, self.physical - self.pending + num_kept:self.physical] = 0
        self.committed += num_kept
        self.pending = 0
        if self.garbage >= max(self.compact_min_garbage, self.compact_fraction * self.physical):
            self.compact()

    def rewind(self, num_kept: int) -> None:
        """Keep only the first num_kept committed tokens: the later ones are masked out (no cache
        copy), and the cache compacts when the garbage passes the same threshold as in `commit`."""
        assert self.pending == 0 and 0 <= num_kept <= self.committed
        if num_kept == self.committed:
            return
        if num_kept == 0:
            self.reset()
            return
        kept_slots = np.flatnonzero(self.mask[0, : self.physical])
        self.mask[0, kept_slots[num_kept]:self.physical] = 0
        self.committed = num_kept
        if self.garbage >= max(self.compact_min_garbage, self.compact_fraction * self.physical):
            self.compact()

    def compact(self) -> None:
        """Drop the masked slots from every state: one dense read and write per state."""
        keep = np.flatnonzero(self.mask[0, : self.physical])
        for state in self.request.query_state():
            tensor = state.state  # a dequantized f32 copy of the whole cache (expensive: rare)
            value = tensor.data
            self.state_reads += 1
            axis = self.seq_axes.get(state.name, 2)
            assert value.shape[axis] == self.physical, (state.name, value.shape, self.physical)
            # a dense tensor: an ROI (strided view) tensor set as a state corrupts a u8 cache
            state.state = ov.Tensor(np.ascontiguousarray(np.take(value, keep, axis=axis)))
            self.state_writes += 1
        self.physical = len(keep)
        self.mask[0, : self.physical] = 1
        self.num_compactions += 1


class OVPagedTarget(_LogitRows):
    """engine.TargetRunner on the target after openvino's paged-attention transformation
    (`compile_runners(..., target_runner="paged")`), the attention openvino.genai runs.

    The KV cache is a set of host-allocated tensors, `[blocks, kv_heads, block_tokens, head_dim]`
    per layer for K and V (shape and element type as the plugin asks: f16/f32, or u8 with its
    scales), holding one sequence in blocks 0, 1, 2, ... in order. A forward writes its T tokens
    at slots committed..committed+T-1 and attends to them and the committed ones (`past_lens`).
    Rollback is free and exact: `commit(k)` keeps k of them, and the next forward overwrites the
    rest, so there is no mask, no garbage and no compaction. The cache grows by doubling its
    blocks (one copy of the used blocks each time).

    `wide` (optional): the same target compiled with f32 weights (`graphs.with_f32_weights`), for
    calls of `wide_from` tokens or more. With f16 weights the CPU plugin decompresses every weight
    again in each call of more than a few rows, so such calls cost twice a narrow one; the f32 copy
    reads twice the bytes but computes many rows at once. Both requests share the cache tensors.
    `calibrate_wide()` sets `wide_from` from timings on this host (or drops the copy)."""

    kind = "paged"  # one of ovdflash.TARGET_RUNNERS
    rewinds_exactly = True

    def __init__(self, compiled: ov.CompiledModel, max_length: int, initial_blocks: int = 16,
                 wide: ov.CompiledModel | None = None, wide_from: int = WIDE_FROM):
        self.compiled = compiled
        self.request = compiled.create_infer_request()
        self.wide_compiled = wide
        self.wide_from = wide_from
        self.wide_xml: Path | None = None  # the copy's IR file, for ovdflash.ov.memory
        self.num_wide_calls = 0
        self.last_request = self.request  # the request of the latest call: its outputs
        self.max_length = max_length
        names = {n for o in compiled.outputs for n in o.get_names()}
        # a graph scoring its next tokens itself (the feature pass's) has no logits output
        self.logits_out = compiled.output("logits") if "logits" in names else None
        self.hidden_out = compiled.output("target_hidden")
        self.cache_inputs = paged_cache_inputs(compiled)
        if not self.cache_inputs:
            raise ValueError("the paged-attention transformation left this target without key_cache.* inputs "
                             "(an attention pattern openvino does not convert): use target_runner='stateful'")
        # tokens per block: dim 2 of a value cache (a u8 key cache adds rows of scales to that dim)
        self.block_tokens = next(shape[1] for name, _, shape in self.cache_inputs if name.startswith("value_cache."))
        self.positions = np.arange(max_length + 1, dtype=np.int64)
        self.block_indices = np.arange(-(-(max_length + 1) // self.block_tokens), dtype=np.int32)
        self.past_lens = np.zeros(1, dtype=np.int32)
        self.subsequence_begins = np.zeros(2, dtype=np.int32)
        self.block_indices_begins = np.zeros(2, dtype=np.int32)
        self.max_context_len = np.zeros((), dtype=np.int32)
        self.caches: dict[str, ov.Tensor] = {}
        self.num_blocks = 0
        self.num_cache_grows = 0
        self.num_compactions = 0  # engine.TargetRunner: never compacts
        self.wide_request = wide_request_of(wide, self.cache_inputs)
        self._grow(initial_blocks)
        self.reset()

    def _grow(self, num_blocks: int) -> None:
        for name, element_type, shape in self.cache_inputs:
            tensor = ov.Tensor(element_type, [num_blocks, *shape])
            old = self.caches.get(name)
            if old is not None:
                tensor.data[: self.num_blocks] = old.data[: self.num_blocks]
            self.caches[name] = tensor
            for request in (self.request, self.wide_request):
                if request is not None:
                    request.set_tensor(name, tensor)
        self.num_blocks = num_blocks
        self.num_cache_grows += 1

    def request_for(self, num_tokens: int) -> ov.InferRequest:
        """The request a call of num_tokens tokens runs on (the wide one from `wide_from` tokens)."""
        wide = self.wide_request is not None and num_tokens >= self.wide_from
        self.num_wide_calls += wide
        self.last_request = self.wide_request if wide else self.request
        return self.last_request

    def drop_wide(self) -> None:
        """Forget the f32-weight copy (its memory goes with the last reference)."""
        self.wide_compiled = self.wide_request = self.wide_xml = None
        self.last_request = self.request

    def calibrate_wide(self, sizes=(2, 4, 5, 6, 8, 12, 16, 32), repetitions: int = 3,
                       context_tokens: int = 64) -> int | None:
        """Time calls of each size on both requests (interleaved, medians, after a 64-token
        context) and use the wide one from the smallest size at which it is faster at that size
        and every larger one; drop it when it never is. Returns wide_from, or None."""
        if self.wide_request is None:
            return None
        self.reset()
        self.run(np.ones(context_tokens, dtype=np.int64), np.array([context_tokens - 1]))
        self.commit(context_tokens)
        times = {(size, wide): [] for size in sizes for wide in (False, True)}
        kept = self.wide_from
        for rep in range(repetitions + 1):  # the first repetition warms each shape up, untimed
            for size in sizes:
                for wide in (False, True):
                    self.wide_from = size if wide else size + 1
                    t0 = time.perf_counter()
                    self.run(np.ones(size, dtype=np.int64), np.arange(size))
                    if rep:
                        times[size, wide].append(time.perf_counter() - t0)
                    self.commit(1)
        self.wide_from = kept
        self.reset()
        faster = [statistics.median(times[s, True]) < statistics.median(times[s, False]) for s in sizes]
        start = next((i for i in range(len(sizes)) if all(faster[i:])), None)
        if start is None:
            self.drop_wide()
            return None
        self.wide_from = sizes[start]
        return self.wide_from

    def reset(self) -> None:
        self.committed = 0  # tokens with KV in the cache, all of them valid
        self.pending = 0    # tokens of the last forward not yet committed

    def forward(self, token_ids: np.ndarray, all_logits: bool) -> tuple[np.ndarray, np.ndarray]:
        self.run(token_ids, self._logit_rows(len(token_ids), all_logits))
        out = self.last_request
        return out.get_tensor("logits").data[:, 0], out.get_tensor("target_hidden").data[:, 0]

    def run(self, token_ids: np.ndarray, rows: np.ndarray) -> None:
        """The inference of `forward`, with logits (or the graph's own scores) for `rows`
        (indices into token_ids); the outputs are left in `request`."""
        assert self.pending == 0, "commit() the previous forward first"
        num = len(token_ids)
        past, end = self.committed, self.committed + num
        blocks = -(-end // self.block_tokens)
        if blocks > self.num_blocks:
            self._grow(min(max(blocks, 2 * self.num_blocks), len(self.block_indices)))
        self.past_lens[0] = past
        self.subsequence_begins[1] = num
        self.block_indices_begins[1] = blocks
        self.max_context_len[...] = end
        run_request(self.request_for(num), {
            "input_ids": np.ascontiguousarray(token_ids, dtype=np.int64).reshape(num),
            "position_ids": self.positions[past:end],
            "past_lens": self.past_lens,
            "subsequence_begins": self.subsequence_begins,
            "block_indices_begins": self.block_indices_begins,
            "block_indices": self.block_indices[:blocks],
            "max_context_len": self.max_context_len,
            "logits_indices": rows,
        })
        self.pending = num

    def commit(self, num_kept: int) -> None:
        """Keep the first num_kept tokens of the last forward; the next forward overwrites the rest."""
        assert 0 < num_kept <= self.pending
        self.committed += num_kept
        self.pending = 0

    def rewind(self, num_kept: int) -> None:
        """Keep only the first num_kept committed tokens (free: the next forward overwrites the rest)."""
        assert self.pending == 0 and 0 <= num_kept <= self.committed
        self.committed = num_kept


class OVDrafter:
    def __init__(self, compiled: ov.CompiledModel, block_size: int, mask_token_id: int, max_length: int,
                 exact_passes: bool = False, seq_axes: dict[str, int] | None = None):
        self.compiled = compiled
        self.seq_axes = seq_axes or {}  # state name -> its sequence axis (2 when not named)
        self.request = compiled.create_infer_request()
        self.block_size = block_size
        self.draft_block = 0 if exact_passes else block_size  # tokens per drafter pass, at least num_drafts + 1
        self.mask_token_id = mask_token_id
        self.tokens_out = compiled.output("draft_tokens")
        self.positions = np.arange(max_length + 1, dtype=np.int64)[None, :]
        self.ones = np.ones((1, max_length + 1), dtype=np.int64)
        self.block = np.full((1, 256), mask_token_id, dtype=np.int64)
        self.beam_idx = np.zeros(1, dtype=np.int32)
        self.reset()

    def reset(self) -> None:
        self.request.reset_state()
        self.context_len = 0  # positions whose features are in the drafter state

    def propose(self, last: int, ctx_feats: np.ndarray, start: int, num_drafts: int) -> np.ndarray:
        num_ctx = len(ctx_feats)
        # manifest "draft_pass" full_block (the default): draft with the block the drafter was trained
        # on even when fewer drafts are verified, since the first slots of a short block see fewer
        # mask tokens than in training and draft worse (docs/BENCHMARKS.md, Compile settings); "exact"
        # (draft_block 0): k + 1 tokens, for drafters trained on short blocks too
        block = max(num_drafts + 1, min(self.draft_block, len(self.ones[0]) - start))
        if self.context_len + num_ctx != start:
            raise RuntimeError(f"drafter context out of sync: {self.context_len} + {num_ctx} != {start}")
        if block > self.block.shape[1]:
            self.block = np.full((1, block), self.mask_token_id, dtype=np.int64)
        self.block[0, 0] = last
        run_request(self.request, {
            "input_ids": self.block[:, :block],
            "hidden_states": np.ascontiguousarray(ctx_feats, dtype=np.float32)[None],
            "position_ids": self.positions[:, start - num_ctx:start + block],
            "attention_mask": self.ones[:, : start + block],
            "beam_idx": self.beam_idx,
        })
        self.context_len = start
        return self.request.get_tensor(self.tokens_out).data[0, :num_drafts].copy()

    def rewind(self, num_kept: int) -> None:
        """Keep the context of the first num_kept positions only. Exact: the state holds each context
        position's K/V, a function of that position's features alone, so a cut state is the state
        those positions alone would have built. One read and write of each state."""
        assert 0 <= num_kept <= self.context_len
        if num_kept == self.context_len:
            return
        if num_kept == 0:
            self.reset()
            return
        for state in self.request.query_state():
            value = state.state.data
            axis = self.seq_axes.get(state.name, 2)
            assert value.shape[axis] == self.context_len, (state.name, value.shape, self.context_len)
            kept = value[(slice(None),) * axis + (slice(0, num_kept),)]
            state.state = ov.Tensor(np.ascontiguousarray(kept))  # dense: see OVTarget.compact
        self.context_len = num_kept

