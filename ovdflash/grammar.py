"""Structured outputs' grammars, compiled with llguidance (Rust, no torch): the matchers decode/structured drives.

Contract:
- `grammar_state(tokenizer, spec, vocab_size, eos_token_ids)` -> a fresh `decode.structured.GrammarState`
  for one call, holding its output to `spec` (a `decode.structured.StructuredSpec`, or anything
  `structured_spec` reads), drafting the tokens it forces unless the spec's `forced_drafts` is False.
  The llguidance tokenizer is built once per (tokenizer, vocabulary, EOS ids) from the HF `tokenizers`
  JSON the model directory carries (`Tokenizer.tokenizer.to_str()`; never transformers); its vocabulary
  is the model's (ids the tokenizer lacks are never allowed) and its EOS ids are the pipeline's, so EOS
  is allowed exactly where the grammar accepts.
- `check_structured(tokenizer, spec, vocab_size, eos_token_ids)`: the same compilation without keeping
  the matcher; a JSON schema, regex or grammar llguidance refuses is a ValueError of one line that
  names the spec's field (`structured json: ...`). Both raise ValueError when llguidance is missing.
- `special_tokens_among(tokenizer, texts, vocab_size, eos_token_ids) -> frozenset[str]`: those of `texts` that
  are one token llguidance treats as special (the tokenizer's added tokens, such as Qwen's `<tool_call>`).
  A grammar names them as `<text>`: llguidance never matches such a token against a quoted literal, though
  its mask may allow it there. Empty when llguidance is missing (compiling then says so).
- `LLGuidanceMatcher(matcher, vocab_size)`: `decode.structured.GrammarMatcher` over `llguidance.LLMatcher`;
  `consume` uses llguidance's try-consume, so a forbidden token never puts the matcher in its
  (permanent) error state, and `rollback` is llguidance's own.
Imports: decode/, tokenizer; llguidance lazily (the `serve` extra), never torch or transformers.
"""
from __future__ import annotations

import json
from functools import lru_cache

import numpy as np

from .decode.structured import GrammarState, StructuredSpec, structured_spec
from .tokenizer import Tokenizer

MISSING_LLGUIDANCE = "structured outputs need the llguidance package: pip install 'ovdflash[serve]'"


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError(MISSING_LLGUIDANCE) from None
    return llguidance


@lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
    llg = _llguidance()
    n_vocab = max(vocab_size, tokenizer.vocab_size)
    return llg.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=n_vocab,
                           eos_token=list(eos_token_ids) or None)


def _grammar_text(spec: StructuredSpec) -> str:
    llg = _llguidance()
    if spec.kind == "json":
        return llg.LLMatcher.grammar_from_json_schema(spec.value)
    if spec.kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"})
    if spec.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.value))
    return llg.LLMatcher.grammar_from_lark(spec.value)


def _matcher(tokenizer: Tokenizer, spec, vocab_size: int | None, eos_token_ids):
    llg = _llguidance()
    spec = structured_spec(spec)
    vocab = vocab_size or tokenizer.vocab_size
    ll_tokenizer = _ll_tokenizer(tokenizer, vocab, tuple(int(t) for t in eos_token_ids))
    try:
        text = _grammar_text(spec)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"structured {spec.kind}: {_first_line(exc)}") from None
    matcher = llg.LLMatcher(ll_tokenizer, text, log_level=0)
    if matcher.is_error():
        raise ValueError(f"structured {spec.kind}: {_first_line(matcher.get_error())}")
    return matcher, vocab


def _first_line(error) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    # llguidance's regex errors put the cause on a later line: keep the line that says "error:"
    cause = next((line for line in lines[1:] if line.startswith("error:")), None)
    return f"{lines[0]} ({cause})" if cause else (lines[0] if lines else "invalid")


def special_tokens_among(tokenizer: Tokenizer, texts, vocab_size: int | None, eos_token_ids) -> frozenset[str]:
    try:
        eos = tuple(int(t) for t in eos_token_ids)
        ll_tokenizer = _ll_tokenizer(tokenizer, vocab_size or tokenizer.vocab_size, eos)
    except ValueError:
        return frozenset()
    ids = {text: tokenizer.token_to_id(text) for text in texts}
    return frozenset(text for text, i in ids.items() if i is not None and ll_tokenizer.is_special_token(i))


def check_structured(tokenizer: Tokenizer, spec, vocab_size: int | None, eos_token_ids) -> StructuredSpec:
    _matcher(tokenizer, spec, vocab_size, eos_token_ids)
    return structured_spec(spec)


def grammar_state(tokenizer: Tokenizer, spec, vocab_size: int | None, eos_token_ids) -> GrammarState:
    return GrammarState(LLGuidanceMatcher(*_matcher(tokenizer, spec, vocab_size, eos_token_ids)),
                        structured_spec(spec).forced_drafts)


class LLGuidanceMatcher:
    """decode.structured.GrammarMatcher over an llguidance.LLMatcher (module contract)."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size

    @property
    def stopped(self) -> bool:
        return self.matcher.is_stopped()

    def consume(self, tokens) -> int:
        return self.matcher.try_consume_tokens([int(t) for t in tokens])

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self.matcher.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: {self.matcher.get_error()}")

    def allowed(self) -> np.ndarray:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)

    def forced(self) -> list[int]:
        return list(self.matcher.compute_ff_tokens())
