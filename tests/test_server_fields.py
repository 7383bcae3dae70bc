"""Which request fields the server accepts, ignores or refuses (ovdflash.server.protocol's contract), checked on
the request models and end to end with the official `openai` client against the app over the real tiny pair.

Checked: fields that change nothing in the reply (metadata, store, service_tier, reasoning_effort, user,
prompt caching hints, safety_identifier, prediction, modalities ["text"], parallel_tool_calls without tools
to parse, stream_options.include_obfuscation, tools[].function.strict, messages[].refusal) are accepted, named
by `ignored_fields()`, leave the greedy reply and its usage unchanged, and are each logged once per process;
fields that would change the reply and are not implemented (a response_format of an unknown type, audio modalities,
functions, tool_choice "required" without tools, a tool without a name), penalties, logit_bias and logprobs out of OpenAI's ranges, and unknown fields (frobnicate, vLLM's
min_p, OpenAI's verbosity) are a 400 naming the field in one line; an ignored field of the wrong type is
still a 400.
"""
import json
import logging
from types import SimpleNamespace

import pytest

from ovdflash.server import protocol
from ovdflash.server.protocol import ApiError

MSG = [{"role": "user", "content": "Write a short poem about the sea."}]
TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}

# (extra body fields, the name ignored_fields() gives)
ACCEPTED = [
    ({"metadata": {"team": "search", "run": "7"}}, "metadata"),
    ({"store": True}, "store"),
    ({"service_tier": "auto"}, "service_tier"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"user": "user-42"}, "user"),
    ({"prompt_cache_key": "session-1"}, "prompt_cache_key"),
    ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
    ({"safety_identifier": "hash-1"}, "safety_identifier"),
    ({"prediction": {"type": "content", "content": "The sea is wide"}}, "prediction"),
    ({"modalities": ["text"]}, "modalities"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"tools": [TOOL], "tool_choice": "none", "parallel_tool_calls": True}, "parallel_tool_calls"),
    ({"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
     "stream_options.include_obfuscation"),
    ({"tools": [{**TOOL, "function": {**TOOL["function"], "strict": True}}]}, "tools[].function.strict"),
    ({"messages": MSG + [{"role": "assistant", "content": "No.", "refusal": "I cannot"}] + MSG},
     "messages[].refusal"),
]
# (extra body fields, the param of the 400)
REFUSED = [
    ({"logprobs": 3}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"n": 1.5}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"functions": [TOOL["function"]]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"min_p": 0.1}, "min_p"),
    ({"verbosity": "low"}, "verbosity"),
    ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
    ({"store": "yes"}, "store"),
    ({"metadata": ["not", "an", "object"]}, "metadata"),
    ({"prediction": {"type": "image", "content": "x"}}, "prediction.type"),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}, "stream": True},
     "stream_options.continuous_usage_stats"),
]


def chat_request(extra: dict):
    return protocol.parse_request(protocol.ChatCompletionRequest, json.dumps({"messages": MSG, **extra}).encode())


@pytest.mark.parametrize("extra,name", ACCEPTED, ids=[a[1] + "-" + "-".join(a[0]) for a in ACCEPTED])
def test_fields_that_change_nothing_are_accepted_and_named_as_ignored(extra, name):
    req = chat_request(extra)
    req.check_supported()
    assert req.ignored_fields() == [name]


def test_a_plain_request_ignores_nothing_and_parsed_tools_are_not_ignored():
    assert chat_request({}).ignored_fields() == []
    with_tools = chat_request({"tools": [TOOL], "parallel_tool_calls": False, "tool_choice": "auto"})
    with_tools.check_supported()
    assert with_tools.ignored_fields() == [] and with_tools.tool_call_mode() == "parse"


def test_completions_accept_user_and_refuse_chat_only_fields():
    req = protocol.parse_request(protocol.CompletionRequest, b'{"prompt": "a", "user": "u"}')
    assert req.ignored_fields() == ["user"]
    with pytest.raises(ApiError) as err:
        protocol.parse_request(protocol.CompletionRequest, b'{"prompt": "a", "metadata": {}}')
    assert err.value.param == "metadata"


@pytest.mark.parametrize("extra,param", REFUSED, ids=[r[1] for r in REFUSED])
def test_fields_that_would_change_the_reply_are_a_400_naming_them(extra, param):
    with pytest.raises(ApiError) as err:
        req = chat_request(extra)
        req.check_supported()
        req.logit_bias_ids(None)
    error = err.value
    assert error.status == 400 and error.param == param
    assert "\n" not in error.message and "Traceback" not in error.message
    assert param.split("[")[0].split(".")[0] in error.message, error.message


# -- end to end: the app over the real tiny pair ------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tiny_pair, tmp_path_factory):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from test_tool_calls import serving  # tests/ is on sys.path under pytest

    from ovdflash import DFlashPipeline
    from ovdflash.server.wiring import build_server_app

    pipe = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("fields_cache"))
    with serving(build_server_app(pipe, ["tiny"], block_size=4)) as url:
        yield SimpleNamespace(url=url, client=openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                                            timeout=120))


def chat(served, **kwargs):
    kwargs.setdefault("max_tokens", 20)
    kwargs.setdefault("temperature", 0)
    return served.client.chat.completions.create(model="tiny", messages=MSG, **kwargs)


CLIENT_FIELDS = {"metadata": {"team": "search"}, "store": True, "service_tier": "auto", "reasoning_effort": "low",
                 "user": "user-42", "prompt_cache_key": "session-1", "safety_identifier": "hash-1",
                 "prediction": {"type": "content", "content": "The sea is wide"}, "modalities": ["text"],
                 "parallel_tool_calls": True}


def test_accepted_fields_leave_the_reply_unchanged(served):
    plain = chat(served)
    decorated = chat(served, **CLIENT_FIELDS)
    assert decorated.choices[0].message.content == plain.choices[0].message.content
    assert decorated.choices[0].finish_reason == plain.choices[0].finish_reason
    assert (decorated.usage.prompt_tokens, decorated.usage.completion_tokens) == \
        (plain.usage.prompt_tokens, plain.usage.completion_tokens)
    stream = chat(served, stream=True, stream_options={"include_usage": True, "include_obfuscation": False},
                  **CLIENT_FIELDS)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == plain.choices[0].message.content


def test_each_ignored_field_is_logged_once_per_process(served, monkeypatch, caplog):
    from ovdflash.server import app as app_module

    monkeypatch.setattr(app_module, "_logged_ignored_fields", set())
    caplog.set_level(logging.WARNING, logger="ovdflash.server")
    for _ in range(3):
        chat(served, max_tokens=2, metadata={"a": "b"}, store=False)
    ignored = [r.getMessage() for r in caplog.records if "ignoring the request field" in r.getMessage()]
    assert sorted(ignored) == sorted(f"ignoring the request field {name!r}: it changes nothing in the reply "
                                     "(logged once)" for name in ("metadata", "store"))


@pytest.mark.parametrize("kwargs,param", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"logit_bias": {"100000": 10}}, "logit_bias"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"verbosity": "low"}, "verbosity"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"extra_body": {"min_p": 0.1}}, "min_p"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]}, "tools[0].function.name"),
], ids=["top_logprobs", "n", "presence_penalty", "logit_bias", "response_format", "verbosity", "frobnicate", "min_p",
        "tool_choice", "tool_without_a_name"])
def test_the_client_sees_a_400_naming_the_refused_field(served, kwargs, param):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        chat(served, **kwargs)
    assert err.value.param == param
    assert param in err.value.body["message"] and "\n" not in err.value.body["message"]
