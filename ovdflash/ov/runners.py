"""The stateful target and the drafter behind decode's runner interfaces (decode.sequence.TargetRunner, decode.round.DrafterRunner).

Contract:
- `run_request` (from `.inference`): one inference, inputs shared (no copies), start_async + wait;
  this module's runners call it by this module's name (tools may replace it here).
- `OVPagedTarget`, the `TargetRunner` on the paged target, lives in `.paged`.
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
  the new context features, positions and an all-ones mask, and reads back only the proposals:
  its proposer follows the compiled graph's kind (`proposals_for`): `ArgmaxProposals` reads a DFlash
  drafter's `draft_tokens`, `dflash2.SelectorWalk` walks a DFlash 2 drafter's candidates,
  `dspark.DSparkWalk` a DSpark drafter's Markov-biased slot logits. `confidence` is the proposer's
  per-slot predicted acceptance of the last proposal (DSpark's confidence head), else None; how
  many drafts are verified stays the block policy's (decode.round.SequenceState.draft_cut).
  A round that verifies k < B-1 drafts still runs the whole block and reads its first k
  (`draft_block` = B, manifest `draft_pass` "full_block"), or runs k + 1 tokens (`draft_block` 0,
  "exact"); near the end of the positions the pass shrinks to fit. `rewind(k)` cuts its context
  state to the first k positions (prefix reuse across calls).
May import: numpy, openvino, `.inference`, `.dflash2` and `.dspark`.
"""
from __future__ import annotations

import numpy as np
import openvino as ov

from .dflash2 import SelectorWalk, is_selector_graph
from .dspark import DSparkWalk, is_dspark_graph
from .inference import LogitRows, run_request


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


class OVTarget(LogitRows):
    kind = "stateful"  # one of ovdflash.TARGET_RUNNERS
    rewinds_exactly = True  # `rewind` to any committed length (prefix reuse may cut the cached tokens)
    pending = 0  # tokens of the last forward not yet committed

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
        self.pending = 0

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


def has_input(compiled: ov.CompiledModel, name: str) -> bool:
    return any(name in port.get_names() for port in compiled.inputs)


class ArgmaxProposals:
    """DFlash proposals: the runtime graph's `draft_tokens` (the head's argmax per draft slot)."""

    def __init__(self, compiled: ov.CompiledModel):
        self.tokens_out = compiled.output("draft_tokens")

    def read(self, request: ov.InferRequest, num_drafts: int) -> np.ndarray:
        return request.get_tensor(self.tokens_out).data[0, :num_drafts].copy()


def proposals_for(compiled: ov.CompiledModel) -> ArgmaxProposals | SelectorWalk | DSparkWalk:
    """The proposer for a compiled drafter graph, by the outputs its kind's graph has."""
    if is_dspark_graph(compiled):
        return DSparkWalk(compiled)
    return SelectorWalk(compiled) if is_selector_graph(compiled) else ArgmaxProposals(compiled)


class OVDrafter:
    def __init__(self, compiled: ov.CompiledModel, block_size: int, mask_token_id: int, max_length: int,
                 exact_passes: bool = False, seq_axes: dict[str, int] | None = None):
        self.compiled = compiled
        self.seq_axes = seq_axes or {}  # state name -> its sequence axis (2 when not named)
        self.request = compiled.create_infer_request()
        self.block_size = block_size
        self.draft_block = 0 if exact_passes else block_size  # tokens per drafter pass, at least num_drafts + 1
        self.mask_token_id = mask_token_id
        self.proposals = proposals_for(compiled)
        self.positions = np.arange(max_length + 1, dtype=np.int64)[None, :]
        self.ones = np.ones((1, max_length + 1), dtype=np.int64)
        self.block = np.full((1, 256), mask_token_id, dtype=np.int64)
        self.beam_idx = np.zeros(1, dtype=np.int32)
        # graphs.with_draft_rows: the rows that reach the head
        self.draft_rows = np.zeros(1, dtype=np.int64) if has_input(compiled, "draft_rows") else None
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
        inputs = {
            "input_ids": self.block[:, :block],
            "hidden_states": np.ascontiguousarray(ctx_feats, dtype=np.float32)[None],
            "position_ids": self.positions[:, start - num_ctx:start + block],
            "attention_mask": self.ones[:, : start + block],
            "beam_idx": self.beam_idx,
        }
        if self.draft_rows is not None:
            inputs["draft_rows"] = self.draft_rows
        run_request(self.request, inputs)
        self.context_len = start
        return self.proposals.read(self.request, num_drafts)

    @property
    def confidence(self) -> np.ndarray | None:
        return getattr(self.proposals, "confidence", None)

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

