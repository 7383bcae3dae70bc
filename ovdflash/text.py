"""The text layer shared by the pipeline, its batch engine and the server: results, stop strings, request checks.

Contract:
- `GenerationResult(text, token_ids, finish_reason, stats, logprobs)`: what a call returns; `logprobs`
  (only when the call asked for them) holds one `decode.sampling.TokenLogprob` per token id;
  `record_token(result, event)` appends an event's token (and logprob, when it carries one).
- `extend_text(text, event, detok, eos, stops) -> (text, stopped)` appends one token's text (EOS
  adds none) and cuts at the first stop string it completes; `held_back(text, stops)` is how much
  of the end of `text` could still be the start of a stop string (streaming holds it back).
- `check_positive_int`, `check_token_ids`, `check_stops`, `check_messages`: one-line ValueErrors
  naming what is wrong with a request's arguments (`CHAT_ROLES` are the roles a message may have).
- `encode_prompt(pipe, prompt_or_messages, apply_chat_template=False) -> list[int]` is
  `DFlashPipeline.encode_prompt`, with the pipeline's `tokenizer`, `bos_token_id` and `vocab_size`:
  a string is encoded with the tokenizer's special tokens and `bos_token_id` put in front if the
  tokenizer did not add it; a list of chat messages is rendered with the chat template (which
  carries its own special tokens); a list of token ids is checked against `vocab_size`.
  `apply_chat_template=True` makes a string one user message. Anything else: TypeError.
  `require_tokenizer(tokenizer)`: the tokenizer, or ValueError when the pipeline has none.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .decode.stats import GenerationStats
from .tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string), "length" (max_new_tokens), "context"
    stats: GenerationStats
    logprobs: list | None = None  # decode.sampling.TokenLogprob per token id, when asked for


def record_token(result: GenerationResult, event) -> None:
    result.token_ids.append(event.token)
    if event.logprob is not None:
        if result.logprobs is None:
            result.logprobs = []
        result.logprobs.append(event.logprob)


def extend_text(text: str, event, detok: IncrementalDetokenizer, eos, stops: list[str]) -> tuple[str, bool]:
    """text with event's token decoded (EOS adds none); True, and cut there, when a stop string completed."""
    delta = detok.add([event.token]) if event.token not in eos else ""
    if event.finish_reason:
        delta += detok.flush()
    text += delta
    cut = _find_stop(text, len(text) - len(delta), stops)
    return (text, False) if cut is None else (text[:cut], True)


def _find_stop(text: str, new_from: int, stops: list[str]) -> int | None:
    """Start of the earliest stop string that ends in the new text, or None."""
    best = None
    for s in stops:
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_positive_int(name: str, value, what: str = "an integer >= 1") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return int(value)


def check_token_ids(ids, vocab_size: int | None = None) -> list[int]:
    """A prompt of token ids: integers (not bools, not bytes) in 0..vocab_size-1, at least one."""
    if isinstance(ids, (str, bytes, bytearray)):
        raise TypeError(f"token ids must be a list of integers, got {type(ids).__name__}")
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"token ids must be integers: item {i} is {t!r}")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = f"0..{vocab_size - 1}" if vocab_size is not None else ">= 0"
            raise ValueError(f"token id {int(t)} at item {i} is out of range ({bound})")
        out.append(int(t))
    if not out:
        raise ValueError("the prompt is empty")
    return out


def check_stops(stop) -> list[str]:
    """Stop strings: None, a string, or a list of strings; an empty string is refused either way."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise TypeError(f"stop[{i}] must be a string, got {s!r}")
        if not s:
            raise ValueError("stop strings must not be empty" + (f" (stop[{i}])" if not isinstance(stop, str) else ""))
    return list(items)


def check_messages(messages: list) -> list[dict]:
    """Chat messages: dicts with a known role and string content (assistant content may be empty)."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if m.get("role") not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise TypeError(f"messages[{i}].content must be a string, got {type(m.get('content')).__name__}")
    return messages


def require_tokenizer(tokenizer: Tokenizer | None) -> Tokenizer:
    if tokenizer is None:
        raise ValueError("this pipeline has no tokenizer; use generate_tokens()")
    return tokenizer


def encode_prompt(pipe, prompt_or_messages, apply_chat_template: bool = False) -> list[int]:
    if isinstance(prompt_or_messages, str) and apply_chat_template:  # then as any message list
        prompt_or_messages = [{"role": "user", "content": prompt_or_messages}]
    if isinstance(prompt_or_messages, str):
        ids = require_tokenizer(pipe.tokenizer).encode(prompt_or_messages)
        if pipe.bos_token_id is not None and ids[:1] != [pipe.bos_token_id]:
            ids = [pipe.bos_token_id] + ids
        return ids
    if isinstance(prompt_or_messages, (bytes, bytearray, dict)) or not hasattr(prompt_or_messages, "__iter__"):
        raise TypeError("prompt must be a string, a list of chat messages, or a list of token ids, "
                        f"got {type(prompt_or_messages).__name__}")
    items = list(prompt_or_messages)
    if items and any(isinstance(m, dict) for m in items):
        return require_tokenizer(pipe.tokenizer).encode_chat(check_messages(items))
    return check_token_ids(items, pipe.vocab_size)
