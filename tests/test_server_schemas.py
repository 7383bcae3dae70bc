"""Twenty JSON schemas, a regex and a choice through the server with the official `openai` client, under
DFlash and under AR (`--no-draft`), and forced tool calls on twenty prompts.

Checked on the real tiny pair (strict f32): one server per mode answers the 20 schemas of
`ovdflash.bench.schemas` (nested objects, arrays, enums, bounded integers and numbers, required and
optional fields, booleans, nulls, unions, patterns), a regex and a choice; nearly every reply completes
within its budget and every completed one parses and validates (jsonschema) or matches; the same prompts
without the schema do not validate (the random model writes no JSON of its own); the DFlash server drafted
and its replies are the AR server's token for token. tool_choice "required" and a named function on 20
prompts each give one call, of the right function, whose arguments validate against its parameters schema,
under a hermes template and under a qwen3_xml one, with `usage.spec_decode` showing drafted rounds;
streamed, the call's deltas reassemble to it, its arguments arriving in several pieces. Slow,
on the embedded SmolLM2 pair with its trained drafter: the same schema checks; and DFlash against AR with
logprobs, penalties (which change the reply), n=3 seeded twice, and named tool calls under a hermes
template (whole and streamed in pieces).
"""
import json
import re
from types import SimpleNamespace

import pytest

from ovdflash.bench.schemas import SCHEMA_TASKS, schema_prompt

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

MAX_TOKENS = 96  # the longest tiny-pair answer takes ~50 tokens
REGEX = "[A-Z][a-z]{1,6} [0-9]{2}"
CHOICES = ["sunny", "rainy", "windy", "foggy"]


def validates(text: str | None, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text or ""), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def answer(client, prompt: str, max_tokens: int, **kwargs) -> SimpleNamespace:
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=max_tokens, temperature=0, logprobs=True, **kwargs)
    choice = reply.choices[0]
    return SimpleNamespace(text=choice.message.content, finish=choice.finish_reason,
                           tokens=[entry.bytes for entry in choice.logprobs.content],
                           drafts=reply.usage.model_extra["spec_decode"]["num_drafts"])


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def answers_of(pipe, draft, prompts: list[str], max_tokens: int, unconstrained: bool) -> SimpleNamespace:
    """Every schema's, the regex's and the choice's answer from one server over `pipe` (draft False: AR)."""
    from test_tool_calls import serving

    from ovdflash.server.wiring import build_server_app

    with serving(build_server_app(pipe, ["m"], block_size=4, draft=draft)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        schemas = [answer(client, prompt, max_tokens, response_format=schema_format(schema))
                   for prompt, (_, schema) in zip(prompts, SCHEMA_TASKS)]
        free = [answer(client, prompt, max_tokens) for prompt in prompts] if unconstrained else []
        regex = answer(client, "A name and a number:", 24, extra_body={"structured_outputs": {"regex": REGEX}})
        choice = answer(client, "The weather today is", 24, extra_body={"structured_outputs": {"choice": CHOICES}})
    return SimpleNamespace(schemas=schemas, free=free, regex=regex, choice=choice)


def check_schema_answers(got: SimpleNamespace, least_complete: int) -> None:
    complete = [(a, schema) for a, (_, schema) in zip(got.schemas, SCHEMA_TASKS) if a.finish == "stop"]
    assert len(complete) >= least_complete, [a.text for a in got.schemas if a.finish != "stop"]
    for a, schema in complete:
        assert validates(a.text, schema), (a.text, schema)
    for a in got.schemas:  # one cut by max_tokens is still the start of a JSON object
        assert a.finish in ("stop", "length") and a.text.startswith("{")
    assert got.regex.finish == "stop" and re.fullmatch(REGEX, got.regex.text), got.regex.text
    assert got.choice.finish == "stop" and got.choice.text in CHOICES, got.choice.text


def check_dflash_equals_ar(dflash: SimpleNamespace, ar: SimpleNamespace) -> None:
    pairs = list(zip(dflash.schemas, ar.schemas)) + [(dflash.regex, ar.regex), (dflash.choice, ar.choice)]
    for i, (d, a) in enumerate(pairs):
        assert (d.tokens, d.text, d.finish) == (a.tokens, a.text, a.finish), i
    assert sum(d.drafts for d, _ in pairs) > 0 and sum(a.drafts for _, a in pairs) == 0


# -- the tiny pair -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_answers(tiny_pair, tmp_path_factory):
    """(DFlash answers, AR answers) of one server each over the same strict-f32 pipeline."""
    from ovdflash import STRICT_F32, DFlashPipeline

    pipe = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("schemas_cache"),
                                          **STRICT_F32)
    prompts = [prompt for prompt, _ in SCHEMA_TASKS]  # the schema itself would overflow the tiny context
    return (answers_of(pipe, None, prompts, MAX_TOKENS, unconstrained=True),
            answers_of(pipe, False, prompts, MAX_TOKENS, unconstrained=False))


def test_twenty_schema_answers_validate_under_dflash_and_ar(tiny_answers):
    for got in tiny_answers:
        check_schema_answers(got, least_complete=18)


def test_without_the_schema_the_answers_do_not_validate(tiny_answers):
    dflash, _ = tiny_answers
    valid = [validates(a.text, schema) for a, (_, schema) in zip(dflash.free, SCHEMA_TASKS)]
    assert sum(valid) <= 2, [a.text for a in dflash.free]


def test_dflash_answers_are_the_ar_answers_token_for_token(tiny_answers):
    check_dflash_equals_ar(*tiny_answers)


# -- forced tool calls on twenty prompts (hermes and qwen3_xml templates on the tiny pair) ---------------------
def terse_template(call_form: str) -> str:
    """A chat template that lists each tool as its name and properties and shows `call_form` (the tiny pair's
    context is 512 tokens: the families' own templates spend it on instructions)."""
    return ("{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{%- for tool in tools %}"
            "{{- '\\n' + tool.function.name + tool.function.parameters.properties | tojson }}{%- endfor %}"
            "{{- '\\n</tools> " + call_form + "<|im_end|>\\n' }}{%- endif %}"
            "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content"
            " + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
            "{%- endif %}")


CALL_FORMS = {"hermes": "<tool_call>{", "qwen3_xml": "<tool_call><function="}  # what detect_tool_format reads


def tool(name: str, schema: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        k: v for k, v in schema.items() if k != "x-guidance"}}}


# short names and small schemas, each value bounded (a random model would write free text for ever)
TOOLS = [tool("wx", SCHEMA_TASKS[0][1]), tool("pick", SCHEMA_TASKS[1][1]), tool("lvl", SCHEMA_TASKS[2][1])]
CALL_MAX_TOKENS = 128  # the tiny tokenizer spells the XML form's tags a character a token: ~100 tokens a call
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module", params=sorted(CALL_FORMS))
def tool_client(request, tiny_pair, tmp_path_factory):
    from test_tool_calls import pair_with_template, serving

    from ovdflash import DFlashPipeline
    from ovdflash.server.wiring import build_server_app

    model_dir = pair_with_template(tiny_pair, tmp_path_factory.mktemp(request.param) / "pair",
                                   terse_template(CALL_FORMS[request.param]))
    pipe = DFlashPipeline.from_pretrained(model_dir, cache_dir=tmp_path_factory.mktemp(f"{request.param}_cache"))
    app = build_server_app(pipe, ["m"], block_size=4)
    assert app.state.tool_format == request.param
    with serving(app) as url:
        yield SimpleNamespace(format=request.param, client=openai.OpenAI(base_url=url + "/v1", api_key="none",
                                                                         max_retries=0, timeout=600))


def streamed_call(client, drafted=True, **request) -> tuple[str, str, int, str]:
    """(name, arguments, how many argument pieces followed the call's first delta, finish_reason) of a streamed
    reply holding one call, its deltas merged as a client merges them; its usage chunk shows whether it drafted."""
    deltas, finish, usage = [], None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **request):
        if chunk.choices:
            deltas += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert deltas and {d.index for d in deltas} == {0} and deltas[0].id.startswith("call_")
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert (usage.model_extra["spec_decode"]["num_drafts"] > 0) == drafted
    return deltas[0].function.name, "".join(d.function.arguments for d in deltas), len(deltas) - 1, finish


@pytest.mark.parametrize("named", [False, True], ids=["required", "named"])
def test_forced_tool_calls_on_twenty_prompts_name_the_right_function_with_valid_arguments(tool_client, named):
    """Whole and streamed: the streamed call reassembles to the whole one, its arguments coming in pieces as
    the rounds accept them."""
    client, pieces = tool_client.client, []
    for i, (prompt, _) in enumerate(SCHEMA_TASKS):
        want = TOOLS[i % len(TOOLS)]["function"]["name"]
        tool_choice = {"type": "function", "function": {"name": want}} if named else "required"
        request = dict(model="m", messages=[{"role": "user", "content": prompt}], tools=TOOLS,
                       tool_choice=tool_choice, temperature=0, max_tokens=CALL_MAX_TOKENS)
        reply = client.chat.completions.create(**request)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, (prompt, choice)
        assert reply.usage.model_extra["spec_decode"]["num_drafts"] > 0
        call = choice.message.tool_calls[0].function
        assert (call.name == want) if named else (call.name in PARAMETERS), call.name
        jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
        name, arguments, num_pieces, finish = streamed_call(client, **request)
        assert (name, arguments, finish) == (call.name, call.arguments, "tool_calls"), prompt
        pieces.append(num_pieces)
    assert min(pieces) > 1, pieces
    unforced = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                              tools=TOOLS, temperature=0, max_tokens=16)
    assert not unforced.choices[0].message.tool_calls  # "auto": the random model writes no call of its own


# -- the embedded SmolLM2 pair with its trained drafter ----------------------------------------------------------
@pytest.mark.slow
def test_twenty_schemas_on_the_embedded_model_validate_and_dflash_equals_ar(tmp_path_factory):
    from ovdflash_models.default import ensure_default_model

    from ovdflash import STRICT_F32, DFlashPipeline

    pipe = DFlashPipeline.from_pretrained(ensure_default_model(), **STRICT_F32)
    prompts = [schema_prompt(task) for task in SCHEMA_TASKS]
    dflash = answers_of(pipe, None, prompts, MAX_TOKENS, unconstrained=False)
    ar = answers_of(pipe, False, prompts, MAX_TOKENS, unconstrained=False)
    for got in (dflash, ar):
        check_schema_answers(got, least_complete=19)
    check_dflash_equals_ar(dflash, ar)


@pytest.mark.slow
def test_agent_features_on_the_embedded_model_dflash_equals_ar(tmp_path_factory):
    """The embedded pair (strict f32) served with DFlash and with --no-draft, through the official client:
    logprobs and top_logprobs equal, with penalties and logit bias (which change the reply) and without,
    greedy and seeded; n=3 seeded repeats; with a hermes template, a named tool_choice gives the same valid
    call under both, its streamed deltas reassemble to it and its arguments arrive in pieces."""
    from ovdflash_models.default import ensure_default_model
    from test_server_logprobs import assert_same_entries
    from test_tool_calls import HERMES_TEMPLATE, serving

    from ovdflash import STRICT_F32, DFlashPipeline
    from ovdflash.server.wiring import build_server_app

    pipe = DFlashPipeline.from_pretrained(ensure_default_model(), **STRICT_F32)
    pipe.tokenizer.chat_template = HERMES_TEMPLATE  # SmolLM2's own template teaches no tool format
    messages = [{"role": "user", "content": "Give me three tips for a rainy day."}]
    processing = {"presence_penalty": 1.0, "frequency_penalty": 0.8, "logit_bias": {"30": -100, "28": 5}}
    weather = tool("get_weather", {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "days", "units"],
        "additionalProperties": False})
    cities = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo"]
    replies = {}
    for draft in (None, False):
        with serving(build_server_app(pipe, ["m"], block_size=8, draft=draft)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
            got = replies[draft] = {}
            for name, sampling in (("greedy", {"temperature": 0}), ("seeded", {"temperature": 0.8, "seed": 3})):
                for extra in ({}, processing):
                    got[name, bool(extra)] = client.chat.completions.create(
                        model="m", messages=messages, max_tokens=40, logprobs=True, top_logprobs=3,
                        **sampling, **extra).choices[0]
            got["n"] = [[c.message.content for c in client.chat.completions.create(
                model="m", messages=messages, max_tokens=24, n=3, temperature=1.0, seed=11).choices]
                for _ in range(2)]
            got["calls"] = []
            for city in cities:
                request = dict(model="m", messages=[{"role": "user", "content": f"What is the weather in {city}?"}],
                               tools=[weather], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                               temperature=0, max_tokens=64)
                choice = client.chat.completions.create(**request).choices[0]
                assert choice.finish_reason == "tool_calls", choice
                [call] = choice.message.tool_calls
                jsonschema.validate(json.loads(call.function.arguments), weather["function"]["parameters"])
                name, arguments, num_pieces, finish = streamed_call(client, draft is None, **request)
                assert (name, arguments, finish) == (call.function.name, call.function.arguments, "tool_calls")
                assert num_pieces > 1
                got["calls"].append((call.function.name, call.function.arguments))
    dflash, ar = replies[None], replies[False]
    for key in [k for k in dflash if isinstance(k, tuple)]:
        assert dflash[key].message.content == ar[key].message.content, key
        assert_same_entries(dflash[key].logprobs.content, ar[key].logprobs.content)
    assert dflash["greedy", True].message.content != dflash["greedy", False].message.content
    assert dflash["n"][0] == dflash["n"][1] == ar["n"][0] and len(set(dflash["n"][0])) > 1
    assert dflash["calls"] == ar["calls"]
