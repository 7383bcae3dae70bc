"""Prefix reuse across calls for the single-sequence runners: a new prompt prefills only what the
target's KV cache does not already hold.

Contract:
- `PrefixCache(target, drafter=None)` remembers, between calls, the token ids whose KV `target`
  holds (`tokens`: a prompt and the committed output, the last sampled token excluded since it has
  no KV yet) and the target features the drafter has not consumed yet (`feats`, for positions
  `drafter.context_len .. drafter.context_len + len(feats) - 1`; the drafter's state holds the
  positions before them). `sequence.generate(..., prefix_cache=)` drives it: `restore` before the
  prefill, `begin` before and `record` after every round.
- `restore(prompt, drafting, reuse=True) -> (num_cached, kept_feats)`: the longest common prefix of `prompt`
  and `tokens`, at most len(prompt) - 1 (the last prompt token is always prefilled: its logits
  sample the first new token), also at most the positions the drafter's context covers when
  `drafting`. The target is rewound to it (`rewind`), the drafter to the same length (its own
  `rewind`, or `feats` cut), so both hold exactly the first num_cached prompt tokens, as a fresh
  prefill of them would. kept_feats (drafting only) are the features of positions
  `drafter.context_len .. num_cached - 1`, to go in front of the prefill's. Nothing reused (0):
  both runners are reset. A target whose `rewinds_exactly` is False (a hybrid one) is cut back
  only to a length its `rewind_floor` offers (the paged hybrid runner keeps linear-attention
  states at fixed positions), else reused only when the prompt extends all of `tokens`. The
  runners' `pending`, `rewinds_exactly`, `rewind_floor`, `rewind` and `context_len` are declared by
  sequence.TargetRunner and round.DrafterRunner.
- Never wrong: `tokens` are compared id by id; a call broken off inside a round (an exception in
  the runners) leaves the cache invalid until the next `record`, so the next call starts afresh;
  so does any mismatch between the runners' lengths and what the cache recorded (a runner used
  or reset elsewhere), and `invalidate()` forgets everything explicitly.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differs = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(differs[0]) if len(differs) else n


class PrefixCache:
    def __init__(self, target, drafter=None):
        self.target = target
        self.drafter = drafter
        self.invalidate()

    def invalidate(self) -> None:
        self.tokens: list[int] = []
        self.feats: np.ndarray | None = None
        self.valid = False

    def _num_feats(self) -> int:
        return 0 if self.feats is None else len(self.feats)

    def drafter_covered(self) -> int:
        """Positions whose features the drafter holds or has pending."""
        return self.drafter.context_len + self._num_feats() if self.drafter is not None else 0

    def _in_sync(self) -> bool:
        return (self.valid and self.target.pending == 0 and self.target.committed == len(self.tokens)
                and self.drafter_covered() <= len(self.tokens))

    def restore(self, prompt: Sequence[int], drafting: bool, reuse: bool = True) -> tuple[int, np.ndarray | None]:
        """Rewind the runners to the reusable prefix of `prompt` (module contract); with
        reuse=False, reset them (the call is still recorded, for the next one)."""
        num_cached = 0
        if reuse and self._in_sync():
            num_cached = common_prefix_length(self.tokens, prompt[: len(prompt) - 1])
            if drafting:
                num_cached = min(num_cached, self.drafter_covered())
            if num_cached < len(self.tokens) and not self.target.rewinds_exactly:
                floor = getattr(self.target, "rewind_floor", None)
                num_cached = floor(num_cached) if floor is not None else 0
        self.valid = False  # until the prefill is recorded
        if num_cached == 0:
            self.target.reset()
            if self.drafter is not None:
                self.drafter.reset()
            self.tokens, self.feats = [], None
            return 0, None
        if num_cached < len(self.tokens):
            self.target.rewind(num_cached)
            del self.tokens[num_cached:]
        if self.drafter is not None:
            kept = min(num_cached, self.drafter_covered())
            if kept < self.drafter.context_len:
                self.drafter.rewind(kept)
                self.feats = None
            elif self.feats is not None:
                self.feats = self.feats[: kept - self.drafter.context_len]
        return num_cached, (self.feats if drafting else None)

    def begin(self) -> None:
        """The runners are about to change: invalid until `record`."""
        self.valid = False

    def record(self, new_tokens: Sequence[int], ctx_feats: np.ndarray | None) -> None:
        """`new_tokens` now have KV in the target; `ctx_feats` (None: the drafter was not in use)
        are the features its drafter has not consumed."""
        self.tokens.extend(int(t) for t in new_tokens)
        if ctx_feats is not None:
            self.feats = ctx_feats
        self.valid = self.target.committed == len(self.tokens)
