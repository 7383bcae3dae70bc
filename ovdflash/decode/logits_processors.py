"""Penalties and logit bias: the one place a target row becomes the row a token is chosen from (pure numpy).

Contract:
- `check_processing(presence_penalty, frequency_penalty, repetition_penalty, logit_bias)` validates
  the four settings (OpenAI's ranges: penalties in -2..2, repetition_penalty > 0, bias values in
  -100..100 on integer token ids >= 0) and returns the bias as a sorted tuple of (token id, bias);
  a bad value is a one-line ValueError naming the setting.
- `process_row(row, params, prompt, output)`: the row [V] as float64 after, in vLLM's order,
  `logit_bias` (added), `repetition_penalty` (HF/vLLM: over prompt + output tokens, a positive logit
  divided by it, a negative one multiplied), then `frequency_penalty` (times each token's count in
  the output) and `presence_penalty` (once per token present in the output), both subtracted and
  over the output only (OpenAI/vLLM). A bias on a token id >= V is a ValueError.
- `ProcessedRows(logits, params, prompt, output, drafts)`: the rows of one verified block
  `[last, *drafts]` as the sampler sees them: row i is `process_row` of the target's row i with the
  output so far followed by `drafts[:i]`, so a verified position sees exactly the tokens an AR step
  at that position would. Rows are made when first read and kept (acceptance stops at the first
  miss; logprobs read the same rows again). `params` is anything with the four settings
  (`sampling.SamplingParams`); with none active, executors pass the target's rows as they are.
May import: numpy only.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

PENALTY_RANGE = (-2.0, 2.0)
BIAS_RANGE = (-100.0, 100.0)


def _number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) \
        and math.isfinite(value)


def check_processing(presence_penalty, frequency_penalty, repetition_penalty, logit_bias
                     ) -> tuple[tuple[int, float], ...]:
    """The settings checked (module contract); returns logit_bias as sorted (token id, bias) pairs."""
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not _number(value) or not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
            raise ValueError(f"{name} must be a number in -2..2, got {value!r}")
    if not _number(repetition_penalty) or repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be a number > 0, got {repetition_penalty!r}")
    if logit_bias is None:
        return ()
    items = logit_bias.items() if isinstance(logit_bias, Mapping) else logit_bias
    pairs = {}
    for token, bias in items:
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if not _number(bias) or not BIAS_RANGE[0] <= bias <= BIAS_RANGE[1]:
            raise ValueError(f"logit_bias[{int(token)}] must be a number in -100..100, got {bias!r}")
        pairs[int(token)] = float(bias)
    return tuple(sorted(pairs.items()))


def processes_logits(params) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1
                or params.logit_bias)


def process_row(row: np.ndarray, params, prompt: Sequence[int], output: Sequence[int]) -> np.ndarray:
    """The row a token is chosen from (module contract)."""
    x = np.array(row, dtype=np.float64)
    vocab = len(x)
    if params.logit_bias:
        ids = np.fromiter((t for t, _ in params.logit_bias), dtype=np.int64)
        if ids[-1] >= vocab:
            raise ValueError(f"logit_bias names token id {int(ids[-1])}; the vocabulary has {vocab} tokens")
        x[ids] += np.fromiter((b for _, b in params.logit_bias), dtype=np.float64)
    out = np.asarray(output, dtype=np.int64)
    if params.repetition_penalty != 1:
        seen = np.zeros(vocab, dtype=bool)
        seen[np.asarray(prompt, dtype=np.int64)] = True
        seen[out] = True
        x = np.where(seen, np.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty), x)
    if params.frequency_penalty or params.presence_penalty:
        counts = np.bincount(out, minlength=vocab)[:vocab]
        x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return x


class ProcessedRows:
    """The rows of one verified block as the sampler sees them (module contract)."""

    def __init__(self, logits: np.ndarray, params, prompt: Sequence[int], output: Sequence[int],
                 drafts: Sequence[int] = ()):
        self.logits, self.params, self.prompt = logits, params, prompt
        self.output, self.drafts = list(output), [int(d) for d in drafts]
        self._rows: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.logits)

    def __getitem__(self, i: int) -> np.ndarray:
        if i not in self._rows:  # row i sees the output so far, then the drafts before it
            self._rows[i] = process_row(self.logits[i], self.params, self.prompt, self.output + self.drafts[:i])
        return self._rows[i]
