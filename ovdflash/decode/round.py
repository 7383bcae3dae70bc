"""One sequence's speculative round, written once for both executors: `sequence` (one sequence on
its own runners) and `scheduler` (many sequences, one target call per round).

Contract:
- A round verifies `verify_ids(last, drafts)` = `[last, *drafts]` at positions `start..start+len(drafts)`,
  `start` being the target's committed tokens and `last` the newest token (sampled, no KV yet). The
  executor runs the target and commits `1 + accepted` of those tokens; `SequenceState` does the rest:
  - `begin(prompt, logits_row, feats, kept_feats)` after the prefill: the first token (position
    len(prompt)), the drafter's context (`kept_feats`, features a prefix cache kept, then the prefill's).
  - `room(committed, max_length)`: tokens the round may verify, at most `block_size`, never past
    max_new_tokens nor the context end.
  - `choose_drafts(start, max_drafts)`: n-gram lookup's drafts, else the drafter's (its call consumes
    the features it has not seen; a lookup round leaves them for its next call), else none (an AR step).
  - `accept(drafts, logits, feats, start, from_lookup)`: `accept_block`, then `last` is the target's
    token, the lookup has the round's text and the stats its round (or AR step); returns the accepted drafts.
  - `events(accepted, context_full)`: the round's tokens (accepted drafts, then `last`) as TokenEvents
    with the stop rules: EOS ("stop", the EOS token yielded), exactly max_new_tokens ("length"),
    the context full after the round ("context"); the last event carries the reason and sets `done`.
    Lazy: a consumer that stops early (a stop string) counts no event it did not take.
- `accept_block` samples row i of the verified block at position start+1+i from the sequence's
  `PositionRandomness` (`sampling.accept_at_positions`): a zero-draft block is an AR step, so every
  block size, lookup or not, gives the AR tokens. The drafter's context gets the kept tokens' features.
- `check_prompt`, `check_count`: the input rules both executors share (an empty prompt or one that
  leaves no room for a new token; max_new_tokens and block_size integers >= 1).
- `DrafterRunner`: the drafter interface both executors drive.
May import: numpy and decode/ only; no clock either (the executors time their calls).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

import numpy as np

from .lookup import NgramLookup
from .sampling import PositionRandomness, SamplingParams, accept_at_positions, sample_token
from .stats import GenerationStats

NO_DRAFTS = np.zeros(0, dtype=np.int64)


class DrafterRunner(Protocol):
    """Holds the drafter's context cache. `propose(last, ctx_feats, start, num_drafts)` adds the
    features of positions `start-len(ctx_feats)..start-1` to its context and returns `num_drafts`
    argmax proposals for positions `start+1..`."""

    block_size: int   # the block it was trained with (drafts per round = block_size - 1)
    context_len: int  # positions whose features its context holds (0 after reset)

    def reset(self) -> None: ...
    def propose(self, last: int, ctx_feats: np.ndarray, start: int, num_drafts: int) -> np.ndarray: ...
    def rewind(self, num_kept: int) -> None: ...  # keep the first num_kept context positions (prefix reuse)


@dataclass(frozen=True)
class TokenEvent:
    token: int
    from_draft: bool
    finish_reason: str | None = None  # set on the last event only


class PromptTooLongError(ValueError):
    pass


def check_prompt(prompt_ids: Sequence[int], max_length: int) -> np.ndarray:
    """The prompt as int64 ids; it must hold a token and leave room for one new token."""
    prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    if len(prompt) == 0:
        raise ValueError("empty prompt")
    if len(prompt) >= max_length:
        raise PromptTooLongError(f"prompt has {len(prompt)} tokens; the model's context limit is "
                                 f"{max_length} (prompt + at least 1 new token must fit)")
    return prompt


def check_count(name: str, value) -> int:
    """`value` as an int: a bool, a non-integer or a value below 1 is a ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def verify_ids(last: int, drafts: np.ndarray) -> np.ndarray:
    return np.concatenate(([last], drafts)).astype(np.int64)


def accept_block(drafts: np.ndarray, logits: np.ndarray, feats: np.ndarray, ctx_feats: np.ndarray,
                 params: SamplingParams, randomness: PositionRandomness, start: int, feeds_drafter: bool
                 ) -> tuple[int, int, np.ndarray]:
    """(accepted drafts, next token, drafter context) of a verified `[last, *drafts]`; row i of
    `logits` scores position start+1+i."""
    num_accepted, next_token = accept_at_positions(drafts, logits, params, randomness, start + 1)
    if feeds_drafter:  # a copy: the runner's arrays are views that die at its next call
        ctx_feats = np.concatenate([ctx_feats, feats[: num_accepted + 1]])
    return num_accepted, int(next_token), ctx_feats


@dataclass
class SequenceState:
    """One sequence between rounds (module contract)."""

    params: SamplingParams
    max_new_tokens: int
    eos: frozenset[int]
    stats: GenerationStats
    block_size: int = 1  # tokens a round verifies at most: last + drafts
    drafter: DrafterRunner | None = None
    lookup: NgramLookup | None = None
    last: int = -1  # the newest token: sampled, no KV yet
    ctx_feats: np.ndarray | None = None  # target features the drafter has not consumed yet
    num_out: int = 0
    done: bool = False  # the last event went out

    def __post_init__(self):
        self.randomness = self.params.make_randomness()  # per absolute position: seeded replies equal AR's

    def begin(self, prompt: np.ndarray, logits_row: np.ndarray, feats: np.ndarray,
              kept_feats: np.ndarray | None = None) -> None:
        self.last = sample_token(logits_row, self.params, self.randomness.at(len(prompt)))
        self.ctx_feats = np.array(feats) if kept_feats is None else np.concatenate([kept_feats, feats])
        if self.lookup is not None:
            self.lookup.reset(np.append(prompt, self.last))

    def room(self, committed: int, max_length: int) -> int:
        # the sequence so far is committed + 1 tokens: no round verifies past the context or max_new_tokens
        return min(self.block_size, self.max_new_tokens - self.num_out, max_length - 1 - committed)

    def choose_drafts(self, start: int, max_drafts: int) -> tuple[np.ndarray, bool]:
        """(drafts, whether lookup's): lookup's, else the drafter's, else none."""
        if self.drafter is None or max_drafts < 1:
            return NO_DRAFTS, False
        found = self.lookup.propose(max_drafts) if self.lookup is not None else None
        if found is not None:  # a match near the end may offer fewer tokens
            return found, True
        drafts = np.asarray(self.drafter.propose(self.last, self.ctx_feats, start, max_drafts), dtype=np.int64)
        self.ctx_feats = self.ctx_feats[:0]
        return drafts, False

    def accept(self, drafts: np.ndarray, logits: np.ndarray, feats: np.ndarray, start: int,
               from_lookup: bool) -> list[int]:
        num_accepted, self.last, self.ctx_feats = accept_block(
            drafts, logits, feats, self.ctx_feats, self.params, self.randomness, start, self.drafter is not None)
        accepted = [int(d) for d in drafts[:num_accepted]]
        if len(drafts):
            self.stats.record_round(len(drafts), num_accepted, from_lookup=from_lookup)
        else:
            self.stats.num_ar_steps += 1
        if self.lookup is not None:
            self.lookup.extend(accepted + [self.last])
        return accepted

    def events(self, accepted: list[int], context_full: bool) -> Iterator[TokenEvent]:
        tokens = [(t, True) for t in accepted] + [(self.last, False)]
        for i, (token, from_draft) in enumerate(tokens):
            self.num_out += 1
            self.stats.num_output_tokens += 1
            reason = ("stop" if token in self.eos else "length" if self.num_out == self.max_new_tokens
                      else "context" if context_full and i == len(tokens) - 1 else None)
            self.done = reason is not None
            yield TokenEvent(token, from_draft, reason)
            if self.done:
                return
