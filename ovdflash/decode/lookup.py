"""N-gram lookup in the sequence so far: free drafts for text that repeats itself.

Contract:
- `NgramLookup(min_n, max_n)` indexes a growing token sequence (prompt + committed output).
  `reset(tokens)` starts a sequence, `extend(tokens)` appends to it, both O(new tokens).
- `propose(k)` finds the longest suffix of the sequence (max_n down to min_n tokens) that also
  ended earlier in it, and returns the (at most k) tokens that followed its most recent earlier
  occurrence, as int64; None when no suffix of min_n tokens or more occurred before.
- Pure bookkeeping: it never reads a model. Its proposals are verified like the drafter's, so
  output is unchanged (greedy: token-identical; sampled: exact rejection sampling with a one-hot
  proposal, sampling.accept_sampled).

Why: a DFlash drafter sees the target's features but has one layer; code and chat answers
repeat names, signatures and phrases of the prompt and of themselves, which a lookup copies
exactly. On the shipped SmolLM2 pair, replaying the target's greedy answers to the held-out
bench prompts (replayed: docs/log/2026-11-benchmarks.md, 2026-12-03), rounds that take a lookup proposal when one exists
and the drafter's otherwise keep 2.54 / 2.22 / 1.77 tokens (code / math / chat) at block 4,
against the drafter's 2.03 / 2.02 / 1.47, and lookup rounds skip the drafter's call.
"""
from __future__ import annotations

import numpy as np


class NgramLookup:
    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lookup needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.reset(())

    def reset(self, tokens) -> None:
        self.tokens: list[int] = []
        # n -> {n-gram: index of its last token, most recent occurrence}; an n-gram ending at
        # index i is entered only when token i+1 arrives, so a query on the current suffix never
        # finds the suffix itself and the continuation has at least one token.
        self.last_end: dict[int, dict[tuple, int]] = {n: {} for n in range(self.min_n, self.max_n + 1)}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        for t in tokens:
            end = len(self.tokens) - 1  # the previous last token: its n-grams are now "earlier"
            for n, index in self.last_end.items():
                if end - n + 1 >= 0:
                    index[tuple(self.tokens[end - n + 1:end + 1])] = end
            self.tokens.append(int(t))

    def propose(self, k: int) -> np.ndarray | None:
        if k < 1:
            return None
        size = len(self.tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            end = self.last_end[n].get(tuple(self.tokens[size - n:]))
            if end is not None:
                return np.array(self.tokens[end + 1:end + 1 + k], dtype=np.int64)
        return None
