"""The OpenAI wire format: request models with their checks, error JSON, and response bodies.

Contract:
- `parse_request(model_cls, body)` turns raw request bytes into a validated request or raises
  `ApiError` (400): malformed JSON, a body that is not an object, a wrong type or an unknown
  field, each named in `param` (`messages[0].content`, `max_tokens`). Types are strict: "10"
  is not an integer and true is not a number.
- Unknown fields are refused, as OpenAI does (vLLM ignores them): a field meant for another server
  (`min_p`, `chat_template_kwargs`, a typo of `max_tokens`) would otherwise be dropped silently though
  the client expects it to shape the reply. Fields known to change nothing in the reply are accepted and
  ignored, and `ignored_fields()` names those a request carries (the app logs each name once per
  process): on chat `metadata`, `store`, `service_tier`, `user`, `reasoning_effort`, `prompt_cache_key`,
  `prompt_cache_retention`, `safety_identifier`, `prediction` (a latency hint: the reply is the
  model's either way), `modalities` equal to ["text"], `parallel_tool_calls` without tools to parse,
  `stream_options.include_obfuscation`, `tools[].function.strict` (arguments are not grammar-constrained
  yet) and `messages[].refusal`; on completions `user`.
- `n` is how many choices the reply holds, each its own sequence: an integer 1..the server's limit (the app
  checks it: a 400 naming `n`). Choice i of a seeded request samples with `engine.choice_seed(seed, i)`.
- Fields the engine cannot honour are refused by name, never ignored: best_of > 1,
  echo, suffix, functions / function_call (use tools), modalities other than text, audio, verbosity,
  web_search_options, tool_choice "required" or a named function with a template that teaches no tool-call
  format (the app's check),
  roles other than system/developer/user/assistant/tool, content parts other than text. `ApiError`s
  carry OpenAI's error JSON (`{"error": {"message", "type", "param", "code"}}`) and their HTTP status.
- Tools: `tools` (functions only) and `tool_choice` "auto" (the default with tools), "none", "required" or a
  named function (`forced_tools()`: the tools the reply must call; the app holds the reply to a call grammar);
  `tool_call_mode()` says what the app does with them: "parse" (render them, read calls from the
  reply), "render" (tool_choice "none": render them, return the reply as text, as vLLM does) or "off".
  Messages may be assistant messages with `tool_calls` (content may be null) and `tool` messages with
  their `tool_call_id`; `template_messages(messages)` gives them to the chat template as transformers
  does, each call's `arguments` as an object (400 naming it when it is not a JSON object).
- Penalties, logit bias, logprobs (decode.logits_processors, decode.sampling): `presence_penalty` and
  `frequency_penalty` in -2..2, `repetition_penalty` > 0 (vLLM's), `logit_bias` values in -100..100 on
  keys that are token ids (`logit_bias_ids(vocab_size)` checks them against the vocabulary); chat
  `logprobs: true` with `top_logprobs` 0..20 (top_logprobs needs logprobs), completions `logprobs`
  0..20; `requested_logprobs()` is None or the number of alternatives. Out of range: a 400 naming
  the field. Replies carry them in OpenAI's shapes: `chat_logprobs(entries)` (`content` of
  {token, logprob, bytes, top_logprobs}) and `completion_logprobs(entries, offset)` ({tokens,
  token_logprobs, top_logprobs, text_offset}); an entry is (token text, logprob, [(text, logprob)]),
  and a logprob of -inf (a token cut by top-k / top-p) is written -9999.0, as vLLM does (JSON has no
  infinity).
- Structured outputs (decode.structured): `response_format` (chat and completions) `{"type": "text"}`,
  `{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {"name", "schema", "strict",
  "description"}}` (OpenAI's spelling), or vLLM's `structured_outputs` with exactly one of `json` (a schema),
  `regex`, `choice` (a list of strings), `grammar` (Lark, llguidance's syntax), `json_object`; both in one
  request, or a malformed one, is a 400 naming the field. `structured_request()` gives (the spec, the
  request field that carried it) or None; the app compiles it before queueing (a schema, regex or
  grammar llguidance refuses is a 400 naming that field).
- Defaults follow OpenAI: temperature 1.0, top_p 1.0; `top_k` (0 or -1 = off) is vLLM's
  extension; `max_completion_tokens` wins over `max_tokens`; without either, a reply may run to
  the end of the context (as vLLM does).
- `spec_decode_usage(stats)` is the per-response DFlash object: drafts, draft tokens, accepted
  draft tokens, accepted tokens per position, lookup rounds, mean acceptance length (tokens per
  verify round, the bonus token included) and draft acceptance rate. `chat_choice` carries
  `message.tool_calls` (ids `call_<hex>`) when the reply held calls; `tool_call_delta` is one call in a
  streamed chunk, or `tool_call_start_delta` then `tool_call_arguments_delta` pieces for one streamed piece by
  piece. `chat_completion` / `completion` hold the choices (`chat_choice` / `completion_choice`, each
  with its `index`); each streamed chunk carries one choice, named by its `index`.
"""
from __future__ import annotations

import json
import secrets
from typing import Any, ClassVar, Literal

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
        elif item.split("[")[0] in _TYPE_TAGS or not item.replace("_", "").isalnum() or item[:1].isupper():
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


def _text_of(content: str | list[TextPart] | None) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content or [])


# -- tools: what the request offers, and the calls earlier replies made ---------------------------------
class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted, not enforced: arguments are not grammar-constrained yet


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Strict):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends a JSON string; some clients send the object


class AssistantToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def _arguments_object(arguments: str | dict, param: str) -> dict:
    """A call's arguments as the object chat templates expect (an empty string is no arguments, as vLLM reads it)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError as exc:
        raise bad_request(f"{param} is not valid JSON: {exc}", param=param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be a JSON object, got {type(value).__name__}", param=param)
    return value


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None  # an earlier reply's refusal, sent back by clients; not shown to the model

    def as_template_message(self, param: str = "message") -> dict:
        """The message as the chat template reads it (developer is system; text parts joined; call arguments
        as objects); a message that breaks the rules for its role is a 400 naming `param`'s field."""
        if self.tool_calls and self.role != "assistant":
            raise bad_request(f"only assistant messages carry tool_calls, not {self.role} ones",
                              param=f"{param}.tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise bad_request("a tool message needs the tool_call_id of the call it answers",
                              param=f"{param}.tool_call_id")
        if self.tool_call_id is not None and self.role != "tool":
            raise bad_request(f"only tool messages carry a tool_call_id, not {self.role} ones",
                              param=f"{param}.tool_call_id")
        message = {"role": "system" if self.role == "developer" else self.role, "content": _text_of(self.content)}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": _arguments_object(
                     call.function.arguments, f"{param}.tool_calls[{j}].function.arguments")}}
                for j, call in enumerate(self.tool_calls)]
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
        return message


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    return [m.as_template_message(f"messages[{i}]") for i, m in enumerate(messages)]


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as the chat template's `tools` variable: each as the client sent it."""
    return [tool.model_dump(exclude_unset=True) for tool in tools] if tools else None


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding of stream events; changes nothing here


class PredictionContent(_Strict):
    type: Literal["content"]
    content: str | list[TextPart]


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # always enforced here: the output is held to the schema either way
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one constraint."""
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


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
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    # fields accepted and ignored because they change nothing in the reply
    _IGNORED_FIELDS: ClassVar[tuple[str, ...]] = ("user",)

    def structured_request(self) -> tuple[dict, str] | None:
        """(the decode.structured spec, the request field that carried it), or None; 400 when malformed."""
        fmt, outputs = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type != "text" and outputs is not None:
            raise bad_request("give response_format or structured_outputs, not both", param="structured_outputs")
        if outputs is not None:
            given = {name: value for name, value in (("json", outputs.json_), ("regex", outputs.regex),
                                                     ("choice", outputs.choice), ("grammar", outputs.grammar),
                                                     ("json_object", outputs.json_object or None))
                     if value is not None}
            if len(given) != 1:
                raise bad_request(f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                                  f"got {len(given)}", param="structured_outputs")
            (name, value), = given.items()
            return {name: value}, f"structured_outputs.{name}"
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"json_object": True}, "response_format"
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format.json_schema needs a schema (type json_schema)",
                              param="response_format.json_schema")
        return {"json": fmt.json_schema.schema_}, "response_format.json_schema.schema"

    def check_supported(self) -> None:
        for field, refused, message in self._unsupported():
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

    def requested_logprobs(self) -> int | None:
        """None (no logprobs), or how many alternatives each token carries."""
        return None

    def logit_bias_ids(self, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs: keys must be token ids below vocab_size, values in -100..100."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.strip().isdigit() or (vocab_size is not None and int(key) >= vocab_size):
                bound = f"0..{vocab_size - 1}" if vocab_size is not None else ">= 0"
                raise bad_request(f"logit_bias keys must be token ids in {bound}, got {key!r}", param="logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise bad_request(f"logit_bias[{key!r}] must be in -100..100, got {bias}", param="logit_bias")
            pairs.append((int(key), float(bias)))
        return tuple(sorted(pairs))

    def ignored_fields(self) -> list[str]:
        """The fields this request carries that change nothing in the reply, as request paths."""
        names = [name for name in self._IGNORED_FIELDS if getattr(self, name) is not None]
        if self.stream_options is not None and self.stream_options.include_obfuscation is not None:
            names.append("stream_options.include_obfuscation")
        return names

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
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    functions: list | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    # accepted and ignored: they change nothing in the reply (see _IGNORED_FIELDS)
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    prediction: PredictionContent | None = None

    _IGNORED_FIELDS: ClassVar[tuple[str, ...]] = (
        "user", "metadata", "store", "service_tier", "reasoning_effort", "prompt_cache_key",
        "prompt_cache_retention", "safety_identifier", "prediction", "modalities")

    def _unsupported(self):
        named = isinstance(self.tool_choice, NamedToolChoice)
        names = [tool.function.name for tool in self.tools or []]
        duplicate = next((i for i, name in enumerate(names) if name in names[:i]), None)
        return [
            ("tool_choice", (named or self.tool_choice == "required") and not self.tools,
             "tool_choice \"required\" or naming a function needs tools"),
            ("tool_choice", named and self.tools and self.tool_choice.function.name not in names,
             f"tool_choice names {self.tool_choice.function.name if named else ''!r}, which is not one of the tools"),
            (f"tools[{duplicate}].function.name", duplicate is not None,
             f"two tools are named {names[duplicate] if duplicate is not None else ''!r}"),
            ("functions", bool(self.functions), "functions are not supported: send tools"),
            ("function_call", self.function_call not in (None, "none"),
             "function_call is not supported: send tools and tool_choice"),
            ("modalities", self.modalities not in (None, ["text"]),
             "modalities must be [\"text\"]: this server answers in text only"),
            ("messages", not self.messages, "messages must not be empty"),
            ("top_logprobs", self.top_logprobs is not None and not self.logprobs,
             "top_logprobs needs logprobs: true"),
        ]

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_call_mode(self) -> str:
        """"parse" (render the tools, read calls from the reply), "render" (tool_choice "none": render them,
        return the reply as text, as vLLM does) or "off" (no tools)."""
        if not self.tools:
            return "off"
        return "render" if self.tool_choice == "none" else "parse"

    def forced_tools(self) -> dict[str, dict] | None:
        """The tools one of which the reply must call (tool_choice "required": any; a named function: that one),
        name -> JSON-schema parameters; None when the model may answer in text."""
        if not self.tools or self.tool_choice in (None, "auto", "none"):
            return None
        tools = self.tool_parameters()
        return tools if self.tool_choice == "required" else {self.tool_choice.function.name: tools[
            self.tool_choice.function.name]}

    def tool_parameters(self) -> dict[str, dict]:
        """Each tool's name -> its JSON-schema parameters, as the reply's parser checks calls against them."""
        return {tool.function.name: tool.function.parameters or {} for tool in self.tools or []}

    def ignored_fields(self) -> list[str]:
        names = super().ignored_fields()
        if self.parallel_tool_calls is not None and self.tool_call_mode() != "parse":
            names.append("parallel_tool_calls")
        if any(tool.function.strict for tool in self.tools or []):
            names.append("tools[].function.strict")
        if any(m.refusal is not None for m in self.messages):
            names.append("messages[].refusal")
        return names

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
    logprobs: int | None = Field(default=None, ge=0, le=20)

    def requested_logprobs(self) -> int | None:
        return self.logprobs

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
    tools: list[Tool] | None = None
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
        "num_forced_draft_tokens": stats.num_forced_draft_tokens,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "draft_acceptance_rate": stats.acceptance_rate,
    }


def usage(num_prompt_tokens: int, num_completion_tokens: int, stats: GenerationStats) -> dict:
    """`usage` of a reply: `stats` are its choices' summed (`num_completion_tokens` too), the prompt counted once."""
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.num_cached_prompt_tokens},  # as OpenAI and vLLM report it
            "spec_decode": spec_decode_usage(stats)}


def tool_call_body(call, index: int | None = None) -> dict:
    """One call (`name`, `arguments` JSON text) as OpenAI writes it, with a fresh `call_<hex>` id; `index` in
    a streamed chunk."""
    body = {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}
    return body if index is None else {"index": index, **body}


def tool_call_delta(index: int, call) -> dict:
    return {"tool_calls": [tool_call_body(call, index)]}


def tool_call_start_delta(index: int, name: str) -> dict:
    """A streamed call's first delta: its id, type and name, arguments still empty."""
    return {"tool_calls": [{"index": index, "id": f"call_{secrets.token_hex(12)}", "type": "function",
                            "function": {"name": name, "arguments": ""}}]}


def tool_call_arguments_delta(index: int, text: str) -> dict:
    """A piece of a streamed call's arguments, appended to the pieces before it."""
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


NO_PROBABILITY_LOGPROB = -9999.0  # what a -inf logprob is written as (vLLM's value; JSON has no infinity)


def _finite(logprob: float) -> float:
    return logprob if logprob > NO_PROBABILITY_LOGPROB else NO_PROBABILITY_LOGPROB


def chat_logprobs(entries: list) -> dict:
    """`choices[].logprobs` of a chat reply: entries are (token text, logprob, [(text, logprob), ...])."""
    def item(text, logprob):
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}
    return {"content": [{**item(text, logprob), "top_logprobs": [item(t, lp) for t, lp in top]}
                        for text, logprob, top in entries], "refusal": None}


def completion_logprobs(entries: list, offset: int = 0) -> dict:
    """`choices[].logprobs` of a completion; `offset` is where the first token's text starts in the reply."""
    offsets = []
    for text, _, _ in entries:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": [text for text, _, _ in entries],
            "token_logprobs": [_finite(logprob) for _, logprob, _ in entries],
            "top_logprobs": [{t: _finite(lp) for t, lp in top} for _, _, top in entries],
            "text_offset": offsets}


def chat_choice(index: int, text: str | None, finish_reason: str, tool_calls: list | None = None,
                logprobs: dict | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = [tool_call_body(call) for call in tool_calls]
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_completion(request_id: str, created: int, model: str, choices: list[dict], usage_body: dict) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_body}


def completion_choice(index: int, text: str, finish_reason: str, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion(request_id: str, created: int, model: str, choices: list[dict], usage_body: dict) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_body}


def chat_chunk(request_id: str, created: int, model: str, delta: dict | None, finish_reason: str | None = None,
               usage_body: dict | None = None, include_usage: bool = False, logprobs: dict | None = None,
               index: int = 0) -> dict:
    """One `chat.completion.chunk` of choice `index`; the usage chunk (delta None) has no choices, as OpenAI sends it."""
    choices = [] if delta is None else [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish_reason}]
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": choices}
    if include_usage:
        chunk["usage"] = usage_body
    return chunk


def completion_chunk(request_id: str, created: int, model: str, text: str | None, finish_reason: str | None = None,
                     usage_body: dict | None = None, include_usage: bool = False, logprobs: dict | None = None,
                     index: int = 0) -> dict:
    choices = [] if text is None else [{"index": index, "text": text, "logprobs": logprobs,
                                        "finish_reason": finish_reason}]
    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if include_usage:
        chunk["usage"] = usage_body
    return chunk
