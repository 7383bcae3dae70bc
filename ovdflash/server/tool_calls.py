"""Tool calls in a model's reply: which format a chat template teaches, and the parsers that turn the reply's
text into OpenAI `tool_calls`, whole or as it streams.

Contract:
- `detect_tool_format(chat_template) -> str | None`: the format the template teaches the model, read from its
  text: "qwen3_xml" (it mentions `<tool_call>` and `<function=`: Qwen3.5, Qwen3-Coder), "hermes" (`<tool_call>`
  around a JSON object: Qwen2.5, Qwen3), "llama3_json" (`<|python_tag|>` or the `ipython` role: Llama 3.1-3.3
  JSON calls), None when it teaches none of these. `describe_tool_format(format)` is the start-up line.
- `new_parser(format, tools, parallel=True)` -> a parser with `feed(text) -> [event]` as the reply streams
  in and `finish() -> [event]` at its end; an event is a `str` (content) or a `ToolCall(name, arguments)`.
  `tools` maps each of the request's function names to its JSON-schema `parameters`.
  `parse_reply(parser, text)` feeds a fresh parser the whole reply at once; for any split of a reply the
  streamed content concatenates, and the streamed calls list, to its `ParsedReply`.
- A call is returned only when it is well formed: it names one of the request's tools and its arguments
  are a JSON object (`ToolCall.arguments` is that object as JSON text). Anything else (invalid JSON, an
  unknown name, a `<tool_call>` never closed) stays in the content exactly as the model wrote it, so a
  reply without a well-formed call comes back unchanged, character for character. Parsers never raise.
- Whitespace between content and a call, between calls and after the last call is layout, not content;
  `ParsedReply.content` is None when a reply holds calls and nothing else. parallel False: only the first
  call is returned, later ones are dropped.
- `call_grammar(format, tools) -> str | None`: a Lark grammar (llguidance's syntax) whose only sentences are
  one call, in `format`'s layout, of one of `tools` (name -> JSON-schema parameters); what tool_choice
  "required" or a named function holds the reply to, and its reply parses to that call (None for an unknown
  format). hermes and llama3_json: the call is `%json`, arguments valid against the tool's schema, laid out
  as json.dumps writes it (as templates render calls). qwen3_xml: `<function=NAME>` one of the tools, then
  the schema's properties in the schema's order, each `<parameter=KEY>\nVALUE\n</parameter>\n`, required
  ones always, the others optional, no others; a value is one of its enum / const members when the schema
  lists them, free text without `</parameter>` when it may be a string (a string's own constraints, such as
  pattern, are not held; its minLength / maxLength are), else JSON valid against its schema. Limits: the
  properties come in the schema's order, only the listed ones (a schema that allows others gets none), and
  keywords across properties (dependentRequired, if / then) are not held.
- Streaming holds back only text that may still turn out to be a call: a tail that may be the start of
  `<tool_call>` and whitespace that may precede one (until the next text decides), an open `<tool_call>`
  block (until its `</tool_call>`: each call arrives whole, arguments included), and for llama3_json a
  reply that opens with `{` (until it ends).
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
NEWLINE = "\n"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True)
class ParsedReply:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ToolCallParser(Protocol):
    def feed(self, text: str) -> list[str | ToolCall]: ...

    def finish(self) -> list[str | ToolCall]: ...


def call_grammar(tool_format: str, tools: dict[str, dict]) -> str | None:
    """The grammar of one well-formed call of one of `tools` (module contract)."""
    if tool_format == "qwen3_xml":
        return _qwen3_xml_grammar(tools)
    arguments_key = {"hermes": "arguments", "llama3_json": "parameters"}.get(tool_format)
    if arguments_key is None:
        return None
    calls = [{"type": "object", "properties": {"name": {"const": name},
                                               arguments_key: parameters or {"type": "object"}},
              "required": ["name", arguments_key], "additionalProperties": False}
             for name, parameters in tools.items()]
    call = f"call: %json {json.dumps({'x-guidance': _JSON_LAYOUT, 'anyOf': calls})}"
    if tool_format == "hermes":
        return f'start: "{OPEN_TAG}\\n" call "\\n{CLOSE_TAG}"\n{call}'
    return f"start: call\n{call}"


# JSON laid out as chat templates render it (`tojson`, json.dumps' separators), and no other whitespace
_JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def _qwen3_xml_grammar(tools: dict[str, dict]) -> str:
    """`<tool_call>\n<function=NAME>\n` the parameters `</function>\n</tool_call>` (module contract)."""
    rules, functions = [], []
    for f, (name, parameters) in enumerate(tools.items()):
        schema = parameters if isinstance(parameters, dict) else {}
        required = set(schema.get("required") or ())
        items = []
        for p, (key, prop) in enumerate((schema.get("properties") or {}).items()):
            rule = f"f{f}_p{p}"
            value, lexeme = _xml_value(prop, rule.upper())
            opening = json.dumps(f"<parameter={key}>\n")
            rules += [f"{rule}: {opening} {value} {json.dumps(NEWLINE)}"] + lexeme
            items.append(rule if key in required else f"{rule}?")
        functions.append(f"f{f}")
        opening = json.dumps(f"<function={name}>\n")
        rules.append(f"f{f}: {opening} {' '.join(items)} \"</function>\"")
    call_open, call_close = json.dumps(f"{OPEN_TAG}\n"), json.dumps(f"\n{CLOSE_TAG}")
    return "\n".join([f"start: {call_open} ({' | '.join(functions)}) {call_close}"] + rules)


_PARAMETER_END = json.dumps("\n</parameter>")


def _xml_value(schema, lexeme_name: str) -> tuple[str, list[str]]:
    """(one parameter's value followed by `\n</parameter>`, the lexeme rules it needs) (module contract)."""
    schema = schema if isinstance(schema, dict) else {}
    members = [schema["const"]] if "const" in schema else schema.get("enum")
    if members:
        texts = sorted({m if isinstance(m, str) else json.dumps(m) for m in members})
        return f"({' | '.join(json.dumps(t) for t in texts)}) {_PARAMETER_END}", []
    types = schema.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    if types and "string" not in types:
        return f"%json {json.dumps({**schema, 'x-guidance': _JSON_LAYOUT})} {_PARAMETER_END}", []
    low = int(schema.get("minLength", 0)) if "string" in types else 0
    high = int(schema["maxLength"]) if "string" in types and "maxLength" in schema else ""
    # text up to the first `</parameter>`, which must follow a newline; a string's length bounds held
    return lexeme_name, [f"{lexeme_name}: /(?s:.{{{low},{high}}})\\n<\\/parameter>/ & "
                         f"~/(?s:.*)<\\/parameter>(?s:.+)/"]


def detect_tool_format(chat_template: str | None) -> str | None:
    if not chat_template:
        return None
    if OPEN_TAG in chat_template:
        return "qwen3_xml" if "<function=" in chat_template else "hermes"
    if PYTHON_TAG in chat_template or "ipython" in chat_template:
        return "llama3_json"
    return None


_FORMAT_LINES = {
    "hermes": "hermes (<tool_call> around a JSON object, as Qwen2.5 and Qwen3 write them)",
    "qwen3_xml": "qwen3_xml (<tool_call><function=NAME><parameter=KEY>, as Qwen3.5 and Qwen3-Coder write them)",
    "llama3_json": "llama3_json (the whole reply a JSON object {\"name\", \"parameters\"}, as Llama 3.1-3.3 write it)",
}


def describe_tool_format(tool_format: str | None) -> str:
    if tool_format is None:
        return ("tool calls: the chat template teaches no tool-call format this server knows; requests with "
                "tools are refused unless tool_choice is \"none\"")
    return f"tool calls: {_FORMAT_LINES[tool_format]}"


def new_parser(tool_format: str, tools: dict[str, dict], parallel: bool = True) -> ToolCallParser:
    if tool_format == "hermes":
        return _TaggedCalls(_hermes_calls, tools, parallel)
    if tool_format == "qwen3_xml":
        return _TaggedCalls(_qwen3_xml_calls, tools, parallel)
    if tool_format == "llama3_json":
        return _WholeReplyJson(tools, parallel)
    raise ValueError(f"unknown tool-call format {tool_format!r}; known: {', '.join(_FORMAT_LINES)}")


def parse_reply(parser: ToolCallParser, text: str) -> ParsedReply:
    """The whole reply through a fresh parser."""
    events = parser.feed(text) + parser.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    content = "".join(e for e in events if isinstance(e, str))
    return ParsedReply(content if content or not calls else None, calls)


# -- one call's checks, shared by the formats -------------------------------------------------------------
def _checked_call(name, arguments, tools: dict[str, dict]) -> ToolCall | None:
    """The call if it names a tool of the request and its arguments are a JSON object (or its text)."""
    if not isinstance(name, str) or name not in tools:
        return None
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


_CALL_KEYS = {"name", "arguments", "parameters", "type"}  # a JSON reply with other keys is an answer, not a call


def _call_of_object(obj, tools: dict[str, dict]) -> ToolCall | None:
    if not isinstance(obj, dict) or not set(obj) <= _CALL_KEYS:
        return None
    arguments = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    return _checked_call(obj.get("name"), arguments, tools)


def _all_or_none(calls: list) -> list[ToolCall] | None:
    return calls if calls and all(c is not None for c in calls) else None


# -- the block formats: <tool_call>BODY</tool_call> anywhere in the reply -----------------------------------
def _hermes_calls(body: str, tools: dict[str, dict]) -> list[ToolCall] | None:
    """`{"name": ..., "arguments": {...}}` (or a list of them) between the tags."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return _all_or_none([_call_of_object(o, tools) for o in (obj if isinstance(obj, list) else [obj])])


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _tagged_items(pattern: re.Pattern, text: str) -> list[re.Match] | None:
    """The pattern's matches if only whitespace lies around and between them, else None."""
    matches, pos = [], 0
    for m in pattern.finditer(text):
        if text[pos:m.start()].strip():
            return None
        matches.append(m)
        pos = m.end()
    return None if text[pos:].strip() else matches


def _qwen3_xml_calls(body: str, tools: dict[str, dict]) -> list[ToolCall] | None:
    """`<function=NAME><parameter=KEY>VALUE</parameter>...</function>` between the tags."""
    functions = _tagged_items(_FUNCTION, body)
    if not functions:
        return None
    calls = []
    for function in functions:
        name = function.group(1).strip()
        parameters = _tagged_items(_PARAMETER, function.group(2))
        if name not in tools or parameters is None:
            return None
        properties = (tools[name] or {}).get("properties") or {}
        arguments = {p.group(1).strip(): _parameter_value(p.group(2), properties.get(p.group(1).strip()))
                     for p in parameters}
        calls.append(_checked_call(name, arguments, tools))
    return _all_or_none(calls)


def _parameter_value(raw: str, schema) -> object:
    """A parameter's text as its schema's type: strings as written, other types read as JSON when they parse,
    an enum's or const's member when the text is one written as call_grammar writes it."""
    value = raw.removeprefix("\n").removesuffix("\n")  # the newlines the format puts around a value
    schema = schema if isinstance(schema, dict) else {}
    members = [schema["const"]] if "const" in schema else schema.get("enum") or []
    for member in members:  # an enum's member as written: a string as it is, another value as JSON
        if value == (member if isinstance(member, str) else json.dumps(member)):
            return member
    types = schema.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    if not types or "string" in types:
        return value
    if "boolean" in types and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    try:
        return json.loads(value)
    except ValueError:
        return value


class _TaggedCalls:
    """Calls in `<tool_call>...</tool_call>` blocks anywhere in the reply; `read_block` reads one block's body."""

    def __init__(self, read_block: Callable[[str, dict], list[ToolCall] | None], tools: dict[str, dict],
                 parallel: bool):
        self._read_block = read_block
        self._tools = tools
        self._parallel = parallel
        self._buffer = ""         # undecided text; starts with OPEN_TAG while a block is open
        self._pending_ws = ""     # whitespace before the buffer: content, unless a call follows
        self._after_call = False  # whitespace right after a call is layout
        self._num_calls = 0

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[str | ToolCall]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[str | ToolCall]:
        events: list[str | ToolCall] = []
        while True:
            if self._buffer.startswith(OPEN_TAG):
                end = self._buffer.find(CLOSE_TAG, len(OPEN_TAG))
                if end < 0:
                    if final:  # never closed: the model's text as it is
                        self._content(events, self._buffer)
                        self._buffer = ""
                    return events
                block, self._buffer = self._buffer[:end + len(CLOSE_TAG)], self._buffer[end + len(CLOSE_TAG):]
                calls = self._read_block(block[len(OPEN_TAG):-len(CLOSE_TAG)], self._tools)
                if calls is None:
                    self._content(events, block)
                    continue
                for call in calls:
                    if self._parallel or self._num_calls == 0:
                        events.append(call)
                        self._num_calls += 1
                self._pending_ws, self._after_call = "", True
                continue
            start = self._buffer.find(OPEN_TAG)
            if start >= 0:
                self._text(events, self._buffer[:start], final=False)
                self._buffer = self._buffer[start:]
                continue
            keep = 0 if final else _partial_tail(self._buffer, OPEN_TAG)
            text, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
            self._text(events, text, final)
            return events

    def _text(self, events: list, text: str, final: bool) -> None:
        """Text outside any block: its trailing whitespace waits to see whether a call follows."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text, self._pending_ws = self._pending_ws + text, ""
        if not final:
            stripped = text.rstrip()
            text, self._pending_ws = stripped, text[len(stripped):]
        if text:
            events.append(text)

    def _content(self, events: list, block: str) -> None:
        """A block that is not a call: content as written, with the whitespace held before it."""
        events.append(self._pending_ws + block)
        self._pending_ws, self._after_call = "", False


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper start of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# -- the whole-reply format: Llama 3's JSON call -----------------------------------------------------------
class _WholeReplyJson:
    """The whole reply is the call(s): `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`,
    several separated by `;`. A reply that opens with anything but `{` is content, streamed as it comes."""

    def __init__(self, tools: dict[str, dict], parallel: bool):
        self._tools = tools
        self._parallel = parallel
        self._text = ""
        self._mode: str | None = None  # None until the first character decides: "json" or "content"

    def feed(self, text: str) -> list[str | ToolCall]:
        if self._mode == "content":
            return [text] if text else []
        self._text += text
        if self._mode is None:
            head = self._text.lstrip()
            if head.startswith(PYTHON_TAG):
                head = head[len(PYTHON_TAG):].lstrip()
            elif PYTHON_TAG.startswith(head):  # still empty, or maybe the tag
                return []
            if not head:
                return []
            self._mode = "json" if head[0] == "{" else "content"
            if self._mode == "content":
                text, self._text = self._text, ""
                return [text]
        return []

    def finish(self) -> list[str | ToolCall]:
        if self._mode == "content" or not self._text:
            return []
        calls = self._calls(self._text) if self._mode == "json" else None
        if calls is None:
            return [self._text]
        return calls if self._parallel else calls[:1]

    def _calls(self, text: str) -> list[ToolCall] | None:
        text = text.lstrip()
        text = text.removeprefix(PYTHON_TAG)
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while True:
            while pos < len(text) and (text[pos].isspace() or (calls and text[pos] == ";")):
                pos += 1
            if pos == len(text):
                return _all_or_none(calls)
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except ValueError:
                return None
            calls += [_call_of_object(o, self._tools) for o in (obj if isinstance(obj, list) else [obj])]
