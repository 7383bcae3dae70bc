"""Tool calls in a model's reply: which format a chat template teaches, and the parsers that turn the reply's
text into OpenAI `tool_calls`, whole or as it streams.

Contract:
- `detect_tool_format(chat_template) -> str | None`: the format the template teaches the model, read from its
  text: "qwen3_xml" (it mentions `<tool_call>` and `<function=`: Qwen3.5, Qwen3-Coder), "hermes" (`<tool_call>`
  around a JSON object: Qwen2.5, Qwen3), "llama3_json" (`<|python_tag|>` or the `ipython` role: Llama 3.1-3.3
  JSON calls), None when it teaches none of these. `describe_tool_format(format)` is the start-up line.
- `new_parser(format, tools, parallel=True)` -> a parser with `feed(text) -> [event]` as the reply streams
  in and `finish() -> [event]` at its end; an event is a `str` (content), a `ToolCall(name, arguments)` (a
  well-formed call, complete), or, for a call being streamed, `CallStart(key, name)` then
  `ArgumentsDelta(key, text)` pieces. `tools` maps each of the request's function names to its JSON-schema
  `parameters`. `parse_reply(parser, text)` feeds a fresh parser the whole reply at once; for any split of
  a reply the streamed content concatenates, and the streamed ToolCalls list, to its `ParsedReply`.
- A call is returned only when it is well formed: it names one of the request's tools and its arguments
  are a JSON object (`ToolCall.arguments` is that object as JSON text: as the model wrote it when the call
  is written name first, `{"name": ..., "arguments"|"parameters": {...}}`, else re-serialized). Anything
  else (invalid JSON, an unknown name, a `<tool_call>` never closed, a call repeating its name, arguments
  or a parameter) stays in the content exactly as the model wrote it, so a reply without a well-formed
  call comes back unchanged, character for character. Parsers never raise.
- Streamed arguments: once a call has named one of the tools, the parser sends `CallStart(key, name)` and
  then its arguments in `ArgumentsDelta` pieces as the text arrives, all but the closing brace. hermes and
  llama3_json: calls written name first, from where the arguments object opens, its text as written.
  qwen3_xml: from `<function=NAME>`, the object `_qwen3_xml_calls` builds: `{`, each parameter's
  `"KEY": ` once its tag is read, a value its schema takes as text (no type, or "string", and no
  non-string enum / const member) JSON-escaped as its characters come, any other value whole at its
  `</parameter>`. The `ToolCall` that completes a started call has `started == key` and arguments that
  begin with the pieces sent. A started call that turns out malformed, or never ends, gets no `ToolCall`:
  its text comes as content as above, and what was sent of its arguments lacks the closing brace, so it
  never parses. Other calls (hermes lists, other key orders) come whole as a `ToolCall` with `started`
  None; with parallel False only a reply's first call streams.
- Whitespace between content and a call, between calls and after the last call is layout, not content;
  `ParsedReply.content` is None when a reply holds calls and nothing else. parallel False: only the first
  call is returned, later ones are dropped.
- `call_grammar(format, tools, special=()) -> str | None`: a Lark grammar (llguidance's syntax) whose only sentences
  are one call, in `format`'s layout, of one of `tools` (name -> JSON-schema parameters); what tool_choice
  "required" or a named function holds the reply to, and its reply parses to that call (None for an unknown
  format). The tags in `special` (`<tool_call>`, `</tool_call>` where the tokenizer has them as one special
  token, `grammar.special_tokens_among`) are that token, as the tokenizer writes them; the others are text.
  hermes and llama3_json: the call is `%json`, arguments valid against the tool's schema, laid out
  as json.dumps writes it (as templates render calls). qwen3_xml: `<function=NAME>` one of the tools, then
  the schema's properties in the schema's order, each `<parameter=KEY>\nVALUE\n</parameter>\n`, required
  ones always, the others optional, no others; a value is one of its enum / const members when the schema
  lists them, free text without `</parameter>` when it may be a string (a string's own constraints, such as
  pattern, are not held; its minLength / maxLength are), else JSON valid against its schema. Limits: the
  properties come in the schema's order, only the listed ones (a schema that allows others gets none), and
  keywords across properties (dependentRequired, if / then) are not held.
- Streaming holds back only text that may still turn out to be a call: a tail that may be the start of
  `<tool_call>` and whitespace that may precede one (until the next text decides), an open `<tool_call>`
  block (until its `</tool_call>`; its arguments stream as above meanwhile), and for llama3_json a reply
  that opens with `{` (until it ends; each call's arguments stream meanwhile).
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
    started: int | None = field(default=None, compare=False)  # the key of the CallStart it completes


@dataclass(frozen=True)
class CallStart:
    """A call of `name` has begun; its arguments follow as ArgumentsDelta pieces of the same `key`."""
    key: int
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    key: int
    text: str


@dataclass(frozen=True)
class ParsedReply:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


Event = str | ToolCall | CallStart | ArgumentsDelta


class ToolCallParser(Protocol):
    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


def call_grammar(tool_format: str, tools: dict[str, dict], special=()) -> str | None:
    """The grammar of one well-formed call of one of `tools` (module contract)."""
    # llguidance matches a special token only where the grammar names it, never inside a quoted literal
    call_open = f"{OPEN_TAG} {json.dumps(NEWLINE)}" if OPEN_TAG in special else json.dumps(OPEN_TAG + NEWLINE)
    call_close = f"{json.dumps(NEWLINE)} {CLOSE_TAG}" if CLOSE_TAG in special else json.dumps(NEWLINE + CLOSE_TAG)
    if tool_format == "qwen3_xml":
        return _qwen3_xml_grammar(tools, call_open, call_close)
    arguments_key = {"hermes": "arguments", "llama3_json": "parameters"}.get(tool_format)
    if arguments_key is None:
        return None
    calls = [{"type": "object", "properties": {"name": {"const": name},
                                               arguments_key: parameters or {"type": "object"}},
              "required": ["name", arguments_key], "additionalProperties": False}
             for name, parameters in tools.items()]
    call = f"call: %json {json.dumps({'x-guidance': _JSON_LAYOUT, 'anyOf': calls})}"
    if tool_format == "hermes":
        return f"start: {call_open} call {call_close}\n{call}"
    return f"start: call\n{call}"


# JSON laid out as chat templates render it (`tojson`, json.dumps' separators), and no other whitespace
_JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def _qwen3_xml_grammar(tools: dict[str, dict], call_open: str, call_close: str) -> str:
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
        return _TaggedCalls(_hermes_calls, tools, parallel, _JsonBlock)
    if tool_format == "qwen3_xml":
        return _TaggedCalls(_qwen3_xml_calls, tools, parallel, _XmlBlock)
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


# a call written name first, up to where its arguments object opens: the arguments can stream from here
_WS = r"[ \t\n\r]*"
_CALL_HEADER = re.compile(rf'{_WS}\{{{_WS}(?:"type"{_WS}:{_WS}"function"{_WS},{_WS})?"name"{_WS}:{_WS}'
                          rf'("(?:[^"\\\x00-\x1f]|\\.)*"){_WS},{_WS}"(?:arguments|parameters)"{_WS}:{_WS}(?=\{{)')


def _header_window(tools: dict[str, dict]) -> int:
    """How far into a call its header may end (beyond it, the call is read whole)."""
    return 128 + 8 * max((len(name) for name in tools), default=0)


class _Span:
    """Where the JSON object or array opening at `start` closes, read as its text arrives (strings and
    escapes skipped, brackets counted); `end` is the index after its closing bracket once seen."""

    def __init__(self, start: int):
        self.pos, self.depth, self.in_string, self.escape = start, 0, False, False
        self.end: int | None = None

    def advance(self, text: str) -> int | None:
        i = self.pos
        while self.end is None and i < len(text):
            c = text[i]
            i += 1
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.end = i
        self.pos = i
        return self.end


def _header_name(header: re.Match) -> str | None:
    try:
        return json.loads(header.group(1))
    except ValueError:
        return None


def _call_of_text(text: str, obj, tools: dict[str, dict]) -> ToolCall | None:
    """The call `text` (one JSON object, `obj` its value) holds. Written name first, its arguments are their
    text as written (what a stream sends piece by piece); an object whose header disagrees with its value
    (a repeated key) is no call."""
    call = _call_of_object(obj, tools)
    header = _CALL_HEADER.match(text)
    if call is None or header is None:
        return call
    end = _Span(header.end()).advance(text)
    arguments = text[header.end():end] if end is not None else ""
    value = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    try:
        same = _header_name(header) == call.name and json.loads(arguments) == value
    except ValueError:
        same = False
    return ToolCall(call.name, arguments) if same else None


class _Started:
    """A call being streamed: its key, name and the arguments' text sent so far."""

    def __init__(self, key: int, name: str):
        self.key, self.name, self.sent = key, name, ""

    def send(self, piece: str) -> list[ArgumentsDelta]:
        self.sent += piece
        return [ArgumentsDelta(self.key, piece)] if piece else []

    def complete(self, call: ToolCall) -> ToolCall:
        """`call` as the completion of this stream, when what was sent begins its arguments."""
        if call.name == self.name and call.arguments.startswith(self.sent):
            return ToolCall(call.name, call.arguments, self.key)
        return call


class _ArgumentsStream(_Started):
    """A JSON call's arguments as they arrive: the text from `start` up to (not including) their closing brace,
    which waits until the call is known to be well formed (so a call that never is has arguments that never
    parse)."""

    def __init__(self, key: int, name: str, start: int):
        super().__init__(key, name)
        self.span = _Span(start)
        self.sent_to = start  # the arguments' text before this index has been sent

    def delta(self, text: str) -> list[ArgumentsDelta]:
        end = self.span.advance(text)
        upto = end - 1 if end is not None else len(text)
        if upto <= self.sent_to:
            return []
        piece, self.sent_to = text[self.sent_to:upto], upto
        return self.send(piece)


class _JsonBlock:
    """A hermes block's call as it arrives: CallStart once its header names a tool, then its arguments."""

    def __init__(self, tools: dict[str, dict], limit: float, key: int):
        self.tools, self.key = tools, key
        self.window = _header_window(tools)
        self.arguments: _ArgumentsStream | None = None
        self.whole = limit < 1  # read whole, at the closing tag

    @property
    def num_started(self) -> int:
        return int(self.arguments is not None)

    def events(self, text: str) -> list[Event]:
        if self.arguments is not None:
            return self.arguments.delta(text)
        if self.whole:
            return []
        header = _CALL_HEADER.match(text, len(OPEN_TAG))
        if header is None:
            self.whole = len(text) > len(OPEN_TAG) + self.window
            return []
        name = _header_name(header)
        if name not in self.tools:
            self.whole = True
            return []
        self.arguments = _ArgumentsStream(self.key, name, header.end())
        return [CallStart(self.key, name)] + self.arguments.delta(text)

    def complete(self, calls: list[ToolCall]) -> list[ToolCall]:
        return [self.arguments.complete(calls[0])] if self.arguments is not None and len(calls) == 1 else calls


_FUNCTION_OPEN, _FUNCTION_CLOSE = "<function=", "</function>"
_PARAMETER_OPEN, _PARAMETER_CLOSE = "<parameter=", "</parameter>"


class _XmlBlock:
    """A qwen3_xml block's calls as they arrive: CallStart at each `<function=NAME>` of a tool, then its
    arguments object as `_qwen3_xml_calls` builds it: `{`, each parameter's `"KEY": ` once its tag is read,
    then its value, a string's characters as they come (JSON-escaped; the newlines around it and a tail that
    may be `</parameter>` held back), any other value whole at `</parameter>`; the closing brace comes with
    the completed call. Text that would make the block no call stops the streaming (the block is then
    decided whole, at its closing tag)."""

    def __init__(self, tools: dict[str, dict], limit: float, key: int):
        self.tools, self.limit, self.key = tools, limit, key
        self.pos = len(OPEN_TAG)
        self.state = "functions"  # between functions; "parameters": in one; "value": in a parameter; "stopped"
        self.calls: list[_Started] = []  # the block's functions so far, each streamed
        self.keys: set[str] = set()      # the open function's parameters so far
        self.schema: dict = {}           # the open parameter's
        self.as_text = False             # its value streams as text
        self.value_start = self.value_from = self.value_sent = 0

    @property
    def num_started(self) -> int:
        return len(self.calls)

    def events(self, text: str) -> list[Event]:
        events: list[Event] = []
        while self.state != "stopped":
            if self.state == "value":
                if not self._value(text, events):
                    break
                continue
            rest = text[self.pos:]
            head = rest.lstrip()
            self.pos += len(rest) - len(head)
            if not head:
                break
            if self.state == "parameters" and head.startswith(_FUNCTION_CLOSE):
                self.pos += len(_FUNCTION_CLOSE)
                self.state = "functions"
                continue
            tag = _FUNCTION_OPEN if self.state == "functions" else _PARAMETER_OPEN
            end, newline = head.find(">", len(tag)), head.find("\n", len(tag))
            if not head.startswith(tag) or 0 <= newline < (end if end >= 0 else len(head)):
                could_be = tag.startswith(head) or (self.state == "parameters" and _FUNCTION_CLOSE.startswith(head))
                if not could_be or newline >= 0:
                    self.state = "stopped"
                break
            if end < 0:
                break
            self.pos += end + 1
            name = head[len(tag):end].strip()
            if self.state == "functions":
                self._function(name, events)
            else:
                self._parameter(name, events)
        return events

    def _function(self, name: str, events: list) -> None:
        if name not in self.tools or len(self.calls) >= self.limit:
            self.state = "stopped"
            return
        call = _Started(self.key + len(self.calls), name)
        self.calls.append(call)
        self.keys, self.state = set(), "parameters"
        events += [CallStart(call.key, name)] + call.send("{")

    def _parameter(self, key: str, events: list) -> None:
        if not key or key in self.keys:  # a parameter given twice makes no call
            self.state = "stopped"
            return
        call = self.calls[-1]
        properties = (self.tools[call.name] or {}).get("properties") or {}
        schema = properties.get(key) if isinstance(properties, dict) else None
        self.schema = schema if isinstance(schema, dict) else {}
        self.as_text = _value_is_text(self.schema)
        opening = (", " if self.keys else "") + json.dumps(key, ensure_ascii=False) + ": " + ('"' if self.as_text else "")
        self.keys.add(key)
        events += call.send(opening)
        self.state, self.value_start, self.value_from = "value", self.pos, -1

    def _value(self, text: str, events: list) -> bool:
        """The open parameter's value as far as it arrived; True once its `</parameter>` did."""
        call = self.calls[-1]
        close = text.find(_PARAMETER_CLOSE, self.value_start)
        function_close = text.find(_FUNCTION_CLOSE, self.value_start)
        if 0 <= function_close and (close < 0 or function_close < close):  # the function ends inside the value
            self.state = "stopped"
            return False
        if self.as_text and self.value_from < 0 and len(text) > self.value_start:
            self.value_from = self.value_sent = self.value_start + (text[self.value_start] == "\n")
        if close < 0:
            if self.as_text and self.value_from >= 0:
                upto = len(text) - max(_partial_tail(text, _PARAMETER_CLOSE), _partial_tail(text, _FUNCTION_CLOSE))
                if upto > self.value_sent and text[upto - 1] == "\n":
                    upto -= 1  # it may be the newline before `</parameter>`
                if upto > self.value_sent:
                    events += call.send(_json_text(text[self.value_sent:upto]))
                    self.value_sent = upto
            return False
        raw = text[self.value_start:close]
        if self.as_text:
            value = raw.removeprefix("\n").removesuffix("\n")
            sent = max(self.value_sent - self.value_from, 0) if self.value_from >= 0 else 0
            events += call.send(_json_text(value[sent:]) + '"')
        else:
            events += call.send(json.dumps(_parameter_value(raw, self.schema), ensure_ascii=False))
        self.pos, self.state = close + len(_PARAMETER_CLOSE), "parameters"
        return True

    def complete(self, calls: list[ToolCall]) -> list[ToolCall]:
        return [self.calls[i].complete(call) if i < len(self.calls) else call for i, call in enumerate(calls)]


def _json_text(text: str) -> str:
    """`text` as it stands inside a JSON string (json.dumps escapes each character on its own)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _value_is_text(schema: dict) -> bool:
    """Whether _parameter_value gives a value's text itself under `schema` (so it can stream as it comes)."""
    types = _types(schema)
    return all(isinstance(m, str) for m in _members(schema)) and (not types or "string" in types)


def _members(schema: dict) -> list:
    members = [schema["const"]] if "const" in schema else schema.get("enum") or []
    return members if isinstance(members, list) else []


def _types(schema: dict) -> list:
    types = schema.get("type")
    return [types] if isinstance(types, str) else list(types) if isinstance(types, list) else []


# -- the block formats: <tool_call>BODY</tool_call> anywhere in the reply -----------------------------------
def _hermes_calls(body: str, tools: dict[str, dict]) -> list[ToolCall] | None:
    """`{"name": ..., "arguments": {...}}` (or a list of them) between the tags."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if isinstance(obj, list):
        return _all_or_none([_call_of_object(o, tools) for o in obj])
    return _all_or_none([_call_of_text(body, obj, tools)])


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
        properties = properties if isinstance(properties, dict) else {}
        arguments = {p.group(1).strip(): _parameter_value(p.group(2), properties.get(p.group(1).strip()))
                     for p in parameters}
        if len(arguments) < len(parameters):  # a parameter given twice
            return None
        calls.append(_checked_call(name, arguments, tools))
    return _all_or_none(calls)


def _parameter_value(raw: str, schema) -> object:
    """A parameter's text as its schema's type: strings as written, other types read as JSON when they parse,
    an enum's or const's member when the text is one written as call_grammar writes it."""
    value = raw.removeprefix("\n").removesuffix("\n")  # the newlines the format puts around a value
    schema = schema if isinstance(schema, dict) else {}
    for member in _members(schema):  # an enum's member as written: a string as it is, another value as JSON
        if value == (member if isinstance(member, str) else json.dumps(member)):
            return member
    types = _types(schema)
    if not types or "string" in types:
        return value
    if "boolean" in types and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    try:
        return json.loads(value)
    except ValueError:
        return value


class _TaggedCalls:
    """Calls in `<tool_call>...</tool_call>` blocks anywhere in the reply; `read_block` reads one block's body,
    `new_block_stream(tools, limit, first_key)` streams an open block's calls (at most `limit` of them)."""

    def __init__(self, read_block: Callable[[str, dict], list[ToolCall] | None], tools: dict[str, dict],
                 parallel: bool, new_block_stream: Callable | None = None):
        self._read_block = read_block
        self._tools = tools
        self._parallel = parallel
        self._buffer = ""         # undecided text; starts with OPEN_TAG while a block is open
        self._pending_ws = ""     # whitespace before the buffer: content, unless a call follows
        self._after_call = False  # whitespace right after a call is layout
        self._num_calls = 0
        self._new_block_stream = new_block_stream
        self._block_stream = None  # the open block's, once it opened
        self._num_started = 0

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if self._buffer.startswith(OPEN_TAG):
                end = self._buffer.find(CLOSE_TAG, len(OPEN_TAG))
                if end < 0:
                    if final:  # never closed: the model's text as it is
                        self._content(events, self._buffer)
                        self._buffer, self._block_stream = "", None
                    elif self._new_block_stream is not None:
                        if self._block_stream is None:
                            limit = float("inf") if self._parallel else int(self._num_calls == 0)
                            self._block_stream = self._new_block_stream(self._tools, limit, self._num_started)
                        events += self._block_stream.events(self._buffer)
                    return events
                block, self._buffer = self._buffer[:end + len(CLOSE_TAG)], self._buffer[end + len(CLOSE_TAG):]
                calls = self._read_block(block[len(OPEN_TAG):-len(CLOSE_TAG)], self._tools)
                stream, self._block_stream = self._block_stream, None
                if stream is not None:
                    self._num_started += stream.num_started
                if calls is None:
                    self._content(events, block)
                    continue
                if stream is not None:
                    calls = stream.complete(calls)
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
    several separated by `;`. A reply that opens with anything but `{` is content, streamed as it comes; one
    that opens with `{` is decided at its end, each call's arguments streaming meanwhile."""

    def __init__(self, tools: dict[str, dict], parallel: bool):
        self._tools = tools
        self._parallel = parallel
        self._header_window = _header_window(tools)
        self._text = ""
        self._mode: str | None = None  # None until the first character decides: "json" or "content"
        self._pos = 0             # where the streamed read stands between objects
        self._object: _Span | None = None  # the object being read, opening at _object_start
        self._object_start = 0
        self._arguments: _ArgumentsStream | None = None  # its call, once its header is read
        self._whole_object = False  # it is read whole, at the reply's end
        self._started: dict[int, _ArgumentsStream] = {}  # the streamed calls, by where their object opens
        self._num_objects = 0
        self._streaming = True    # False once the reply holds something else than call objects

    def feed(self, text: str) -> list[Event]:
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
            self._pos = _calls_start(self._text)
        return self._stream()

    def finish(self) -> list[Event]:
        if self._mode == "content" or not self._text:
            return []
        calls = self._calls(self._text) if self._mode == "json" else None
        if calls is None:
            return [self._text]
        return calls if self._parallel else calls[:1]

    def _stream(self) -> list[Event]:
        """Each call object's CallStart and arguments as they arrive (the calls themselves wait for the end)."""
        events: list[Event] = []
        text = self._text
        while self._streaming:
            if self._object is None:
                pos = self._pos
                while pos < len(text) and (text[pos].isspace() or (self._num_objects and text[pos] == ";")):
                    pos += 1
                self._pos = pos
                if pos == len(text):
                    break
                if text[pos] != "{":
                    self._streaming = False
                    break
                self._object, self._object_start = _Span(pos), pos
                self._arguments, self._whole_object = None, False
            if self._arguments is None and not self._whole_object:
                self._read_header(events)
            if self._arguments is not None:
                events += self._arguments.delta(text)
            end = self._object.advance(text)
            if end is None:
                break
            self._object, self._arguments, self._pos = None, None, end
            self._num_objects += 1
        return events

    def _read_header(self, events: list) -> None:
        start = self._object_start
        header = _CALL_HEADER.match(self._text, start)
        if header is None:
            self._whole_object = len(self._text) > start + self._header_window
            return
        name = _header_name(header)
        if name not in self._tools or not (self._parallel or self._num_objects == 0):
            self._whole_object = True
            return
        self._arguments = _ArgumentsStream(len(self._started), name, header.end())
        self._started[start] = self._arguments
        events.append(CallStart(self._arguments.key, name))

    def _calls(self, text: str) -> list[ToolCall] | None:
        decoder, calls, pos = json.JSONDecoder(), [], _calls_start(text)
        while True:
            while pos < len(text) and (text[pos].isspace() or (calls and text[pos] == ";")):
                pos += 1
            if pos == len(text):
                return _all_or_none(calls)
            start = pos
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except ValueError:
                return None
            if isinstance(obj, list):
                calls += [_call_of_object(o, self._tools) for o in obj]
                continue
            call = _call_of_text(text[start:pos], obj, self._tools)
            started = self._started.get(start)
            calls.append(started.complete(call) if call is not None and started is not None else call)


def _calls_start(text: str) -> int:
    """Where a llama3_json reply's calls begin: after leading whitespace and `<|python_tag|>`."""
    start = len(text) - len(text.lstrip())
    return start + len(PYTHON_TAG) if text.startswith(PYTHON_TAG, start) else start
