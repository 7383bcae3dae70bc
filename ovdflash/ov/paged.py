"""The paged target's KV cache and inference (`PagedKV`), and its single-sequence runner (`OVPagedTarget`).

Contract:
- `PagedKV(compiled, max_length, wide=None, wide_from=WIDE_FROM)` is what every runner of a target
  compiled after openvino's paged-attention transformation shares; it keeps no sequence (which
  blocks a sequence writes is its subclass's):
  * the cache inputs: `cache_inputs` (name, element type, per-block shape of every key_cache.* /
    value_cache.* input; none is a ValueError, `no_cache_inputs`), `block_tokens`, `bytes_per_block`;
  * the host KV tensors `caches` (`[blocks, kv_heads, block_tokens, head_dim]` per input, shape and
    element type as the plugin asks: f16/f32, or u8 with its scales), bound to every request and
    grown by doubling (`fit_blocks`: the used blocks are copied once per growth; `num_blocks`,
    `num_cache_grows`);
  * the requests: `request`, and `wide_request` on `wide`, the target's f32-weight copy, for calls of
    `wide_from` tokens or more (`request_for`, `num_wide_calls`, `last_request`, `drop_wide`;
    `wide_compiled`, `wide_xml` for ovdflash.ov.memory; `attach_wide` adds a copy compiled after
    the target); `renew_narrow(compiled)` moves the narrow request onto a fresh compile of the same
    target;
  * `run_flat(...)`: one inference of a flattened call (the tokens of every sequence one after
    another, with the paged inputs that place them) through `run_request`, and `outputs()`: the
    logits and features it left in `last_request`.
- `OVPagedTarget` implements decode's `TargetRunner` on it for one sequence in blocks 0, 1, 2, ...
  in order: `past_lens` = committed tokens, so a rollback is `commit(k)` alone and the next forward
  overwrites the rejected slots. `calibrate_wide()` times the f32-weight copy on this host; then
  `recompile_narrow()` (with `narrow_compiler` set) renews the narrow target, whose wide-size
  calls in the calibration left kernels and repacked weights resident that it never uses again;
  `use_wide_from(n)` applies a stored result instead, and `warm_calls()` runs each calibration
  size once on the request that serves it.
May import: numpy, openvino, `.inference` and `.linear_states`; `runners` and `paged_batch` build on this module.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import openvino as ov

from .inference import LogitRows, grow_rows, run_request
from .linear_states import LinearStateSlots, state_table_inputs

# calls of this many tokens or more run on the paged target's f32-weight copy until calibrate_wide measures
WIDE_FROM = 5
CALIBRATION_SIZES = (2, 4, 5, 6, 8, 12, 16, 32)  # the call sizes calibrate_wide times


def paged_cache_inputs(compiled: ov.CompiledModel) -> list:
    """(name, element type, per-block shape) of every key_cache.* / value_cache.* input of a paged target."""
    return [(i.get_any_name(), i.get_element_type(), [d.get_length() for d in i.get_partial_shape()[1:]])
            for i in compiled.inputs if i.get_any_name().startswith(("key_cache.", "value_cache."))]


def block_tokens_of(cache_inputs) -> int:
    """Tokens per block: dim 2 of a value cache (a u8 key cache adds rows of scales to that dim)."""
    return next(shape[1] for name, _, shape in cache_inputs if name.startswith("value_cache."))


def bytes_per_block(cache_inputs) -> int:
    """Bytes one KV block takes across every key/value cache input."""
    return sum(int(np.prod(shape)) * element_type.size for _, element_type, shape in cache_inputs)


def wide_request_of(wide: ov.CompiledModel | None, cache_inputs: list) -> ov.InferRequest | None:
    """An InferRequest of a paged target's f32-weight copy, which must take the same KV cache inputs."""
    if wide is None:
        return None
    if paged_cache_inputs(wide) != cache_inputs:
        raise ValueError("the wide target's KV cache inputs differ from the target's")
    return wide.create_infer_request()


def checkpoint_interval(bytes_per_slot: int, bytes_per_block: int, block_tokens: int) -> int:
    """Tokens between kept linear-attention states of one sequence: whole KV blocks, so that the kept
    states take at most about the memory of the KV cache they sit beside."""
    blocks = max(1, -(-bytes_per_slot // bytes_per_block))
    return blocks * block_tokens


class PagedKV:
    """The KV tensors, requests and flattened inference of a paged target (module contract)."""

    # the ValueError of a compiled model without cache inputs (each runner says what to use instead)
    no_cache_inputs = "this target has no key_cache.* inputs: it needs openvino's paged-attention transformation"

    def __init__(self, compiled: ov.CompiledModel, max_length: int, wide: ov.CompiledModel | None = None,
                 wide_from: int = WIDE_FROM):
        self.compiled = compiled
        self.max_length = max_length
        self.cache_inputs = paged_cache_inputs(compiled)
        if not self.cache_inputs:
            raise ValueError(self.no_cache_inputs)
        self.block_tokens = block_tokens_of(self.cache_inputs)
        self.bytes_per_block = bytes_per_block(self.cache_inputs)
        self.request = compiled.create_infer_request()
        self.wide_compiled = self.wide_request = None
        self.wide_from = wide_from
        self.wide_xml: Path | None = None  # the copy's IR file, for ovdflash.ov.memory
        self.num_wide_calls = 0
        self.last_request = self.request  # the request of the latest call: its outputs
        self.positions = np.arange(max_length + 1, dtype=np.int64)
        self.max_context_len = np.zeros((), dtype=np.int32)
        self.caches: dict[str, ov.Tensor] = {}
        self.num_blocks = 0  # allocated in the host tensors
        self.num_cache_grows = 0
        # a hybrid target's linear-attention states: per-sequence slots beside the KV blocks
        self.linear = LinearStateSlots(compiled) if state_table_inputs(compiled) else None
        if self.linear is not None:
            self.linear.bind(self.request)
        if wide is not None:
            self.attach_wide(wide)

    def attach_wide(self, wide: ov.CompiledModel) -> None:
        """Run calls of `wide_from` tokens or more on `wide`, the target's f32-weight copy, from now on."""
        if self.linear is not None and state_table_inputs(wide) != self.linear.table_inputs:
            raise ValueError("the wide target's linear-attention state tables differ from the target's")
        self.wide_compiled, self.wide_request = wide, wide_request_of(wide, self.cache_inputs)
        self._bind_caches(self.wide_request)
        if self.linear is not None:
            self.linear.bind(self.wide_request)

    def _bind_caches(self, *requests) -> None:
        for request in requests:
            if request is not None:
                for name, tensor in self.caches.items():
                    request.set_tensor(name, tensor)

    def _grow(self, num_blocks: int) -> None:
        grow_rows(self.caches, self.cache_inputs, self.num_blocks, num_blocks)
        self._bind_caches(self.request, self.wide_request)
        self.num_blocks = num_blocks
        self.num_cache_grows += 1

    def fit_blocks(self, needed: int, limit: int) -> int:
        """Grow the host tensors to hold `needed` blocks: to twice their blocks at least, `limit` at
        most. Returns the blocks they hold."""
        if needed > self.num_blocks:
            self._grow(min(max(needed, 2 * self.num_blocks), limit))
        return self.num_blocks

    def request_for(self, num_tokens: int) -> ov.InferRequest:
        """The request a call of num_tokens tokens runs on (the wide one from `wide_from` tokens)."""
        wide = self.wide_request is not None and num_tokens >= self.wide_from
        self.num_wide_calls += wide
        self.last_request = self.wide_request if wide else self.request
        return self.last_request

    def renew_narrow(self, compiled: ov.CompiledModel) -> None:
        """Run narrow calls on `compiled` (the same target compiled again); the old compile goes with
        its last reference."""
        old = self.request
        self.compiled, self.request = compiled, compiled.create_infer_request()
        self._bind_caches(self.request)
        if self.linear is not None:
            self.linear.requests = [r for r in self.linear.requests if r is not old]
            self.linear.bind(self.request)
        self.last_request = self.request

    def recompile_narrow(self) -> bool:
        """After calibrate_wide kept the copy: a fresh narrow compile that has run only narrow calls.
        Returns whether it renewed; the compiler is dropped either way."""
        compiler, self.narrow_compiler = self.narrow_compiler, None
        if compiler is None or self.wide_request is None:
            return False
        self.renew_narrow(compiler())
        return True

    def drop_wide(self) -> None:
        """Forget the f32-weight copy (its memory goes with the last reference)."""
        self.wide_compiled = self.wide_request = self.wide_xml = None
        self.last_request = self.request

    def run_flat(self, input_ids, position_ids: np.ndarray, past_lens: np.ndarray, subsequence_begins: np.ndarray,
                 block_indices_begins: np.ndarray, block_indices: np.ndarray, max_context_len: int,
                 logits_indices: np.ndarray, linear_calls=None) -> None:
        """One inference of the tokens of every sequence one after another (input_ids, position_ids):
        per sequence its committed tokens (past_lens), where its tokens and its block table begin
        (subsequence_begins, block_indices_begins: one entry more than sequences, the last the totals),
        the block tables one after another (block_indices), the longest context (max_context_len), and
        the rows to score (logits_indices, into input_ids). Runs on `request_for(len(input_ids))`.
        A hybrid target also takes `linear_calls` = [(seq, past, num_tokens)] in the same order
        (`LinearStateSlots.inputs`)."""
        input_ids = np.ascontiguousarray(input_ids, dtype=np.int64).reshape(-1)
        self.max_context_len[...] = max_context_len
        linear = self.linear.inputs(linear_calls) if self.linear is not None else {}
        run_request(self.request_for(len(input_ids)), {
            **linear,
            "input_ids": input_ids,
            "position_ids": position_ids,
            "past_lens": past_lens,
            "subsequence_begins": subsequence_begins,
            "block_indices_begins": block_indices_begins,
            "block_indices": block_indices,
            "max_context_len": self.max_context_len,
            "logits_indices": logits_indices,
        })

    def outputs(self) -> tuple[np.ndarray, np.ndarray]:
        """(logits[rows, V], features[tokens, H]) of the latest call: views, valid until the next call."""
        out = self.last_request
        return out.get_tensor("logits").data[:, 0], out.get_tensor("target_hidden").data[:, 0]


class OVPagedTarget(LogitRows, PagedKV):
    """decode.sequence.TargetRunner on the target after openvino's paged-attention transformation
    (`compile_runners(..., target_runner="paged")`), the attention openvino.genai runs.

    The KV cache (`PagedKV`) holds one sequence in blocks 0, 1, 2, ... in order. A forward writes
    its T tokens at slots committed..committed+T-1 and attends to them and the committed ones
    (`past_lens`). Rollback is free and exact: `commit(k)` keeps k of them, and the next forward
    overwrites the rest, so there is no mask, no garbage and no compaction. The cache grows by
    doubling its blocks (one copy of the used blocks each time).

    `wide` (optional): the same target compiled with f32 weights (`graphs.with_f32_weights`), for
    calls of `wide_from` tokens or more. With f16 weights the CPU plugin decompresses every weight
    again in each call of more than a few rows, so such calls cost twice a narrow one; the f32 copy
    reads twice the bytes but computes many rows at once. Both requests share the cache tensors.
    `calibrate_wide()` sets `wide_from` from timings on this host (or drops the copy)."""

    kind = "paged"  # one of ovdflash.TARGET_RUNNERS
    rewinds_exactly = True  # `rewind` to any committed length (the next forward overwrites the rest)
    pending = 0  # tokens of the last forward not yet committed
    num_compactions = 0  # decode.sequence.TargetRunner: never compacts
    no_cache_inputs = ("the paged-attention transformation left this target without key_cache.* inputs "
                       "(an attention pattern openvino does not convert): use target_runner='stateful'")

    def __init__(self, compiled: ov.CompiledModel, max_length: int, initial_blocks: int = 16,
                 wide: ov.CompiledModel | None = None, wide_from: int = WIDE_FROM):
        super().__init__(compiled, max_length, wide, wide_from)
        self._bind_outputs(compiled)
        self.block_indices = np.arange(-(-(max_length + 1) // self.block_tokens), dtype=np.int32)
        # one sequence's paged inputs, reused by every call
        self.past_lens = np.zeros(1, dtype=np.int32)
        self.subsequence_begins = np.zeros(2, dtype=np.int32)
        self.block_indices_begins = np.zeros(2, dtype=np.int32)
        self._grow(initial_blocks)
        if self.linear is not None:  # a linear-attention state is kept only at fixed positions
            self.rewinds_exactly = False
            self.linear.checkpoint_every = checkpoint_interval(self.linear.bytes_per_slot,
                                                              self.bytes_per_block, self.block_tokens)
        self.reset()

    def _bind_outputs(self, compiled: ov.CompiledModel) -> None:
        names = {n for o in compiled.outputs for n in o.get_names()}
        # a graph scoring its next tokens itself (the feature pass's) has no logits output
        self.logits_out = compiled.output("logits") if "logits" in names else None
        self.hidden_out = compiled.output("target_hidden")

    def renew_narrow(self, compiled: ov.CompiledModel) -> None:
        super().renew_narrow(compiled)
        self._bind_outputs(compiled)  # ports keep their compiled model alive

    def calibrate_wide(self, sizes=CALIBRATION_SIZES, repetitions: int = 3,
                       context_tokens: int = 64, release_pages=None) -> int | None:
        """Time calls of each size on both requests (interleaved, medians, after a 64-token
        context) and use the wide one from the smallest size at which it is faster at that size
        and every larger one; drop it when it never is. Returns wide_from, or None.
        `release_pages()` runs after each untimed first call of a shape (the IR pages its repacking
        read are needed no more), so the load's peak holds one shape's pages, not every file's."""
        if self.wide_request is None:
            return None
        sizes = self.calibration_sizes(sizes)
        self._start_at_context(context_tokens, release_pages)
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
                    elif release_pages is not None:
                        release_pages()
                    self.commit(1)
        self.wide_from = kept
        self.reset()
        faster = [statistics.median(times[s, True]) < statistics.median(times[s, False]) for s in sizes]
        start = next((i for i in range(len(sizes)) if all(faster[i:])), None)
        self.use_wide_from(None if start is None else sizes[start])
        return None if start is None else self.wide_from

    def warm_calls(self, release_pages=None, context_tokens: int = 64) -> None:
        """Run each calibration size once on the request that serves it, as a calibration would have
        (the plugin builds a shape's kernels at its first call); `release_pages` as in calibrate_wide."""
        self._start_at_context(context_tokens, release_pages)
        for size in self.calibration_sizes():
            self.run(np.ones(size, dtype=np.int64), np.arange(size))
            self.commit(1)
            if release_pages is not None:
                release_pages()
        self.reset()

    def _start_at_context(self, context_tokens: int, release_pages=None) -> None:
        """A fresh sequence of context_tokens committed tokens, the calls calibrate_wide and warm_calls time from."""
        self.reset()
        self.run(np.ones(context_tokens, dtype=np.int64), np.array([context_tokens - 1]))
        self.commit(context_tokens)
        if release_pages is not None:
            release_pages()

    def calibration_sizes(self, sizes=CALIBRATION_SIZES) -> tuple[int, ...]:
        """The call sizes `calibrate_wide` times (a hybrid's are capped by its per-token states)."""
        if self.linear is not None:  # a partial commit needs a state per token
            return tuple(s for s in sizes if s <= self.linear.max_checkpoints)
        return tuple(sizes)

    def use_wide_from(self, wide_from: int | None) -> None:
        """Apply a calibration's result: the copy from `wide_from` tokens, or (None) no copy."""
        if wide_from is None:
            self.drop_wide()
        else:
            self.wide_from = int(wide_from)

    def reset(self) -> None:
        self.committed = 0  # tokens with KV in the cache, all of them valid
        self.pending = 0
        if self.linear is not None:
            self.linear.release(0)

    def forward(self, token_ids: np.ndarray, all_logits: bool) -> tuple[np.ndarray, np.ndarray]:
        self.run(token_ids, self._logit_rows(len(token_ids), all_logits))
        return self.outputs()

    def run(self, token_ids: np.ndarray, rows: np.ndarray) -> None:
        """The inference of `forward`, with logits (or the graph's own scores) for `rows`
        (indices into token_ids); the outputs are left in `last_request`."""
        assert self.pending == 0, "commit() the previous forward first"
        num = len(token_ids)
        past, end = self.committed, self.committed + num
        blocks = -(-end // self.block_tokens)
        self.fit_blocks(blocks, len(self.block_indices))
        self.past_lens[0] = past
        self.subsequence_begins[1] = num
        self.block_indices_begins[1] = blocks
        self.run_flat(token_ids, self.positions[past:end], self.past_lens, self.subsequence_begins,
                      self.block_indices_begins, self.block_indices[:blocks], end, rows, [(0, past, num)])
        self.pending = num

    def commit(self, num_kept: int) -> None:
        """Keep the first num_kept tokens of the last forward; the next forward overwrites the rest."""
        assert 0 < num_kept <= self.pending
        if self.linear is not None:
            self.linear.commit(0, num_kept)
        self.committed += num_kept
        self.pending = 0

    def rewind(self, num_kept: int) -> None:
        """Keep only the first num_kept committed tokens (free: the next forward overwrites the rest)."""
        assert self.pending == 0 and 0 <= num_kept <= self.committed
        if self.linear is not None and num_kept != self.committed:
            if num_kept == 0:
                self.reset()
            elif self.linear.rewind_floor(0, num_kept) != num_kept:
                raise ValueError(f"a hybrid target cannot rewind from {self.committed} to {num_kept} tokens: "
                                 f"it keeps linear-attention states every {self.linear.checkpoint_every} tokens")
            else:
                self.linear.rewind(0, num_kept)
        self.committed = num_kept

    def rewind_floor(self, num_kept: int) -> int:
        """The longest length <= num_kept that `rewind` accepts (all of them without linear-attention layers)."""
        if self.linear is None or num_kept >= self.committed:
            return num_kept
        return self.linear.rewind_floor(0, num_kept)
