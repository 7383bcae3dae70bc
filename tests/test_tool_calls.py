"""Tool calls: the parsers of `ovdflash.server.tool_calls` alone, then the server end to end with the official
`openai` client.

Checked, parsers: the format each family's chat template teaches is detected from its text; hermes, qwen3_xml
and llama3_json replies give the calls and content a client expects; malformed calls (invalid JSON, unknown
names, unclosed blocks, garbage) stay content character for character and never raise; parallel False keeps
the first call; a reply streamed in two pieces cut at every character, and one character at a time, gives
exactly the whole reply's content and calls, and holds back only what may still become a call; calls
(hermes and llama3_json written name first, qwen3_xml) stream their arguments in pieces that the completed
call begins with (qwen3_xml: string values as they come, other values whole), and a started call that
turns out malformed (fuzzed) leaves pieces that never parse, its text content.

Checked, served: on a deterministic stand-in for the model (`ScriptedBackend`: the reply is the test's,
the prompt is rendered by the real tokenizer and chat template), `message.tool_calls` (ids, names,
arguments), finish_reason "tool_calls", content outside the calls, parallel calls and parallel_tool_calls
false, garbage as content, the streamed deltas equal the whole answer; a long call streamed (hermes,
llama3_json and qwen3_xml) opens with index, id, type and name, then sends its arguments in several pieces that the
client's stream helper reassembles to the whole answer's call, content before it first; SERVING.md's agent
loop runs as written (a calculator call, its result sent back, the answer); earlier calls and tool results
rendered into the prompt; tool_choice "none" renders without parsing, "required" and a named function are a
400 naming tool_choice where they cannot be held (an unknown name, with response_format); a Llama-3 template
reads JSON replies. The qwen3_xml call grammar takes calls of the offered functions with their parameters
(required ones present, values of their schema's kind) and refuses the rest; what it takes parses to the
call. Where the tokenizer has `<tool_call>` as one added token, the call grammars (hermes, qwen3_xml) take
that token, and every token their mask allows on the way is one they take. On the real tiny pair with a
Qwen-style template: the tools reach the prompt (/tokenize, usage.prompt_tokens) and the reply is the
pipeline's own greedy text for that prompt, parsed; with the tiny pair's plain ChatML template (no tool
format) tools are a 400 unless tool_choice is "none"; tools, earlier calls and tool results render exactly as transformers'
apply_chat_template(tools=...) renders them; `ovdflash serve` prints the detected format at start-up.
"""
import functools
import json
import random
import shutil
from collections import deque
from types import SimpleNamespace

import pytest

from ovdflash.server.tool_calls import (
    ArgumentsDelta,
    CallStart,
    ParsedReply,
    ToolCall,
    detect_tool_format,
    new_parser,
    parse_reply,
)

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city, today and the next days",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                        "units": {"type": "object"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "description": "The current time",
                                      "parameters": {"type": "object", "properties": {}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def hermes_call(name, arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def xml_call(name: str, *parameters: tuple[str, str]) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


WEATHER = hermes_call("get_weather", {"city": "Paris", "days": 2})
NOW = hermes_call("now", {})
XML_WEATHER = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
               "</parameter>\n<parameter=units>\n{\"t\": \"C\"}\n</parameter>\n</function>\n</tool_call>")

# (format, reply, content, calls as (name, arguments object))
CASES = [
    ("hermes", WEATHER, None, [("get_weather", {"city": "Paris", "days": 2})]),
    ("hermes", "Let me check.\n" + WEATHER, "Let me check.", [("get_weather", {"city": "Paris", "days": 2})]),
    ("hermes", WEATHER + "\n" + NOW + "\n", None, [("get_weather", {"city": "Paris", "days": 2}), ("now", {})]),
    ("hermes", NOW + "\n\nDone, see above.", "Done, see above.", [("now", {})]),
    ("hermes", '<tool_call>\n{"name": "now", "arguments": "{}"}\n</tool_call>', None, [("now", {})]),
    ("hermes", '<tool_call>[{"name": "now", "arguments": {}}, {"name": "now"}]</tool_call>', None,
     [("now", {}), ("now", {})]),
    ("qwen3_xml", "I will look.\n\n" + XML_WEATHER, "I will look.",
     [("get_weather", {"city": "New York", "days": 3, "units": {"t": "C"}})]),
    ("qwen3_xml", "<tool_call>\n<function=now>\n</function>\n</tool_call>", None, [("now", {})]),
    ("qwen3_xml", ("<tool_call>\n<function=get_weather>\n<parameter=city>\nline one\nline two\n</parameter>\n"
                   "<parameter=days>\nsoon\n</parameter>\n</function>\n</tool_call>"), None,
     [("get_weather", {"city": "line one\nline two", "days": "soon"})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", {"city": "Oslo"})]),
    ("llama3_json", '<|python_tag|>{"name": "now", "parameters": {}}; {"name": "now", "arguments": {}}', None,
     [("now", {}), ("now", {})]),
    ("llama3_json", ' \n{"type": "function", "name": "now", "parameters": {}}\n', None, [("now", {})]),
]
# replies that hold no well-formed call: the content is the reply itself
PLAIN = [
    ("hermes", "Just text, with a < sign and <tool calls> mentioned.\n\n"),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>"),
    ("hermes", "<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {}}\n</tool_call>"),  # not one of the tools
    ("hermes", "<tool_call>\n{\"name\": \"now\", \"arguments\": [1, 2]}\n</tool_call>"),
    ("hermes", "<tool_call>\n{\"name\": \"now\", \"arguments\": {}, \"extra\": 1}\n</tool_call>"),
    ("hermes", "Sure.\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}"),  # never closed
    ("hermes", "</tool_call><tool_call><tool_call></tool_call>"),
    ("qwen3_xml", "<tool_call>\n<function=now>\nstray text\n</function>\n</tool_call>"),
    ("qwen3_xml", "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>"),
    ("qwen3_xml", "<tool_call>\n<function=nope>\n</function>\n</tool_call> trailing"),
    ("llama3_json", "The answer is {\"name\": \"now\", \"parameters\": {}}"),
    ("llama3_json", "{\"answer\": 42}"),
    ("llama3_json", "{\"name\": \"now\", \"parameters\": {}} and then some words"),
    ("llama3_json", "{\"name\": \"now\", \"parameters\": {"),
    ("llama3_json", "  \n"),
    ("llama3_json", "<|python_tag|>brave_search.call(query=\"x\")"),
]


def calls_of(reply):
    return [(c.name, json.loads(c.arguments)) for c in reply.tool_calls]


def parse(fmt, text, parallel=True):
    return parse_reply(new_parser(fmt, SCHEMAS, parallel), text)


def streamed(fmt, pieces, parallel=True):
    """(content, calls) of a reply fed in `pieces`, merged as a client merges the stream; the streamed
    arguments checked against the calls that complete them (check_started_calls)."""
    parser = new_parser(fmt, SCHEMAS, parallel)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    check_started_calls(events)
    content = "".join(e for e in events if isinstance(e, str))
    return content, [e for e in events if isinstance(e, ToolCall)]


def check_started_calls(events) -> dict[int, str]:
    """Each CallStart's arguments pieces come after it; the ToolCall that completes it begins with them; one
    never completed has pieces that never parse. The arguments sent by key."""
    sent: dict[int, str] = {}
    for event in events:
        if isinstance(event, CallStart):
            assert event.key not in sent and event.name in SCHEMAS
            sent[event.key] = ""
        elif isinstance(event, ArgumentsDelta):
            assert event.text
            sent[event.key] += event.text
        elif isinstance(event, ToolCall) and event.started is not None:
            assert event.arguments.startswith(sent.pop(event.started)) and event.arguments.endswith("}")
    for arguments in sent.values():  # started, never completed
        with pytest.raises(ValueError):
            json.loads(arguments)
    return sent


# -- detection -------------------------------------------------------------------------------------------------
QWEN25_TEMPLATE_EXCERPT = ('{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and '
                           'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
                           '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}')
QWEN35_TEMPLATE_EXCERPT = ("{{- '\\n\\nIf you choose to call a function ONLY reply in the following format with NO "
                           "suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>"
                           "\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>' }}")
LLAMA31_TEMPLATE_EXCERPT = ('{%- elif message.role == "tool" or message.role == "ipython" %}\n'
                            '{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}')
CHATML = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"


@pytest.mark.parametrize("template,expected", [
    (QWEN25_TEMPLATE_EXCERPT, "hermes"), (QWEN35_TEMPLATE_EXCERPT, "qwen3_xml"),
    (LLAMA31_TEMPLATE_EXCERPT, "llama3_json"), ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
    (CHATML, None), ("", None), (None, None),
], ids=["qwen2.5", "qwen3.5", "llama3.1", "python_tag", "chatml", "empty", "none"])
def test_the_tool_format_is_read_from_the_chat_template(template, expected):
    assert detect_tool_format(template) == expected


# -- whole replies ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_calls_and_content_of_a_whole_reply(fmt, text, content, calls):
    reply = parse(fmt, text)
    assert reply.content == content
    assert calls_of(reply) == calls
    assert all(json.loads(c.arguments) is not None and isinstance(json.loads(c.arguments), dict)
               for c in reply.tool_calls)


@pytest.mark.parametrize("fmt,text", PLAIN, ids=[f"{p[0]}-{i}" for i, p in enumerate(PLAIN)])
def test_a_reply_without_a_well_formed_call_is_its_own_content(fmt, text):
    reply = parse(fmt, text)
    assert reply.tool_calls == [] and reply.content == text


def test_parallel_false_keeps_only_the_first_call():
    for fmt, text in [("hermes", "a " + WEATHER + NOW), ("llama3_json", '{"name": "now"}; {"name": "get_weather"}')]:
        reply = parse(fmt, text, parallel=False)
        assert len(reply.tool_calls) == 1 and len(parse(fmt, text).tool_calls) == 2
        assert calls_of(reply)[0] == calls_of(parse(fmt, text))[0]


def test_garbage_never_raises_and_is_content_unless_it_holds_a_call():
    fragments = ["<tool_call>", "</tool_call>", "<tool_", "call>", "{", "}", "\"name\"", ": ", "\"now\"", ",",
                 "\"arguments\"", "{}", "\n", " ", "<function=now>", "</function>", "<parameter=x>", "</parameter>",
                 "<|python_tag|>", ";", "[", "]", "abc", "\u00e9\u4f60", "\ufffd", '{"name": "now", "arguments": ',
                 '{"name": "get_weather", "parameters": ', '"city": ', '"\\"', "\\"]
    rng = random.Random(0)
    for _ in range(400):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 14)))
        for fmt in ("hermes", "qwen3_xml", "llama3_json"):
            reply = parse(fmt, text)
            if not reply.tool_calls:
                assert reply.content == text, (fmt, text)
            cut = rng.randint(0, len(text))
            assert streamed(fmt, [text[:cut], text[cut:]]) == (reply.content or "", reply.tool_calls), (fmt, text)
            assert streamed(fmt, list(text)) == (reply.content or "", reply.tool_calls), (fmt, text)


# -- streaming -------------------------------------------------------------------------------------------------
ALL_REPLIES = [(c[0], c[1]) for c in CASES] + PLAIN


@pytest.mark.parametrize("fmt,text", ALL_REPLIES, ids=[f"{r[0]}-{i}" for i, r in enumerate(ALL_REPLIES)])
def test_streamed_in_any_two_pieces_or_char_by_char_equals_the_whole_reply(fmt, text):
    whole = parse(fmt, text)
    want = (whole.content or "", whole.tool_calls)
    for cut in range(len(text) + 1):
        assert streamed(fmt, [text[:cut], text[cut:]]) == want, cut
    assert streamed(fmt, list(text)) == want


def test_streaming_holds_back_only_what_may_become_a_call():
    parser = new_parser("hermes", SCHEMAS)
    assert parser.feed("Hello there") == ["Hello there"]    # plain text goes out at once
    assert parser.feed(" <tool") == []                       # may be the start of <tool_call>
    assert parser.feed("box> ok") == [" <toolbox> ok"]       # it was not
    assert parser.feed("\n<tool_call>\n{\"name\": \"now\",") == []
    assert parser.feed(" \"arguments\": {}}\n</tool_call>") == [ToolCall("now", "{}")]
    assert parser.feed("\n") == [] and parser.finish() == []  # layout after the call
    llama = new_parser("llama3_json", SCHEMAS)
    assert llama.feed("Sure") == ["Sure"] and llama.feed(", here") == [", here"]
    llama = new_parser("llama3_json", SCHEMAS)
    assert llama.feed('{"name": "now", ') == [] and llama.finish() == ['{"name": "now", ']


LONG_ARGUMENTS = {"city": "Saint-Pierre-et-Miquelon", "days": 7, "units": {"temperature": "C", "wind": "km/h"}}


def xml_weather(arguments: dict) -> str:
    values = {k: v if isinstance(v, str) else json.dumps(v) for k, v in arguments.items()}
    return xml_call("get_weather", *values.items())


@pytest.mark.parametrize("fmt,reply", [
    ("hermes", "Let me look that up.\n" + hermes_call("get_weather", LONG_ARGUMENTS) + "\n" + NOW),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(LONG_ARGUMENTS) + "}"),
    ("qwen3_xml", "Let me look that up.\n" + xml_weather(LONG_ARGUMENTS) + "\n" + xml_call("now")),
], ids=["hermes", "llama3_json", "qwen3_xml"])
def test_calls_stream_their_arguments_as_they_arrive(fmt, reply):
    """A call starts once its name is read, its arguments follow in pieces (all but the closing brace), and
    the call that completes it carries the rest; text before it went out as content."""
    parser = new_parser(fmt, SCHEMAS)
    events = [e for i in range(0, len(reply), 4) for e in parser.feed(reply[i:i + 4])] + parser.finish()
    check_started_calls(events)
    start = next(i for i, e in enumerate(events) if isinstance(e, CallStart))
    assert events[start].name == "get_weather"
    assert "".join(e for e in events[:start] if isinstance(e, str)) == (
        "" if fmt == "llama3_json" else "Let me look that up.")
    pieces = [e.text for e in events if isinstance(e, ArgumentsDelta) and e.key == events[start].key]
    assert len(pieces) > 10
    [call] = [e for e in events if isinstance(e, ToolCall) and e.started == events[start].key]
    assert call.arguments == "".join(pieces) + "}" and json.loads(call.arguments) == LONG_ARGUMENTS
    assert calls_of(parse_reply(new_parser(fmt, SCHEMAS), reply))[0] == ("get_weather", LONG_ARGUMENTS)
    # the same call cut short, or followed by what makes it no call: its text is content, its pieces never parse
    for broken in (reply[:-1] if fmt == "llama3_json" else reply[:reply.index("</tool_call>")],
                   reply + (" and more" if fmt == "llama3_json" else "")):
        if broken == reply:
            broken = reply.replace('"days": 7', '"days": 7 7') if fmt == "hermes" else \
                reply.replace("<parameter=units>", "oops <parameter=units>")
        parser = new_parser(fmt, SCHEMAS)
        events = [e for i in range(0, len(broken), 4) for e in parser.feed(broken[i:i + 4])] + parser.finish()
        assert len(check_started_calls(events)) == 1  # the first call: started, never completed
        whole = parse_reply(new_parser(fmt, SCHEMAS), broken)
        assert "".join(e for e in events if isinstance(e, str)) == (whole.content or "")
        assert [e for e in events if isinstance(e, ToolCall)] == whole.tool_calls


def test_calls_with_a_character_changed_stream_as_their_whole_reply_reads():
    """Valid calls with one character deleted, doubled or replaced, fed in random pieces: content and
    completed calls equal the whole reply's, and what a started call sent that never completed never parses."""
    rng = random.Random(1)
    replies = [("hermes", "Sure.\n" + hermes_call("get_weather", LONG_ARGUMENTS) + "\n" + NOW + "\nok"),
               ("llama3_json", '{"name": "get_weather", "parameters": ' + json.dumps(LONG_ARGUMENTS) + '}; '
                               '{"name": "now", "parameters": {}}'),
               ("qwen3_xml", "Sure.\n" + xml_weather({**LONG_ARGUMENTS, "city": "a\\b \"c\"\n\u00e9"}) + "\n"
                             + xml_call("now") + "\nok")]
    outcomes = set()
    for fmt, reply in replies:
        for _ in range(300):
            i = rng.randrange(len(reply))
            text = rng.choice([reply[:i] + reply[i + 1:], reply[:i] + reply[i] + reply[i:],
                               reply[:i] + rng.choice('{}[]",:\\ x\n') + reply[i + 1:]])
            cuts = sorted(rng.sample(range(len(text) + 1), 4))
            pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])] if rng.random() < 0.8 else list(text)
            whole = parse(fmt, text)
            assert streamed(fmt, pieces) == (whole.content or "", whole.tool_calls), (fmt, text)
            outcomes.add(len(whole.tool_calls))
    assert outcomes >= {0, 1, 2}  # broken, partly broken and intact replies were all met


def test_only_json_calls_written_name_first_stream():
    for fmt, reply in [("hermes", '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>'),
                       ("hermes", '<tool_call>[{"name": "now", "arguments": {}}]</tool_call>'),
                       ("hermes", '<tool_call>\n{"name": "now", "arguments": "{}"}\n</tool_call>'),
                       ("llama3_json", '{"type": "function", "parameters": {}, "name": "now"}')]:
        parser = new_parser(fmt, SCHEMAS)
        events = [e for ch in reply for e in parser.feed(ch)] + parser.finish()
        [call] = events
        assert isinstance(call, ToolCall) and call.started is None, (fmt, reply)
    # a repeated key contradicting the call's head, a repeated XML parameter: no call, the text is content
    for fmt, repeated in [("hermes", '<tool_call>\n{"name": "now", "arguments": {}, "arguments": {"x": 1}}\n</tool_call>'),
                          ("qwen3_xml", xml_call("get_weather", ("city", "Oslo"), ("city", "Rome")))]:
        assert parse(fmt, repeated) == ParsedReply(repeated, [])


def test_qwen3_xml_values_stream_as_text_or_whole_by_their_schema():
    """A string value streams as its characters arrive (the newlines the format puts around it and a tail
    that may be `</parameter>` held back); a value the schema reads as JSON, or an enum with non-string
    members, comes whole at `</parameter>`."""
    tools = {"f": {"type": "object", "properties": {"s": {"type": "string"}, "n": {"type": "integer"},
                                                     "e": {"enum": [1, "two"]}, "any": {}}}}
    parser = new_parser("qwen3_xml", tools)
    sent = []

    def feed(text):
        sent.extend(e.text for e in parser.feed(text) if isinstance(e, ArgumentsDelta))
        return "".join(sent)
    assert feed("<tool_call>\n<function=f>\n<parameter=s>\nab") == '{"s": "ab'
    assert feed("c\n</param") == '{"s": "abc'       # the newline and the tag's start wait
    assert feed("eter>\n<parameter=n>\n4") == '{"s": "abc", "n": '
    assert feed("2\n</parameter>\n<parameter=e>\n1\n</parameter>") == '{"s": "abc", "n": 42, "e": 1'
    assert feed("\n<parameter=any>\nx\ty\n</parameter>\n") == '{"s": "abc", "n": 42, "e": 1, "any": "x\\ty"'
    [call] = parser.feed("</function>\n</tool_call>")
    assert call.started == 0 and call.arguments == "".join(sent) + "}"
    assert json.loads(call.arguments) == {"s": "abc", "n": 42, "e": 1, "any": "x\ty"}


# -- served: a deterministic stand-in for the model --------------------------------------------------------------
# Qwen2.5's template in short (the tiny pair's tokenizer spends many tokens on its full instructions)
HERMES_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}
    {{- '\n</tools>\n\nCall a function as <tool_call>\n'
        + '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {{- '\n<tool_call>\n{"name": "' + tool_call.function.name + '", "arguments": '
                + tool_call.function.arguments | tojson + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if tools is not none %}
    {{- '<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' and tools is not none and loop.last %}
        {{- '<|start_header_id|>user<|end_header_id|>\n\n'
            + 'Respond with a JSON {"name": function name, "parameters": arguments}.\n\n' }}
        {%- for t in tools %}{{- t | tojson(indent=4) + '\n\n' }}{%- endfor %}
        {{- message.content + '<|eot_id|>' }}
    {%- elif message.role == 'tool' or message.role == 'ipython' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"""


# the same, teaching Qwen3.5's XML calls
XML_TEMPLATE = HERMES_TEMPLATE.replace('{"name": <function-name>, "arguments": <args-json-object>}',
                                       "<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>")


class ScriptedBackend:
    """Stands in for the model behind the real engine and app: each request's reply is the next of `replies`,
    else `reply` (set by the test before the request), sent `piece_chars` characters per step; `prompts` are
    the rendered prompts it got."""

    def __init__(self, tokenizer, piece_chars: int = 3, max_length: int = 4096):
        self.pipeline = SimpleNamespace(tokenizer=tokenizer, target=SimpleNamespace(max_length=max_length),
                                        vocab_size=tokenizer.vocab_size)
        self.reply, self.finish_reason, self.piece_chars = "", "stop", piece_chars
        self.replies: deque = deque()  # the next requests' replies, in turn, before `reply`
        self.prompts: list[str] = []
        self._running: deque = deque()  # [request id, reply, characters sent]

    @property
    def num_running(self) -> int:
        return len(self._running)

    num_waiting = 0

    def has_unfinished(self) -> bool:
        return bool(self._running)

    def add(self, request_id, prompt_ids, params):
        self.prompts.append(self.pipeline.tokenizer.decode(prompt_ids, skip_special_tokens=False))
        reply = self.replies.popleft() if self.replies else self.reply
        self._running.append([request_id, reply, 0])

    def abort(self, request_id):
        from ovdflash.decode.stats import GenerationStats
        from ovdflash.server.engine import RequestOutput

        self._running = deque(s for s in self._running if s[0] != request_id)
        return [RequestOutput(request_id, "", 0, True, "abort", GenerationStats())]

    def step(self):
        from ovdflash.decode.stats import GenerationStats
        from ovdflash.server.engine import RequestOutput

        outputs = []
        for seq in list(self._running):
            request_id, reply, sent = seq
            seq[2] = sent + self.piece_chars
            done = seq[2] >= len(reply)
            outputs.append(RequestOutput(request_id, reply[sent:seq[2]], min(seq[2], len(reply)), done,
                                         self.finish_reason if done else None, GenerationStats() if done else None))
            if done:
                self._running.remove(seq)
        return outputs


def serving(app):
    """The base URL of `app` served from a thread (test_serve.serving_app)."""
    from test_serve import serving_app  # tests/ is on sys.path under pytest

    return serving_app(app)


def scripted_app(template: str):
    """(app, backend) over the ScriptedBackend with a real tokenizer that renders `template`."""
    from ovdflash_export.tiny import train_tiny_tokenizer

    from ovdflash.server.app import build_app
    from ovdflash.server.engine import AsyncEngine
    from ovdflash.tokenizer import Tokenizer

    tokenizer = Tokenizer(train_tiny_tokenizer(512), chat_template=template, eos_token="<|im_end|>")
    backend = ScriptedBackend(tokenizer)
    return build_app(AsyncEngine(backend, max_model_len=4096), ["tiny"]), backend


@pytest.fixture(scope="module")
def scripted():
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    app, backend = scripted_app(HERMES_TEMPLATE)
    with serving(app) as url:
        yield SimpleNamespace(app=app, backend=backend, url=url,
                              client=openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60))


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def ask(scripted, reply, messages=ASK, **kwargs):
    scripted.backend.reply = reply
    kwargs.setdefault("tools", TOOLS)
    return scripted.client.chat.completions.create(model="tiny", messages=messages, **kwargs)


def ask_streamed(scripted, reply, **kwargs):
    """(content, [(id, name, arguments)], finish_reason, chunks) of a streamed answer, merged as clients merge it."""
    chunks = list(ask(scripted, reply, stream=True, **kwargs))
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, [None, "", ""])
            entry[0] = call.id or entry[0]
            entry[1] += call.function.name or ""
            entry[2] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish, chunks


def test_the_app_reports_the_detected_format(scripted):
    assert scripted.app.state.tool_format == "hermes"


def test_a_tool_call_reply_is_message_tool_calls(scripted):
    got = ask(scripted, WEATHER)
    choice = choice_of(got)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > len("call_") + 8
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert "get_weather" in scripted.backend.prompts[-1] and "<tools>" in scripted.backend.prompts[-1]


def choice_of(response):
    assert len(response.choices) == 1
    return response.choices[0]


def test_parallel_calls_content_and_parallel_tool_calls_false(scripted):
    reply = "Checking both.\n" + WEATHER + "\n" + NOW
    choice = choice_of(ask(scripted, reply))
    assert choice.message.content == "Checking both."
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather", "now"]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    single = choice_of(ask(scripted, reply, parallel_tool_calls=False))
    assert [c.function.name for c in single.message.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("reply", ["<tool_call>\n{\"name\": get_weather, }}\n</tool_call>",
                                   "<tool_call>\n{\"name\": \"delete_everything\", \"arguments\": {}}\n</tool_call>",
                                   "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}",
                                   "plain words, no calls \n"])
def test_garbage_from_the_model_is_plain_content(scripted, reply):
    choice = choice_of(ask(scripted, reply))
    assert choice.message.content == reply and not choice.message.tool_calls and choice.finish_reason == "stop"
    content, calls, finish, _ = ask_streamed(scripted, reply)
    assert (content, finish) == (reply, "stop")
    # only the unclosed call began streaming (its name was read): what it sent of its arguments never parses
    assert [name for _, name, _ in calls] == (["now"] if reply.startswith('<tool_call>\n{"name": "now"') else [])
    for _, _, arguments in calls:
        with pytest.raises(ValueError):
            json.loads(arguments)


@pytest.mark.parametrize("reply", [WEATHER, "Checking.\n" + WEATHER + "\n" + NOW + "\nDone.", "no call here",
                                   "<tool_call>{oops}</tool_call>" + NOW])
def test_the_streamed_deltas_equal_the_whole_answer(scripted, reply):
    whole = choice_of(ask(scripted, reply))
    content, calls, finish, chunks = ask_streamed(scripted, reply)
    assert content == (whole.message.content or "")
    assert [(name, args) for _, name, args in calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert all(call_id.startswith("call_") for call_id, _, _ in calls)
    assert finish == whole.finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"


def tool_call_deltas(chunks) -> list:
    return [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]


def check_streamed_arguments(client, **request):
    """A long call streamed to the official client: text before it comes as content first; its first delta
    has index, id, type, name and empty arguments, the later ones argument pieces only, more than one; the
    client's stream helper reassembles the non-streamed answer's call."""
    whole = choice_of(client.chat.completions.create(**request))
    [want] = whole.message.tool_calls
    chunks = list(client.chat.completions.create(stream=True, **request))
    first_call = next(i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.tool_calls)
    before = "".join(c.choices[0].delta.content or "" for c in chunks[:first_call] if c.choices)
    assert before == (whole.message.content or "")
    opening, *pieces = tool_call_deltas(chunks)
    assert (opening.index, opening.type, opening.function.name, opening.function.arguments) == \
        (0, "function", want.function.name, "") and opening.id.startswith("call_")
    assert len(pieces) > 1 and all(p.index == 0 and p.id is None and p.function.name is None for p in pieces)
    assert "".join(p.function.arguments for p in pieces) == want.function.arguments
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "tool_calls"

    with client.chat.completions.stream(**request) as stream:
        argument_events = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion().choices[0].message
    assert len(argument_events) > 1 and (final.content or "") == (whole.message.content or "")
    assert [(c.function.name, c.function.arguments) for c in final.tool_calls] == \
        [(want.function.name, want.function.arguments)]


def test_a_streamed_call_sends_its_arguments_in_pieces(scripted):
    scripted.backend.reply = "Let me look that up.\n" + hermes_call("get_weather", LONG_ARGUMENTS)
    check_streamed_arguments(scripted.client, model="tiny", messages=ASK, tools=TOOLS)


def test_a_streamed_qwen3_xml_call_sends_its_arguments_in_pieces():
    openai = pytest.importorskip("openai")
    app, backend = scripted_app(XML_TEMPLATE)
    assert app.state.tool_format == "qwen3_xml"
    with serving(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        backend.reply = "Let me look that up.\n" + xml_weather(LONG_ARGUMENTS)
        check_streamed_arguments(client, model="tiny", messages=ASK, tools=TOOLS)


def test_the_agent_loop_in_serving_md_runs(scripted, capsys):
    """SERVING.md's agent loop, as written, against the server: the model calls the calculator, gets its
    result as a tool message, and answers."""
    import pathlib
    import re

    serving_md = (pathlib.Path(__file__).parents[1] / "docs" / "SERVING.md").read_text()
    section = serving_md[serving_md.index("#### An agent loop"):]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    assert 'base_url="http://127.0.0.1:8000/v1"' in code
    code = code.replace("http://127.0.0.1:8000", scripted.url)
    scripted.backend.replies.extend([
        "I will compute it.\n" + hermes_call("calculator", {"expression": "17 * (3 + 4) - 5"}),
        "17 * (3 + 4) - 5 = 114."])
    before = len(scripted.backend.prompts)
    exec(compile(code, "SERVING.md", "exec"), {})
    assert capsys.readouterr().out == "17 * (3 + 4) - 5 = 114.\n"
    second = scripted.backend.prompts[before + 1]
    assert '"name": "calculator"' in second and "<tool_response>\n114\n</tool_response>" in second


def test_a_stream_cut_by_max_tokens_keeps_finish_reason_length(scripted):
    scripted.backend.finish_reason = "length"
    try:
        whole = choice_of(ask(scripted, WEATHER))
        assert whole.finish_reason == "length" and whole.message.tool_calls
    finally:
        scripted.backend.finish_reason = "stop"


def test_earlier_calls_and_tool_results_reach_the_prompt(scripted):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    choice = choice_of(ask(scripted, "It is sunny.", messages=history))
    assert choice.message.content == "It is sunny." and choice.finish_reason == "stop"
    prompt = scripted.backend.prompts[-1]
    # the arguments reach the template as an object (transformers' convention), not as a quoted JSON string
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in prompt


@pytest.mark.parametrize("messages,param", [
    ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": "x", "tool_call_id": "c"}], "messages[0].tool_call_id"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                            "function": {"name": "now", "arguments": "{oops"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                            "function": {"name": "now", "arguments": "[1]"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
], ids=["tool without id", "id on a user message", "arguments not JSON", "arguments not an object"])
def test_malformed_tool_messages_are_a_400_naming_the_field(scripted, messages, param):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        ask(scripted, "x", messages=messages)
    assert err.value.param == param and "\n" not in err.value.body["message"]


def test_tool_choice_none_renders_the_tools_and_does_not_parse(scripted):
    choice = choice_of(ask(scripted, WEATHER, tool_choice="none"))
    assert choice.message.content == WEATHER and not choice.message.tool_calls and choice.finish_reason == "stop"
    assert "get_weather" in scripted.backend.prompts[-1]


@pytest.mark.parametrize("tool_choice,extra,words", [
    ({"type": "function", "function": {"name": "rm_rf"}}, {}, "not one of the tools"),
    ("required", {"response_format": {"type": "json_object"}}, "cannot be combined with response_format"),
], ids=["unknown_name", "with_response_format"])
def test_a_tool_choice_that_cannot_be_held_is_a_400(scripted, tool_choice, extra, words):
    import openai

    before = len(scripted.backend.prompts)
    with pytest.raises(openai.BadRequestError) as err:
        ask(scripted, NOW, tool_choice=tool_choice, **extra)
    assert err.value.param == "tool_choice" and words in err.value.body["message"]
    assert len(scripted.backend.prompts) == before  # refused before it reached the engine


# a tool whose parameters take every kind of value the qwen3_xml grammar writes
XML_TOOLS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"enum": ["C", "F"]}, "level": {"enum": [1, 2]}, "opts": {"type": "object", "properties": {
            "a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}},
        "required": ["city", "days"]},
    "now": {"type": "object", "properties": {}},
    "note": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
}


@functools.lru_cache(maxsize=1)
def xml_tokenizer():
    from ovdflash_export.tiny import train_tiny_tokenizer

    from ovdflash.tokenizer import Tokenizer

    return Tokenizer(train_tiny_tokenizer(512), eos_token="<|im_end|>")


@pytest.mark.parametrize("text,arguments", [
    (xml_call("get_weather", ("city", "New York"), ("days", "3")), ("get_weather", {"city": "New York", "days": 3})),
    (xml_call("get_weather", ("city", "a\nb"), ("days", "7"), ("units", "F"), ("level", "2"), ("opts", '{"a": true}')),
     ("get_weather", {"city": "a\nb", "days": 7, "units": "F", "level": 2, "opts": {"a": True}})),
    (xml_call("now"), ("now", {})),
    (xml_call("note", ("text", "x < y </paramete")), ("note", {"text": "x < y </paramete"})),
    (xml_call("get_weather", ("days", "3")), None),  # a required parameter missing
    (xml_call("get_weather", ("city", "Oslo"), ("days", "9")), None),  # out of the integer's bounds
    (xml_call("get_weather", ("city", "A very long city"), ("days", "3")), None),  # past maxLength
    (xml_call("get_weather", ("city", "Oslo"), ("days", "3"), ("units", "K")), None),  # not in the enum
    (xml_call("get_weather", ("days", "3"), ("city", "Oslo")), None),  # not in the schema's order
    (xml_call("nope"), None),  # not one of the tools
    (xml_call("now", ("x", "1")), None),  # not one of its parameters
    (xml_call("note", ("text", "x</parameter>y")), None),  # a value holding the closing tag
    ("<tool_call>\n<function=now>\n</function>\n</tool_call>\n<tool_call>", None),  # a second call
], ids=["required", "every_kind", "no_parameters", "free_text", "missing_required", "bounds", "max_length",
        "enum", "order", "unknown_function", "unknown_parameter", "closing_tag_in_value", "two_calls"])
def test_the_qwen3_xml_call_grammar_holds_names_parameters_and_values(text, arguments):
    """What the grammar takes parses to the call with those arguments; what it refuses is not taken whole."""
    pytest.importorskip("llguidance")
    from ovdflash.grammar import grammar_state
    from ovdflash.server.tool_calls import call_grammar

    tokenizer = xml_tokenizer()
    eos = tokenizer.tokenizer.token_to_id("<|im_end|>")
    matcher = grammar_state(tokenizer, {"grammar": call_grammar("qwen3_xml", XML_TOOLS)}, 512, [eos]).matcher
    ids = tokenizer.encode(text)
    taken = matcher.consume(ids) == len(ids) and matcher.stopped
    assert taken == (arguments is not None), text
    if arguments is not None:
        assert calls_of(parse_reply(new_parser("qwen3_xml", XML_TOOLS), text)) == [arguments]


@functools.lru_cache(maxsize=1)
def tag_token_tokenizer():
    """The tiny tokenizer with `<tool_call>` and `</tool_call>` added as one token each, as Qwen's have them."""
    from tokenizers import AddedToken

    from ovdflash.tokenizer import Tokenizer

    tokenizer = xml_tokenizer().tokenizer.__class__.from_str(xml_tokenizer().tokenizer.to_str())
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in ("<tool_call>", "</tool_call>")])
    return Tokenizer(tokenizer, eos_token="<|im_end|>")


@pytest.mark.parametrize("tool_format,text", [
    ("hermes", hermes_call("get_weather", {"city": "Oslo", "days": 3})),
    ("qwen3_xml", xml_call("get_weather", ("city", "Oslo"), ("days", "3"))),
])
def test_a_call_grammar_writes_the_tags_as_the_tokenizer_has_them(tool_format, text):
    """Where `<tool_call>` is one added token, the grammar takes that token, and every token its mask allows on
    the way is one it takes (llguidance's mask allows the tag token at a quoted "<tool_call>" it then refuses)."""
    pytest.importorskip("llguidance")
    import numpy as np

    from ovdflash.grammar import grammar_state, special_tokens_among
    from ovdflash.server.tool_calls import CLOSE_TAG, OPEN_TAG, call_grammar

    tools = XML_TOOLS if tool_format == "qwen3_xml" else SCHEMAS
    for tokenizer, tags in ((xml_tokenizer(), frozenset()), (tag_token_tokenizer(), {OPEN_TAG, CLOSE_TAG})):
        eos = tokenizer.tokenizer.token_to_id("<|im_end|>")
        vocab = tokenizer.vocab_size
        special = special_tokens_among(tokenizer, (OPEN_TAG, CLOSE_TAG), vocab, [eos])
        assert special == tags
        ids = tokenizer.encode(text)
        assert (tokenizer.token_to_id(OPEN_TAG) in ids) == bool(tags)
        matcher = grammar_state(tokenizer, {"grammar": call_grammar(tool_format, tools, special)}, vocab, [eos]).matcher
        for i, token in enumerate(ids):
            allowed = np.flatnonzero(matcher.allowed())
            assert token in allowed, (tokenizer.decode(ids[:i], skip_special_tokens=False), token)
            for other in allowed:
                assert matcher.consume([int(other)]) == 1, (i, int(other))
                matcher.rollback(1)
            assert matcher.consume([token]) == 1
        assert matcher.stopped
        assert calls_of(parse_reply(new_parser(tool_format, tools), tokenizer.decode(ids))) == \
            calls_of(parse_reply(new_parser(tool_format, tools), text))


def test_a_llama3_template_reads_json_replies():
    openai = pytest.importorskip("openai")
    app, backend = scripted_app(LLAMA3_TEMPLATE)
    assert app.state.tool_format == "llama3_json"
    with serving(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        backend.reply = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
        choice = choice_of(client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS))
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
            [("get_weather", {"city": "Oslo"})]
        assert '"name": "get_weather"' in backend.prompts[-1] and "Environment: ipython" in backend.prompts[-1]
        backend.reply = "It is cold in Oslo."
        assert choice_of(client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS)).message.content \
            == "It is cold in Oslo."
        backend.reply = '<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(LONG_ARGUMENTS) + "}"
        check_streamed_arguments(client, model="tiny", messages=ASK, tools=TOOLS)


# -- served: the real tiny pair ----------------------------------------------------------------------------------
REAL_TOOLS = TOOLS[1:]  # one short tool: the tiny pair's context is small


def pair_with_template(tiny_pair, model_dir, template: str):
    """A copy of the tiny pair in `model_dir` whose chat template is `template`."""
    shutil.copytree(tiny_pair, model_dir)
    (model_dir / "chat_template.jinja").write_text(template)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return model_dir


@pytest.fixture(scope="module")
def hermes_pipe(tiny_pair, tmp_path_factory):
    """The tiny pair with a Qwen-style chat template that renders tools (the pair's own ChatML one does not)."""
    from ovdflash import DFlashPipeline

    model_dir = pair_with_template(tiny_pair, tmp_path_factory.mktemp("hermes") / "pair", HERMES_TEMPLATE)
    return DFlashPipeline.from_pretrained(model_dir, cache_dir=tmp_path_factory.mktemp("hermes_cache"))


@pytest.fixture(scope="module")
def real(hermes_pipe):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from ovdflash.server.wiring import build_server_app

    app = build_server_app(hermes_pipe, ["tiny"], block_size=4)
    with serving(app) as url:
        yield SimpleNamespace(app=app, url=url, pipe=hermes_pipe,
                              client=openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120))


def test_the_real_template_renders_the_tools_and_the_reply_is_the_pipelines(real):
    import httpx

    from ovdflash.server.tool_calls import new_parser as parser_for

    assert real.app.state.tool_format == "hermes"
    plain = httpx.post(real.url + "/tokenize", json={"messages": ASK}, timeout=60).json()
    with_tools = httpx.post(real.url + "/tokenize", json={"messages": ASK, "tools": REAL_TOOLS}, timeout=60).json()
    assert with_tools["count"] > plain["count"] + 20
    rendered = real.pipe.tokenizer.decode(with_tools["tokens"], skip_special_tokens=False)
    assert json.dumps(REAL_TOOLS[0]) in rendered and "What is the weather in Paris?" in rendered

    got = real.client.chat.completions.create(model="tiny", messages=ASK, tools=REAL_TOOLS, max_tokens=24,
                                              temperature=0)
    assert got.usage.prompt_tokens == with_tools["count"]
    want = real.pipe.generate(with_tools["tokens"], max_new_tokens=24, temperature=0.0, block_size=4)
    parsed = parse_reply(parser_for("hermes", {"now": SCHEMAS["now"]}), want.text)
    choice = choice_of(got)
    assert choice.message.content == parsed.content
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == \
        [(c.name, c.arguments) for c in parsed.tool_calls]
    assert got.usage.completion_tokens == len(want.token_ids)

    stream = real.client.chat.completions.create(model="tiny", messages=ASK, tools=REAL_TOOLS, max_tokens=24,
                                                 temperature=0, stream=True)
    streamed_text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed_text == (parsed.content or "")


def test_a_conversation_with_tool_results_runs_on_the_real_model(real):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "12:00"},
    ]
    import httpx

    tokens = httpx.post(real.url + "/tokenize", json={"messages": history, "tools": REAL_TOOLS}, timeout=60).json()
    rendered = real.pipe.tokenizer.decode(tokens["tokens"], skip_special_tokens=False)
    assert '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>' in rendered and "12:00" in rendered
    got = real.client.chat.completions.create(model="tiny", messages=history, tools=REAL_TOOLS, max_tokens=8,
                                              temperature=0)
    assert got.usage.prompt_tokens == tokens["count"] and got.choices[0].finish_reason in ("stop", "length")


@pytest.fixture(scope="module")
def chatml(tiny_pair, tmp_path_factory):
    """The tiny pair as exported: a ChatML template that teaches no tool format."""
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from ovdflash import DFlashPipeline
    from ovdflash.server.wiring import build_server_app

    pipe = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("chatml_cache"))
    app = build_server_app(pipe, ["tiny"], block_size=4)
    with serving(app) as url:
        yield SimpleNamespace(app=app, url=url, pipe=pipe,
                              client=openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120))


def test_tools_on_a_template_without_a_tool_format(chatml):
    import openai

    assert chatml.app.state.tool_format is None
    with pytest.raises(openai.BadRequestError) as err:
        chatml.client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=8)
    assert err.value.param == "tools" and 'tool_choice "none"' in err.value.body["message"]
    plain = chatml.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, temperature=0)
    rendered_only = chatml.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, temperature=0,
                                                          tools=TOOLS, tool_choice="none")
    assert rendered_only.choices[0].message.content == plain.choices[0].message.content
    assert rendered_only.usage.prompt_tokens == plain.usage.prompt_tokens  # ChatML ignores the tools


def test_serve_logs_the_tool_format_at_start_up(tiny_pair, monkeypatch):
    from click.testing import CliRunner

    from ovdflash.cli import main
    from ovdflash.server import app as app_module

    monkeypatch.setattr(app_module, "run_server", lambda *a, **k: None)
    result = CliRunner().invoke(main, ["serve", str(tiny_pair), "--port", "9"])
    assert result.exit_code == 0, result.output
    assert "tool calls: the chat template teaches no tool-call format" in result.output


def test_tools_and_tool_history_render_as_transformers_renders_them(hermes_pipe):
    """Our rendering of `tools`, assistant tool_calls and tool messages equals transformers'
    apply_chat_template(tools=...) on the same template (the test may import transformers; the runtime never does)."""
    transformers = pytest.importorskip("transformers")
    from ovdflash.server import protocol
    from ovdflash.tokenizer import Tokenizer

    history = [protocol.ChatMessage.model_validate(m) for m in ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]]
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    hf = transformers.AutoTokenizer.from_pretrained(str(hermes_pipe.model_dir))
    for template in (HERMES_TEMPLATE, LLAMA3_TEMPLATE):
        ours = Tokenizer.from_dir(hermes_pipe.model_dir)
        ours.chat_template = template
        for messages in (history[:1], history):
            rendered = protocol.template_messages(messages)
            for with_tools in (protocol.template_tools(tools), None):
                want = hf.apply_chat_template(rendered, tools=with_tools, chat_template=template, tokenize=False,
                                              add_generation_prompt=True)
                extra = {"tools": with_tools} if with_tools else {}
                assert ours.apply_chat_template(rendered, **extra) == want, (template[:20], len(messages), extra)
