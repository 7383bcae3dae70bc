"""Structured outputs end to end: the official `openai` client against the app over the real tiny pair.

Checked, one request at a time and batched: a chat with `response_format` json_schema gets content that
parses and validates against the schema (jsonschema), streamed or whole, with `usage.spec_decode` showing
drafted rounds, while the same request without it does not validate; json_object gives a JSON object;
vLLM's `structured_outputs` regex, choice and a Lark grammar on completions give text that matches; an
invalid schema, regex or grammar, a regex feature llguidance lacks (look-ahead, a backreference: the cause
named), two constraints at once, or a json_schema without its schema is a 400 naming the field in one
line; /metrics counts the structured requests by kind. With a hermes chat template, tool_choice
"required" or a named function gives one call of those tools whose arguments validate against its schema,
where "auto" gives none.
"""
import json
import re
from types import SimpleNamespace

import pytest

from test_tool_calls import hermes_pipe  # noqa: F401  (the tiny pair with a template that teaches tool calls)

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "rain": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
          "required": ["city", "rain", "level"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}  # a random model would pad with whitespace for ever
MESSAGES = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}


def validates(text: str | None) -> bool:
    try:
        jsonschema.validate(json.loads(text or ""), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module", params=[1, 4], ids=["sequential", "batched"])
def served(request, tiny_pair, tmp_path_factory):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from test_tool_calls import serving  # tests/ is on sys.path under pytest

    from ovdflash import DFlashPipeline
    from ovdflash.server.wiring import build_server_app

    pipe = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("structured_cache"))
    with serving(build_server_app(pipe, ["tiny"], block_size=4, max_num_seqs=request.param)) as url:
        yield SimpleNamespace(url=url, client=openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                                            timeout=120))


def chat(served, **kwargs):
    kwargs = {"max_tokens": 80, "temperature": 0, **kwargs}
    return served.client.chat.completions.create(model="tiny", messages=MESSAGES, **kwargs)


def test_a_json_schema_reply_validates_and_the_unconstrained_one_does_not(served):
    reply = chat(served, response_format=JSON_SCHEMA_FORMAT)
    assert validates(reply.choices[0].message.content), reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    spec_decode = reply.usage.model_extra["spec_decode"]
    assert spec_decode["num_drafts"] > 0 and spec_decode["num_accepted_tokens"] >= 0
    assert not validates(chat(served).choices[0].message.content)
    sampled = [chat(served, response_format=JSON_SCHEMA_FORMAT, temperature=1.0, seed=s).choices[0].message.content
               for s in range(3)]
    assert all(validates(text) for text in sampled), sampled


def test_a_streamed_json_schema_reply_is_the_whole_one_in_pieces(served):
    whole = chat(served, response_format=JSON_SCHEMA_FORMAT).choices[0].message.content
    pieces = [chunk.choices[0].delta.content or "" for chunk in
              chat(served, response_format=JSON_SCHEMA_FORMAT, stream=True) if chunk.choices]
    assert "".join(pieces) == whole and validates(whole)


def test_json_object_gives_an_object(served):
    reply = chat(served, response_format={"type": "json_object"}, max_tokens=200)
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # the budget ran out inside the object: what came is still its start
        assert reply.choices[0].message.content.startswith("{")


LARK = 'start: day " " sky\nday: "mon" | "tue" | NUM\nsky: "sunny" | "rainy"\nNUM: /[0-9]{1,2}/'


def test_structured_outputs_regex_choice_and_grammar_on_completions(served):
    for body, fits in (({"regex": "[a-c]{2,4}-[0-9]{3}"}, lambda t: re.fullmatch("[a-c]{2,4}-[0-9]{3}", t)),
                       ({"choice": ["sunny", "rainy", "windy"]}, lambda t: t in ("sunny", "rainy", "windy")),
                       ({"grammar": LARK}, lambda t: re.fullmatch("(mon|tue|[0-9]{1,2}) (sunny|rainy)", t))):
        for seed in range(3):
            reply = served.client.completions.create(model="tiny", prompt="The weather today is", max_tokens=30,
                                                     temperature=1.0, seed=seed,
                                                     extra_body={"structured_outputs": body})
            assert reply.choices[0].finish_reason == "stop" and fits(reply.choices[0].text), reply.choices[0].text


@pytest.mark.parametrize("kwargs,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"regex": "[a-z]+(?=!)"}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"regex": "(a|b)c\\1"}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: undefined_rule"}}}, "structured_outputs.grammar"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
     "structured_outputs"),
], ids=["schema", "no_schema", "regex", "regex_lookahead", "regex_backreference", "grammar", "two_kinds",
        "both_fields"])
def test_a_bad_constraint_is_a_400_naming_its_field(served, kwargs, param):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        chat(served, **kwargs)
    assert err.value.param == param
    assert param in err.value.body["message"] and "\n" not in err.value.body["message"]
    if "(?=" in str(kwargs) or "\\1" in str(kwargs):  # a feature llguidance lacks: the cause is named
        assert "not supported" in err.value.body["message"], err.value.body["message"]


def test_metrics_count_structured_requests_by_kind_and_forced_tokens(served):
    import httpx

    def count(kind):
        text = httpx.get(served.url + "/metrics").text
        found = re.search(r'ovdflash:structured_requests_total\{kind="%s",model_name="tiny"\} ([0-9.]+)' % kind, text)
        return float(found.group(1)) if found else 0.0

    def forced():
        text = httpx.get(served.url + "/metrics").text
        found = re.search(r'ovdflash:spec_decode_num_forced_draft_tokens_total\{model_name="tiny"\} ([0-9.]+)', text)
        return float(found.group(1)) if found else 0.0

    before = count("json"), count("regex"), forced()
    replies = [chat(served, response_format=JSON_SCHEMA_FORMAT),
               chat(served, extra_body={"structured_outputs": {"regex": "[ab]{3}"}}), chat(served)]
    assert (count("json"), count("regex")) == (before[0] + 1, before[1] + 1)
    spent = [r.usage.model_extra["spec_decode"]["num_forced_draft_tokens"] for r in replies]
    assert spent[0] > 0 and spent[2] == 0  # the schema forces its keys; nothing forces an unconstrained reply
    assert forced() == before[2] + sum(spent)


# -- tool_choice "required" / a named function: held to a call grammar (hermes template on the real pair) -------
# short names and schemas: the tiny pair's context is 512 tokens, and the template's tool preamble is long
FORECAST = {"type": "function", "function": {"name": "fc", "parameters": {
    "type": "object", "properties": {"d": {"enum": [1, 2, 3]}}, "required": ["d"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "t", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


@pytest.fixture(scope="module")
def hermes_served(hermes_pipe):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from test_tool_calls import serving

    from ovdflash.server.wiring import build_server_app

    with serving(build_server_app(hermes_pipe, ["tiny"], block_size=4)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("tool_choice,names", [
    ("required", {"fc", "t"}),
    ({"type": "function", "function": {"name": "fc"}}, {"fc"}),
], ids=["required", "named"])
def test_a_forced_tool_choice_gives_a_call_whose_arguments_validate(hermes_served, tool_choice, names):
    for seed in range(3):
        reply = hermes_served.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], tools=[FORECAST, CLOCK],
            tool_choice=tool_choice, temperature=1.0, seed=seed)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        call = choice.message.tool_calls[0].function
        assert call.name in names
        schema = {FORECAST["function"]["name"]: FORECAST, CLOCK["function"]["name"]: CLOCK}[call.name]
        jsonschema.validate(json.loads(call.arguments), schema["function"]["parameters"])
    free = hermes_served.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                 tools=[FORECAST, CLOCK], temperature=0)
    assert not free.choices[0].message.tool_calls  # "auto": the random model writes no call of its own
