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
    In steps, for an executor that calls many sequences' drafters at once: `planned_drafts(max_drafts)`
    (the drafts where no drafter call is needed, else None), `drafter_call(start, max_drafts)` (that
    call's `propose` arguments), `drafted(proposals, max_drafts)` (the drafts of its proposals).
    Where the drafter reports per-slot confidences and the state has a `draft_cut`
    (block_policy.BlockPolicy or block_policy.ConfidenceCut), only the first `draft_cut.cut(confidence)`
    drafts are verified (slots the grammar forces count as certain).
  - `accept(drafts, logits, feats, start, from_lookup)`: `accept_block`, then `last` is the target's
    token, the lookup has the round's text and the stats its round (or AR step); returns the accepted drafts.
  - `events(accepted, context_full)`: the round's tokens (accepted drafts, then `last`) as TokenEvents
    with the stop rules: EOS ("stop", the EOS token yielded), exactly max_new_tokens ("length"),
    the context full after the round ("context"); the last event carries the reason and sets `done`.
    Lazy: a consumer that stops early (a stop string) counts no event it did not take.
- Penalties and logit bias (`SamplingParams.processes_logits`): the first token and every verified
  row are chosen from `logits_processors.ProcessedRows` over the prompt and the output so far (row i
  also sees the drafts before it), as an AR step at that position would. With `params.logprobs`
  set, each event carries its `sampling.TokenLogprob` (`logprob`, from the same row it was drawn
  from); otherwise `logprob` is None and nothing is computed.
- Structured outputs (`grammar`, a `structured.GrammarState`): where the grammar forces the next tokens
  (`forced()`), they replace the drafter's first drafts; drafts the grammar forbids are cut before
  verification (`choose_drafts`); the first token and every verified row are chosen from the row masked
  by the grammar at that position (`structured.ConstrainedRows`, over the processed rows when penalties
  are on); after acceptance the grammar holds exactly the output. A token that completes the grammar
  ends the sequence there ("stop"), as EOS does.
- `accept_block` samples row i of the verified block at position start+1+i from the sequence's
  `PositionRandomness` (`sampling.accept_at_positions`): a zero-draft block is an AR step, so every
  block size, lookup or not, gives the AR tokens. The drafter's context gets the kept tokens' features
  (`SequenceState.ctx_feats`, kept as one part per round and joined when the drafter reads them).
- `check_prompt`, `check_count`: the input rules both executors share (an empty prompt or one that
  leaves no room for a new token; max_new_tokens and block_size integers >= 1).
- `DrafterRunner`: the drafter interface both executors drive.
May import: numpy and decode/ only; no clock either (the executors time their calls).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

import numpy as np

from .logits_processors import ProcessedRows
from .lookup import NgramLookup
from .sampling import PositionRandomness, SamplingParams, TokenLogprob, accept_at_positions, token_logprob
from .stats import GenerationStats
from .structured import GrammarState

NO_DRAFTS = np.zeros(0, dtype=np.int64)


class DrafterRunner(Protocol):
    """Holds the drafter's context cache. `propose(last, ctx_feats, start, num_drafts)` adds the
    features of positions `start-len(ctx_feats)..start-1` to its context and returns `num_drafts`
    argmax proposals for positions `start+1..`. A drafter may also have `confidence`: each slot's
    predicted conditional acceptance for its last proposal (None, or no attribute: none)."""

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
    logprob: TokenLogprob | None = None  # only when the sampling params ask for logprobs


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


def accept_block(drafts: np.ndarray, logits: np.ndarray, feats: np.ndarray, params: SamplingParams,
                 randomness: PositionRandomness, start: int, feeds_drafter: bool
                 ) -> tuple[int, int, np.ndarray | None]:
    """(accepted drafts, next token, the kept tokens' features for the drafter's context, None
    without a drafter) of a verified `[last, *drafts]`; row i of `logits` (the target's rows, or
    their `ProcessedRows`) scores position start+1+i; `feats` are the target's."""
    num_accepted, next_token = accept_at_positions(drafts, logits, params, randomness, start + 1)
    # a copy: the runner's arrays are views that die at its next call
    kept_feats = np.array(feats[: num_accepted + 1]) if feeds_drafter else None
    return num_accepted, int(next_token), kept_feats


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
    grammar: GrammarState | None = None  # structured outputs: the grammar every token is held to
    draft_cut: object | None = None  # shortens a proposal the drafter is unsure of: cut(confidence) -> drafts
    last: int = -1  # the newest token: sampled, no KV yet
    ctx_parts: list = field(default_factory=list)  # target features the drafter has not consumed yet, by round
    num_out: int = 0
    done: bool = False  # the last event went out

    def __post_init__(self):
        self.randomness = self.params.make_randomness()  # per absolute position: seeded replies equal AR's
        self.prompt: np.ndarray = NO_DRAFTS
        self.output: list[int] = []  # the tokens chosen so far, kept only for the penalties
        self.logprobs: list[TokenLogprob] = []  # the next events' logprobs, when asked for
        self.grammar_stop: int | None = None  # the round's tokens up to the one that completed the grammar

    @property
    def ctx_feats(self) -> np.ndarray | None:
        """The features the drafter has not consumed yet, as one array: joined when read, since
        joining every round copied the whole context once per AR step."""
        if len(self.ctx_parts) > 1:
            self.ctx_parts = [np.concatenate(self.ctx_parts)]
        return self.ctx_parts[0] if self.ctx_parts else None

    @ctx_feats.setter
    def ctx_feats(self, feats: np.ndarray | None) -> None:
        self.ctx_parts = [] if feats is None else [feats]

    def _rows(self, logits: np.ndarray, drafts: np.ndarray):
        """The rows tokens are chosen from: the target's, or processed over the tokens before each."""
        rows = ProcessedRows(logits, self.params, self.prompt, self.output, drafts) \
            if self.params.processes_logits else logits
        return rows if self.grammar is None else self.grammar.rows(rows, drafts)

    def _chosen(self, rows, tokens: list[int]) -> None:
        if self.params.processes_logits:
            self.output += tokens
        if self.params.logprobs is not None:
            self.logprobs = [token_logprob(rows[i], t, self.params) for i, t in enumerate(tokens)]
        if self.grammar is not None:  # last: the rows are read while the grammar still walks the drafts
            self.grammar_stop = self.grammar.chosen(tokens)

    def begin(self, prompt: np.ndarray, logits_row: np.ndarray, feats: np.ndarray,
              kept_feats: np.ndarray | None = None) -> None:
        self.prompt = prompt
        rows = self._rows(np.asarray(logits_row)[None], NO_DRAFTS)
        _, self.last = accept_at_positions(NO_DRAFTS, rows, self.params, self.randomness, len(prompt))
        self._chosen(rows, [self.last])
        self.ctx_feats = np.array(feats) if kept_feats is None else np.concatenate([kept_feats, feats])
        if self.lookup is not None:
            self.lookup.reset(np.append(prompt, self.last))

    def room(self, committed: int, max_length: int) -> int:
        # the sequence so far is committed + 1 tokens: no round verifies past the context or max_new_tokens
        return min(self.block_size, self.max_new_tokens - self.num_out, max_length - 1 - committed)

    def choose_drafts(self, start: int, max_drafts: int) -> tuple[np.ndarray, bool]:
        """(drafts, whether lookup's): lookup's, else the drafter's, else none."""
        planned = self.planned_drafts(max_drafts)
        if planned is not None:
            return planned
        return self.drafted(self.drafter.propose(*self.drafter_call(start, max_drafts)), max_drafts), False

    def planned_drafts(self, max_drafts: int) -> tuple[np.ndarray, bool] | None:
        """`choose_drafts` where it needs no drafter call (none, or lookup's); None where it does."""
        if self.drafter is None or max_drafts < 1:
            return NO_DRAFTS, False
        found = self.lookup.propose(max_drafts) if self.lookup is not None else None
        if found is not None:  # a match near the end may offer fewer tokens
            return self._allowed_drafts(found), True
        return None

    def drafter_call(self, start: int, max_drafts: int) -> tuple:
        """The arguments of this round's `drafter.propose` (after `planned_drafts` said None)."""
        return self.last, self.ctx_feats, start, max_drafts

    def drafted(self, proposals: np.ndarray, max_drafts: int) -> np.ndarray:
        """The drafts of the drafter's proposals for this round's call: its context is consumed, the
        grammar's forced tokens come first, the cut and the grammar shorten them."""
        drafts = np.asarray(proposals, dtype=np.int64)
        self.ctx_feats = self.ctx_feats[:0]
        confidence = getattr(self.drafter, "confidence", None)
        forced = self.grammar.forced()[:max_drafts] if self.grammar is not None else []
        if len(forced):  # the grammar leaves one way on: those drafts are known, the drafter's guess the rest
            drafts = np.concatenate([np.asarray(forced, dtype=np.int64), drafts[len(forced):]])
            if confidence is not None:
                confidence = np.concatenate([np.ones(len(forced)), confidence[len(forced):]])
        if confidence is not None and self.draft_cut is not None and len(drafts) > 1:
            drafts = drafts[: self.draft_cut.cut(confidence[: len(drafts)])]
        drafts = self._allowed_drafts(drafts)
        self.stats.num_forced_draft_tokens += min(len(forced), len(drafts))
        return drafts

    def _allowed_drafts(self, drafts: np.ndarray) -> np.ndarray:
        # a draft the grammar forbids would be rejected anyway: verifying it only costs time
        return drafts if self.grammar is None else self.grammar.cut(drafts)

    def accept(self, drafts: np.ndarray, logits: np.ndarray, feats: np.ndarray, start: int,
               from_lookup: bool) -> list[int]:
        rows = self._rows(logits, drafts)
        num_accepted, self.last, kept_feats = accept_block(
            drafts, rows, feats, self.params, self.randomness, start, self.drafter is not None)
        if kept_feats is not None:
            self.ctx_parts.append(kept_feats)
        accepted = [int(d) for d in drafts[:num_accepted]]
        self._chosen(rows, accepted + [self.last])
        if len(drafts):
            self.stats.record_round(len(drafts), num_accepted, from_lookup=from_lookup)
        else:
            self.stats.num_ar_steps += 1
        if self.lookup is not None:
            self.lookup.extend(accepted + [self.last])
        return accepted

    def events(self, accepted: list[int], context_full: bool) -> Iterator[TokenEvent]:
        tokens = [(t, True) for t in accepted] + [(self.last, False)]
        logprobs = self.logprobs or [None] * len(tokens)
        for i, (token, from_draft) in enumerate(tokens):
            self.num_out += 1
            self.stats.num_output_tokens += 1
            completes = self.grammar_stop is not None and i + 1 == self.grammar_stop
            reason = ("stop" if token in self.eos or completes else "length" if self.num_out == self.max_new_tokens
                      else "context" if context_full and i == len(tokens) - 1 else None)
            self.done = reason is not None
            yield TokenEvent(token, from_draft, reason, logprobs[i])
            if self.done:
                return
