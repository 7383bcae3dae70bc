"""The OpenAI wire format: request models with their checks, error JSON, and response bodies.

Contract:
- `parse_request(model_cls, body)` turns raw request bytes into a validated request or raises
  `ApiError` (400): malformed JSON, a body that is not an object, a wrong type or an unknown
  field, each named in `param` (`messages[0].content`, `max_tokens`). Types are strict: "10"
  is not an integer and true is not a number.
- Fields the engine cannot honour are refused by name, never ignored: n > 1, best_of > 1,
  logprobs / top_logprobs, echo, suffix, tools / tool_choice / functions, penalties other than 0,
  logit_bias, a response_format other than text, roles other than system/developer/user/assistant,
  content parts other than text. `RequestError`s carry OpenAI's error JSON
  (`{"error": {"message", "type", "param", "code"}}`) and their HTTP status.
- Defaults follow OpenAI: temperature 1.0, top_p 1.0; `top_k` (0 or -1 = off) is vLLM's
  extension; `max_completion_tokens` wins over `max_tokens`; without either, a reply may run to
  the end of the context (as vLLM does).
- `spec_decode_usage(stats)` is the per-response DFlash object: drafts, draft tokens, accepted
  draft tokens, accepted tokens per position, lookup rounds, mean acceptance length (tokens per
  verify round, the bonus token included) and draft acceptance rate.
"""
from __future__ import annotations

import json
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from ..decode.stats import GenerationStats


class ApiError(Exception):
    """An error answered as OpenAI's error JSON with this HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _param_path(loc: tuple) -> str:
    """A pydantic error location as a request path (messages[0].content), without union-branch tags."""
    path = ""
    for item in loc:
        if isinstance(item, int):
            path += f"[{item}]"
        elif item.split("[")[0] in _TYPE_TAGS or not item.replace("_", "").isalnum():
            break  # the rest names which branch of a union failed, not a field
        else:
            path += ("." if path else "") + item
    return path


def parse_request(model_cls: type[BaseModel], body: bytes):
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}",
                          code="invalid_json")
    try:
        return model_cls.model_validate(data)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        param = _param_path(first["loc"])
        if first["type"] == "extra_forbidden":
            raise bad_request(f"unsupported field {param!r}: this server does not implement it",
                              param=param, code="unsupported_field") from None
        raise bad_request(f"{param or 'request'}: {first['msg']}", param=param or None) from None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict:
        """The message as the chat template reads it (developer is system; text parts joined)."""
        content = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = 1
    # accepted only at values that change nothing (see check_supported)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        unsupported = [
            ("n", self.n != 1, "n must be 1: one choice per request"),
            ("presence_penalty", self.presence_penalty != 0, "presence_penalty must be 0"),
            ("frequency_penalty", self.frequency_penalty != 0, "frequency_penalty must be 0"),
            ("repetition_penalty", self.repetition_penalty != 1, "repetition_penalty must be 1"),
            ("logit_bias", bool(self.logit_bias), "logit_bias is not supported"),
            ("logprobs", self.logprobs not in (None, False), "logprobs are not supported"),
            ("top_logprobs", self.top_logprobs not in (None, 0), "top_logprobs are not supported"),
        ]
        for field, refused, message in unsupported + self._unsupported():
            if refused:
                raise bad_request(message, param=field, code="unsupported_value")
        for i, s in enumerate(self.stop_strings()):
            if not s:
                raise bad_request("stop strings must not be empty", param="stop" if isinstance(self.stop, str)
                                  else f"stop[{i}]")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options needs stream: true", param="stream_options")

    def _unsupported(self) -> list[tuple[str, bool, str]]:
        return []

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def requested_max_tokens(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None

    def _unsupported(self):
        return [
            ("tools", bool(self.tools), "tools are not supported"),
            ("tool_choice", self.tool_choice not in (None, "none"), "tool_choice is not supported"),
            ("functions", bool(self.functions), "functions are not supported"),
            ("function_call", self.function_call not in (None, "none"), "function_call is not supported"),
            ("response_format", self.response_format not in (None, {"type": "text"}),
             "response_format other than text is not supported"),
            ("messages", not self.messages, "messages must not be empty"),
        ]

    def requested_max_tokens(self):
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def _unsupported(self):
        return [
            ("echo", self.echo, "echo is not supported"),
            ("suffix", bool(self.suffix), "suffix is not supported"),
            ("best_of", self.best_of not in (None, 1), "best_of must be 1"),
        ]

    def single_prompt(self) -> str | list[int]:
        """The one prompt (a string or token ids); a batch of prompts is refused by name."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise bad_request(f"one prompt per request, got {len(p)}", param="prompt")
            p = p[0]
        if not p:
            raise bad_request("prompt must not be empty", param="prompt")
        return p


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# -- responses -------------------------------------------------------------------------------
def spec_decode_usage(stats: GenerationStats) -> dict:
    return {
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "num_accepted_tokens_per_pos": list(stats.accepted_per_position),
        "num_lookup_drafts": stats.num_lookup_drafts,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "draft_acceptance_rate": stats.acceptance_rate,
    }


def usage(num_prompt_tokens: int, num_completion_tokens: int, stats: GenerationStats) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.num_cached_prompt_tokens},  # as OpenAI and vLLM report it
            "spec_decode": spec_decode_usage(stats)}


def chat_completion(request_id: str, created: int, model: str, text: str, finish_reason: str,
                    usage_body: dict) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage_body}


def completion(request_id: str, created: int, model: str, text: str, finish_reason: str, usage_body: dict) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage_body}


def chat_chunk(request_id: str, created: int, model: str, delta: dict | None, finish_reason: str | None = None,
               usage_body: dict | None = None, include_usage: bool = False) -> dict:
    """One `chat.completion.chunk`; the usage chunk (delta None) has no choices, as OpenAI sends it."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish_reason}]
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": choices}
    if include_usage:
        chunk["usage"] = usage_body
    return chunk


def completion_chunk(request_id: str, created: int, model: str, text: str | None, finish_reason: str | None = None,
                     usage_body: dict | None = None, include_usage: bool = False) -> dict:
    choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if include_usage:
        chunk["usage"] = usage_body
    return chunk
