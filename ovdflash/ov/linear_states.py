"""Per-sequence linear-attention state slots of a paged hybrid target (Qwen3.5's Gated DeltaNet layers).

Contract:
- A hybrid target after `hybrid.linear_states_as_variables` and openvino's paged-attention
  transformation runs each linear-attention layer as the CPU plugin's PagedCausalConv1D and
  PagedGatedDeltaNet ops. They read and write states in tables the runtime holds:
  `conv_state_table.<n>` [slots, conv_dim, K] and `gated_delta_state_table.<n>` [slots, H, dv, dk],
  one row (a slot) per state, placed per call by `la.block_indices` / `la.block_indices_begins`
  (per sequence, the slot it reads, then the slots it writes), `la.past_lens` and
  `la.cache_interval` (1: the state after every token, in its own slot; 0: the final state only).
- `LinearStateSlots(compiled)` owns those tables (`tables`, grown by doubling, the used slots copied;
  bound to every request given to `bind`), the free slots, and per sequence its committed slot:
  the state after its committed tokens, zero for a new sequence.
  * `inputs(calls)`: the `la.*` inputs of one call, calls = [(seq, past, num_tokens)] in the order of
    the flattened tokens. A call of at most `max_checkpoints` tokens writes one checkpoint per token
    (slot k holds the state after token k); a longer one (a prefill) writes its final state only.
    The committed slot is only read, so a forward changes no committed state.
  * `commit(seq, num_kept)` after that call makes the checkpoint after `num_kept` tokens the committed
    state (a slot swap, no copy) and frees the rest; a partial commit of a final-state-only call is a
    ValueError. A round with no accepted draft keeps the state after its one target token, never the
    previous round's.
  * `checkpoint_every` (None: off; the single-sequence runner sets it): a sequence also keeps the
    state at every multiple of that many tokens, from its decode rounds and from long calls that
    start on a multiple (they run with that interval; the conv kernel counts from a call's first
    token, so a long call starting elsewhere keeps only its final state). `rewind_floor(seq, n)`
    is the longest kept length <= n (0: none), and `rewind(seq, m)` makes the state kept at m the
    committed one and drops those after it: prefix reuse that cuts back to m and prefills the rest.
  * Shared states (prefix caching across sequences, the batched runner): `share(seq, position, key)`
    moves the state a sequence kept at `position` under `key` (its prefix's block digest) into
    `shared`, at most `max_shared` of them (the least recently used go first); `adopt(seq, key)`
    makes a shared state a new sequence's committed one, read in place (no copy). Turn states, for
    a conversation's next turn: `share_committed(seq, key)` shares a running sequence's committed
    state (where its prompt ends), `release(seq, share_as=key)` its last one. Their keys are also in
    `turns`, bounded apart (at most `max_shared` more, least recently used first), so that they never
    push out kept states. A slot is freed only when no sequence commits, keeps or writes it and
    `shared` no longer holds it.
  * `release(seq, share_as=None)` frees every slot of a sequence but a shared one;
    `slots_per_sequence(num_tokens)` and `bytes_per_slot` size the memory (docs/DESIGN.md, "Hybrid
    targets").
May import: numpy, openvino, `.inference`.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import openvino as ov

from .inference import grow_rows

TABLE_PREFIXES = ("conv_state_table.", "gated_delta_state_table.")
# the longest call that keeps a state per token; longer calls (prefills) must be committed whole
MAX_CHECKPOINTS = 16


def state_table_inputs(compiled: ov.CompiledModel) -> list:
    """(name, element type, per-slot shape) of every linear-attention state table input."""
    return [(i.get_any_name(), i.get_element_type(), [d.get_length() for d in i.get_partial_shape()[1:]])
            for i in compiled.inputs if i.get_any_name().startswith(TABLE_PREFIXES)]


class LinearStateSlots:
    """The state tables and their slots (module contract)."""

    def __init__(self, compiled: ov.CompiledModel, initial_slots: int = 8, max_checkpoints: int = MAX_CHECKPOINTS):
        self.table_inputs = state_table_inputs(compiled)
        if not self.table_inputs:
            raise ValueError("this target has no linear-attention state tables")
        self.max_checkpoints = max_checkpoints
        self.checkpoint_every: int | None = None  # keep the state at every multiple of this many tokens
        self.bytes_per_slot = sum(int(np.prod(shape)) * t.size for _, t, shape in self.table_inputs)
        self.tables: dict[str, ov.Tensor] = {}
        self.requests: list[ov.InferRequest] = []
        self.num_slots = 0
        self.free: list[int] = []
        self.committed: dict = {}  # seq -> slot
        self.written: dict = {}  # seq -> (slots its last call writes, past, tokens, interval)
        self.kept_at: dict = {}  # seq -> {position: slot} states kept at multiples of checkpoint_every
        self.shared: OrderedDict = OrderedDict()  # key -> slot, states any sequence may start from; oldest first
        self.turns: OrderedDict = OrderedDict()  # keys of `shared` kept for a conversation's next turn; oldest first
        self.max_shared = 0  # kept states (share) at most, and as many turn states (share_committed, release)
        self._grow(initial_slots)

    def bind(self, *requests) -> None:
        """Bind the tables to these requests (and to every request after a growth)."""
        self.requests += [r for r in requests if r is not None]
        for request in self.requests:
            for name, tensor in self.tables.items():
                request.set_tensor(name, tensor)

    def _grow(self, num_slots: int) -> None:
        grow_rows(self.tables, self.table_inputs, self.num_slots, num_slots)
        self.free += range(self.num_slots, num_slots)
        self.num_slots = num_slots
        self.bind()

    def _take(self) -> int:
        if not self.free:
            self._grow(2 * self.num_slots)
        return self.free.pop()

    def _drop(self, slots) -> None:
        """Free those of slots that nothing holds any more (module contract)."""
        held = {*self.committed.values(), *self.shared.values()}
        held.update(slot for kept in self.kept_at.values() for slot in kept.values())
        held.update(slot for written, *_ in self.written.values() for slot in written)
        self.free += [slot for slot in dict.fromkeys(slots) if slot not in held]

    def slots_per_sequence(self, num_tokens: int) -> int:
        """Slots a sequence holds during a call of num_tokens tokens (its committed one and those written)."""
        return 1 + (num_tokens if num_tokens <= self.max_checkpoints else 1)

    def _interval(self, past: int, num: int) -> int:
        if num <= self.max_checkpoints:
            return 1
        every = self.checkpoint_every
        # the conv kernel counts from the call's first token: only calls that start on a multiple keep them
        return every if every and past % every == 0 else 0

    def inputs(self, calls) -> dict[str, np.ndarray]:
        """The la.* inputs of one call (module contract)."""
        tables, begins, past_lens, intervals = [], [0], [], []
        for seq, past, num in calls:
            if seq in self.written:
                raise RuntimeError(f"sequence {seq!r}: commit() its previous call first")
            if seq not in self.committed:
                slot = self._take()
                for tensor in self.tables.values():
                    tensor.data[slot] = 0
                self.committed[seq] = slot
            interval = self._interval(past, num)
            count = 1 + (num - 1) // interval if interval else 1  # past % interval == 0 here
            written = [self._take() for _ in range(count)]
            self.written[seq] = (written, past, num, interval)
            tables += [self.committed[seq], *written]
            begins.append(len(tables))
            past_lens.append(past)
            intervals.append(interval)
        return {"la.block_indices": np.array(tables, dtype=np.int32),
                "la.block_indices_begins": np.array(begins, dtype=np.int32),
                "la.past_lens": np.array(past_lens, dtype=np.int32),
                "la.cache_interval": np.array(intervals, dtype=np.int32)}

    def commit(self, seq, num_kept: int) -> None:
        written, past, num, interval = self.written.pop(seq)
        if interval == 1:
            states = {past + t: slot for t, slot in enumerate(written[:num_kept], 1)}
        elif num_kept == num:  # slot k holds the state after token k * interval, the last one after all
            states = {past + min((k + 1) * interval if interval else num, num): slot for k, slot in enumerate(written)}
        else:
            self._drop(written)
            raise ValueError(f"a call of {num} tokens keeps only its final linear-attention state: it cannot "
                             f"commit {num_kept} of them (calls of up to {self.max_checkpoints} tokens can)")
        old = self.committed[seq]
        self.committed[seq] = states[past + num_kept]
        if self.checkpoint_every:
            kept = self.kept_at.setdefault(seq, {})
            kept.update((pos, slot) for pos, slot in states.items() if pos % self.checkpoint_every == 0)
        self._drop([old, *written])

    def rewind_floor(self, seq, length: int) -> int:
        """The longest length <= `length` this sequence can go back to exactly: a kept state's, else 0."""
        return max((pos for pos in self.kept_at.get(seq, {}) if pos <= length), default=0)

    def rewind(self, seq, length: int) -> None:
        """Make the state kept at `length` (a `rewind_floor` result > 0) the committed one."""
        kept = self.kept_at.get(seq, {})
        old = self.committed[seq]
        self.committed[seq] = kept[length]
        dropped = [kept.pop(pos) for pos in [p for p in kept if p > length]]
        self._drop([old, *dropped])

    def share(self, seq, position: int, key) -> None:
        """Move the state this sequence kept at position into `shared` under key (module contract);
        key None drops it."""
        self._drop(self._share_slot(self.kept_at[seq].pop(position), key))

    def share_committed(self, seq, key) -> None:
        """Share this sequence's committed state under key as a turn state; it goes on reading it in place."""
        self._drop(self._share_slot(self.committed[seq], key, turn=True))

    def _share_slot(self, slot: int, key, turn: bool = False) -> list[int]:
        """Put slot into `shared` under key (None: not at all; a key shared already keeps its first slot),
        the least recently used of its kind beyond `max_shared` out; returns the slots let go, for `_drop`."""
        if key is None:
            return [slot]
        if key in self.shared:  # another sequence shared the same prefix first: keep that one
            self._used(key)
            return [slot]
        self.shared[key] = slot
        if turn:
            self.turns[key] = None
        evicted = []
        while len(self.turns) > self.max_shared:
            evicted.append(self.shared.pop(self.turns.popitem(last=False)[0]))
        while len(self.shared) - len(self.turns) > self.max_shared:
            evicted.append(self.shared.pop(next(k for k in self.shared if k not in self.turns)))
        return evicted

    def _used(self, key) -> None:
        self.shared.move_to_end(key)
        if key in self.turns:
            self.turns.move_to_end(key)

    def adopt(self, seq, key) -> None:
        """Start a new sequence from the shared state under key: its committed state, read in place."""
        if seq in self.committed:
            raise RuntimeError(f"sequence {seq!r} already has a state")
        self._used(key)
        self.committed[seq] = self.shared[key]

    def release(self, seq, share_as=None) -> None:
        """Free every slot of the sequence; with `share_as`, its committed state goes to `shared` under it."""
        written = self.written.pop(seq, ((),))[0]
        slots = [*written, *self.kept_at.pop(seq, {}).values()]
        if seq in self.committed:
            slots += self._share_slot(self.committed.pop(seq), share_as, turn=True)
        self._drop(slots)
