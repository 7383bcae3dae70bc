"""Structured outputs inside a speculative round: a grammar holds every token chosen, drafted or not (pure numpy).

Contract:
- `StructuredSpec(kind, value)` is the one home of a call's constraint: kind "json" (a JSON schema: a dict,
  or its JSON text), "json_object" (any JSON object; value None), "regex" (a string), "choice" (a list of
  strings: the output is exactly one of them) or "grammar" (a Lark grammar in llguidance's syntax).
  `structured_spec(value)` reads a call's `structured` argument: None, a StructuredSpec, or a dict with
  exactly one of the keys json, json_object, regex, choice, grammar (vLLM's `structured_outputs`
  spelling), and optionally `forced_drafts` (default True; False: the round never drafts the tokens the
  grammar forces, for measuring what they bring; the output is the same either way); anything else is a
  one-line ValueError naming what is wrong. Compiling a spec into a
  matcher is `ovdflash.grammar`'s (it needs the tokenizer; decode/ never imports llguidance).
- A `GrammarMatcher` (ovdflash.grammar.LLGuidanceMatcher, or a test's) holds the tokens chosen so far:
  `consume(tokens) -> n` takes the longest prefix the grammar allows (n tokens) and leaves the matcher
  usable whatever came after it; `rollback(n)` forgets the last n; `allowed() -> bool [V]` are the
  tokens allowed next (EOS only where the grammar accepts); `stopped` is True once the grammar is
  complete (nothing may follow but EOS); `forced() -> list[int]` the tokens the grammar forces next.
- `GrammarState(matcher)`, one per sequence, is driven by `round.SequenceState`:
  - `cut(drafts)`: the drafts up to the first one the grammar forbids after the output so far and the
    drafts before it, and none past a token that completes the grammar; the matcher is left as it was.
  - `rows(rows, drafts)` -> `ConstrainedRows`: row i is `rows[i]` (the target's row, or its
    `logits_processors.ProcessedRows` row) with every token the grammar forbids at position i (after
    the output so far and drafts[:i]) set to -inf, made when first read and kept. Greedy takes its
    argmax; sampling warps it (temperature, top-k, top-p over the allowed tokens).
  - `forced()`: the tokens the grammar forces next (none once it is complete, or with forced_drafts
    False); the round drafts them in place of the drafter's first drafts.
  - `chosen(tokens) -> int | None`: after acceptance, the matcher holds exactly the output so far plus
    `tokens` (the accepted drafts, then the target's token): what the rows walked past is rolled back.
    Returns how many of `tokens` it took to complete the grammar (the round stops there, "stop"), or None.
- Exactness: an AR step at position t chooses from the row masked by the grammar after the tokens
  before t; a verified row i of a block is masked by the state after the output and drafts[:i], which
  are those same tokens whenever row i is read (acceptance reads row i only once drafts[:i] are
  accepted). So greedy DFlash equals greedy AR and a seeded reply equals AR's, draft for draft. A cut
  draft would have been rejected anyway (its row gives it probability zero): cutting changes nothing
  but the verify cost.
May import: numpy only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredSpec:
    kind: str
    value: object = None
    forced_drafts: bool = True

    def __post_init__(self):
        kind, value = self.kind, self.value
        if not isinstance(self.forced_drafts, bool):
            raise ValueError(f"structured forced_drafts must be true or false, got {self.forced_drafts!r}")
        if kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {kind!r}")
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise ValueError(f"structured json: the schema is not valid JSON: {exc}") from None
            if not isinstance(value, (dict, bool)):
                raise ValueError(f"structured json must be a JSON schema (an object), got {type(value).__name__}")
            object.__setattr__(self, "value", value)
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured {kind} must be a non-empty string, got {value!r}")
        elif kind == "choice":
            if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value \
                    or not all(isinstance(c, str) and c for c in value):
                raise ValueError(f"structured choice must be a non-empty list of non-empty strings, got {value!r}")
            object.__setattr__(self, "value", tuple(value))
        elif value not in (None, True):
            raise ValueError(f"structured json_object takes no value, got {value!r}")


def structured_spec(value) -> StructuredSpec | None:
    """A call's `structured` argument as a StructuredSpec (module contract)."""
    if value is None or isinstance(value, StructuredSpec):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"structured must be a dict with one of {', '.join(STRUCTURED_KINDS)}, "
                         f"got {type(value).__name__}")
    given = [k for k, v in value.items() if k in STRUCTURED_KINDS and v is not None and v is not False]
    unknown = [k for k in value if k not in STRUCTURED_KINDS and k != "forced_drafts"]
    if unknown:
        raise ValueError(f"structured has an unknown key {unknown[0]!r}; use one of {', '.join(STRUCTURED_KINDS)} "
                         f"(and forced_drafts)")
    if len(given) != 1:
        raise ValueError(f"structured needs exactly one of {', '.join(STRUCTURED_KINDS)}, got {len(given)}")
    kind = given[0]
    return StructuredSpec(kind, None if kind == "json_object" else value[kind], value.get("forced_drafts", True))


class GrammarMatcher(Protocol):
    stopped: bool

    def consume(self, tokens: Sequence[int]) -> int: ...
    def rollback(self, num_tokens: int) -> None: ...
    def allowed(self) -> np.ndarray: ...
    def forced(self) -> list[int]: ...


class GrammarState:
    """One sequence's grammar between rounds (module contract)."""

    def __init__(self, matcher: GrammarMatcher, forced_drafts: bool = True):
        self.matcher = matcher
        self.forced_drafts = forced_drafts
        self._drafts: list[int] = []  # the round's verified drafts
        self._walked = 0  # drafts the matcher holds beyond the output so far

    def cut(self, drafts: np.ndarray) -> np.ndarray:
        kept = 0
        for d in drafts:
            if self.matcher.stopped or self.matcher.consume([int(d)]) != 1:
                break
            kept += 1
        if kept:
            self.matcher.rollback(kept)
        return drafts[:kept]

    def forced(self) -> list[int]:
        return [] if self.matcher.stopped or not self.forced_drafts else list(self.matcher.forced())

    def rows(self, rows, drafts: np.ndarray) -> "ConstrainedRows":
        self._walk_to(0)
        self._drafts = [int(d) for d in drafts]
        return ConstrainedRows(rows, self)

    def allowed_at(self, i: int) -> np.ndarray:
        """The tokens allowed at the block's row i: after the output so far and drafts[:i]."""
        self._walk_to(i)
        return self.matcher.allowed()

    def chosen(self, tokens: Sequence[int]) -> int | None:
        accepted = len(tokens) - 1
        self._walk_to(accepted)  # the accepted drafts: a cut never keeps one past a completed grammar
        self._drafts, self._walked = [], 0
        if self.matcher.stopped:
            return accepted
        if self.matcher.consume([int(tokens[-1])]) != 1:
            raise RuntimeError(f"token {int(tokens[-1])} was chosen outside the grammar")
        return len(tokens) if self.matcher.stopped else None

    def _walk_to(self, i: int) -> None:
        if i < self._walked:
            self.matcher.rollback(self._walked - i)
        elif i > self._walked and self.matcher.consume(self._drafts[self._walked:i]) != i - self._walked:
            raise RuntimeError("a verified draft is outside the grammar (drafts must be cut first)")
        self._walked = i


class ConstrainedRows:
    """The rows of one verified block with the grammar's mask at each position (module contract)."""

    def __init__(self, rows, grammar: GrammarState):
        self.base, self.grammar = rows, grammar
        self._rows: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> np.ndarray:
        if i not in self._rows:
            row = np.asarray(self.base[i], dtype=np.float64)
            allowed = self.grammar.allowed_at(i)[: len(row)]
            if not allowed.any():
                raise RuntimeError("the grammar allows no token at this position")
            masked = np.full(len(row), -np.inf)
            masked[: len(allowed)][allowed] = row[: len(allowed)][allowed]
            self._rows[i] = masked
        return self._rows[i]
