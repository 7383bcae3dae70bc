"""One drafter inference for every drafting sequence of a batched round: their drafters are rows of one request.

Contract:
- `DrafterRows(drafter)` is a `decode.scheduler.DrafterSource` on the compiled graph of an `OVDrafter`
  whose proposals are its `draft_tokens` (DFlash; `batches_rows(drafter)`): ONE InferRequest whose state
  holds a row of context K/V per sequence. `take()` hands out a `DrafterRow` (a `decode.round.DrafterRunner`,
  reset), `give(row)` takes it back.
- `propose_many([(row, last, ctx_feats, start, num_drafts), ...]) -> [drafts, ...]`: one inference for all
  of them, each row as its own `OVDrafter.propose` with the same arguments (the same block: the trained
  one, or num_drafts + 1 for "exact" drafters, shrunk near the end of the positions). A row attends only to
  its own context slots and its own block (`attention_mask` per row; padding and the other rows' slots are
  masked), so its proposals are its own drafter's up to the order of float sums. Rows of the request that
  do not draft this call ride along through the drafter's layers (nothing of theirs changes); where the
  graph has `draft_rows` (graphs.with_draft_rows, as compiled) they skip its head, most of a call.
- Layout: the rows share one physical length. A call stores `max(len(ctx_feats))` new slots in every
  row (a row's own features first, the rest masked) and runs the block, whose K/V are never stored;
  positions are per row. A row taken joins in a freed row of the state, or in a new one (copied by
  `beam_idx` and masked whole); a row given back is masked and dropped from the state at the next call
  (`beam_idx` again); when the last row is given back the state is reset, so an idle batch keeps no
  context. When the masked slots that every row could lose pass `compact_fraction` of the length (and
  `compact_min_garbage`), the state is compacted: each row's kept slots moved to its front, one read
  and write of each state (`num_compactions`).
- `DrafterRow.propose(...)` is `propose_many` of that row alone; `reset()` masks its slots; `rewind(k)` keeps
  its first k context positions (masks the rest).
May import: numpy, openvino, `.inference`, `.runners`.
"""
from __future__ import annotations

import numpy as np
import openvino as ov

from .inference import run_request
from .runners import ArgmaxProposals, OVDrafter, has_input


def batches_rows(drafter: OVDrafter) -> bool:
    """Whether this drafter's graph can run as `DrafterRows`: its proposals are `draft_tokens` rows."""
    return isinstance(drafter.proposals, ArgmaxProposals)


class DrafterRow:
    """One sequence's drafter: a row of its `DrafterRows`' request (module contract)."""

    def __init__(self, rows: DrafterRows, block_size: int):
        self.rows = rows
        self.block_size = block_size
        self.index = -1  # its row in the request's state
        self.context_len = 0

    def reset(self) -> None:
        self.rows.cut(self, 0)

    def rewind(self, num_kept: int) -> None:
        self.rows.cut(self, num_kept)

    def propose(self, last: int, ctx_feats: np.ndarray, start: int, num_drafts: int) -> np.ndarray:
        return self.rows.propose_many([(self, last, ctx_feats, start, num_drafts)])[0]


class DrafterRows:
    def __init__(self, drafter: OVDrafter, compact_fraction: float = 0.5, compact_min_garbage: int = 64):
        if not batches_rows(drafter):
            raise ValueError("DrafterRows runs DFlash drafters (draft_tokens); "
                             "use paged_batch.DrafterPool for this one")
        self.compiled = drafter.compiled
        self.block_size = drafter.block_size
        self.draft_block = drafter.draft_block
        self.mask_token_id = drafter.mask_token_id
        self.max_length = len(drafter.ones[0]) - 1
        self.seq_axes = drafter.seq_axes
        self.tokens_out = self.compiled.output("draft_tokens")
        self.heads_rows = has_input(self.compiled, "draft_rows")  # graphs.with_draft_rows: riding rows skip the head
        self.request = self.compiled.create_infer_request()
        self.compact_fraction, self.compact_min_garbage = compact_fraction, compact_min_garbage
        self.members: list[DrafterRow | None] = []  # by row of the request; None: given back, dropped next call
        self.state_rows = 0  # rows the request's state holds
        self.length = 0  # physical slots of every row
        self.kept = np.zeros((0, 64), dtype=np.int64)  # [row, slot]: 1 where the slot is that row's context
        self.num_compactions = 0

    # -- the source's side ---------------------------------------------------------------------------
    def take(self) -> DrafterRow:
        row = DrafterRow(self, self.block_size)
        free = [i for i, m in enumerate(self.members) if m is None]
        if free:
            row.index = free[0]
            self.members[row.index] = row
        else:
            row.index = len(self.members)
            self.members.append(row)
            self._grow_mask(len(self.members), self.length)
        self.kept[row.index] = 0
        return row

    def _holds(self, row: DrafterRow) -> bool:
        return 0 <= row.index < len(self.members) and self.members[row.index] is row

    def give(self, row: DrafterRow) -> None:
        if self._holds(row):
            self.members[row.index] = None
            self.kept[row.index] = 0
        row.index, row.context_len = -1, 0
        if not any(self.members):  # the last row left: keep no context of ended sequences
            self.request.reset_state()
            self.members, self.state_rows, self.length = [], 0, 0

    def cut(self, row: DrafterRow, num_kept: int) -> None:
        """Keep the first num_kept context positions of the row (mask the later slots)."""
        assert 0 <= num_kept <= row.context_len and self._holds(row)
        slots = np.flatnonzero(self.kept[row.index, : self.length])
        self.kept[row.index, slots[num_kept:]] = 0
        row.context_len = num_kept

    # -- one call for all ------------------------------------------------------------------------------
    def propose_many(self, calls: list[tuple]) -> list[np.ndarray]:
        for row, _, ctx_feats, start, _ in calls:
            if not self._holds(row):
                raise RuntimeError("a drafter row given back was asked to draft")
            if row.context_len + len(ctx_feats) != start:
                raise RuntimeError(f"drafter context out of sync: {row.context_len} + {len(ctx_feats)} != {start}")
        beam_idx = self._settle_rows()
        num_rows = len(self.members)
        num_new = max(len(c[2]) for c in calls)
        blocks = [max(k + 1, min(self.draft_block, self.max_length + 1 - start)) for _, _, _, start, k in calls]
        block = max(blocks)
        hidden = calls[0][2].shape[-1]
        ids = np.full((num_rows, block), self.mask_token_id, dtype=np.int64)
        feats = np.zeros((num_rows, num_new, hidden), dtype=np.float32)
        positions = np.zeros((num_rows, num_new + block), dtype=np.int64)
        end = self.length + num_new
        mask = np.zeros((num_rows, end + block), dtype=np.int64)
        mask[:, end] = 1  # a riding row's first block slot sees itself: no row is wholly masked
        self._grow_mask(num_rows, end)
        for (row, last, ctx_feats, start, _), row_block in zip(calls, blocks):
            i, num_ctx = row.index, len(ctx_feats)
            ids[i, 0] = last
            feats[i, :num_ctx] = ctx_feats
            positions[i, :num_ctx] = np.arange(start - num_ctx, start)
            positions[i, num_new:] = np.minimum(np.arange(start, start + block), self.max_length)
            mask[i, end:end + row_block] = 1
            self.kept[i, self.length:self.length + num_ctx] = 1
        mask[:, :end] = self.kept[:num_rows, :end]  # each row's context slots, the new ones included
        inputs = {"input_ids": ids, "hidden_states": feats, "position_ids": positions, "attention_mask": mask,
                  "beam_idx": beam_idx}
        drafting = np.array([c[0].index for c in calls], dtype=np.int64)
        if self.heads_rows:
            inputs["draft_rows"] = drafting
        run_request(self.request, inputs)
        self.state_rows, self.length = num_rows, end
        tokens = self.request.get_tensor(self.tokens_out).data
        out = []
        for j, (row, _, _, start, num_drafts) in enumerate(calls):
            row.context_len = start
            out.append(tokens[j if self.heads_rows else row.index, :num_drafts].copy())
        self._maybe_compact()
        return out

    def _settle_rows(self) -> np.ndarray:
        """beam_idx for the next call: rows given back are dropped, new ones copy row 0 (masked whole)."""
        order = [i for i, m in enumerate(self.members) if m is not None]
        self.members = [self.members[i] for i in order]
        self.kept[: len(order)] = self.kept[order]
        for new, row in enumerate(self.members):
            row.index = new
        if self.state_rows == 0:
            self.request.reset_state()
            self.length = 0
        return np.array([i if i < self.state_rows else 0 for i in order], dtype=np.int32)

    def _grow_mask(self, rows: int, slots: int) -> None:
        if rows > self.kept.shape[0] or slots > self.kept.shape[1]:
            grown = np.zeros((max(rows, 2 * self.kept.shape[0]), max(slots, 2 * self.kept.shape[1])), dtype=np.int64)
            grown[: self.kept.shape[0], : self.kept.shape[1]] = self.kept
            self.kept = grown

    def _maybe_compact(self) -> None:
        longest = max((row.context_len for row in self.members), default=0)  # a row's kept slots are its context
        if self.length - longest < max(self.compact_min_garbage, self.compact_fraction * self.length):
            return
        self.num_compactions += 1
        rows = self.state_rows
        if longest == 0:  # no row keeps a slot: the state starts afresh at the next call
            self.kept[:rows, : self.length] = 0
            self.state_rows = self.length = 0
            return
        order = [np.flatnonzero(self.kept[i, : self.length]) for i in range(rows)]
        for state in self.request.query_state():
            value = state.state.data
            axis = self.seq_axes.get(state.name, 2)
            assert value.shape[0] == rows and value.shape[axis] == self.length, (state.name, value.shape)
            shape = list(value.shape)
            shape[axis] = longest
            packed = np.zeros(shape, dtype=value.dtype)
            for i, slots in enumerate(order):
                taken = np.take(value[i], slots, axis=axis - 1)
                packed[i][(slice(None),) * (axis - 1) + (slice(0, len(slots)),)] = taken
            state.state = ov.Tensor(packed)
        self.kept[:rows, : self.length] = 0
        for i, slots in enumerate(order):
            self.kept[i, : len(slots)] = 1
        self.length = longest
