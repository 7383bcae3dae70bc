"""Logprobs, penalties and logit bias through the server, end to end with the official `openai` client.

The app over the real tiny pair, one request at a time and continuously batched: chat (`logprobs: true`,
`top_logprobs`) and completions (`logprobs: N`), whole and streamed, carry OpenAI's shapes with one
entry per generated token whose values equal the pipeline's own `generate` with the same settings;
streamed entries concatenate to the whole reply's; completions' text_offset runs over the token texts;
penalties and logit_bias reach the sampler (the reply equals the pipeline's, +100 forces a token); a
DFlash server and a `--no-draft` (AR) one give the same replies and logprobs, chat (streamed too) and
completions, greedy and seeded, with penalties and bias on (which change the reply) and off; a request
without logprobs gets `logprobs: null`; bad values are 400s naming the field.
"""
import math
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

MSG = [{"role": "user", "content": "Count the waves on the shore."}]
PROCESSING = {"presence_penalty": 0.6, "frequency_penalty": 0.4, "repetition_penalty": 1.2}
PIPELINE_PROCESSING = {**PROCESSING, "logit_bias": {17: 3.0, 18: -5.0}}
CLIENT_PROCESSING = {"presence_penalty": 0.6, "frequency_penalty": 0.4, "logit_bias": {"17": 3.0, "18": -5.0},
                     "extra_body": {"repetition_penalty": 1.2}}  # vLLM's extension: not a client argument


@pytest.fixture(scope="module")
def reference(tiny_pair, tmp_path_factory):
    from ovdflash import DFlashPipeline

    return DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("lp_ref_cache"))


@pytest.fixture(scope="module", params=[1, 4], ids=["sequential", "batched"])
def served(request, tiny_pair, tmp_path_factory):
    from test_tool_calls import serving  # tests/ is on sys.path under pytest

    from ovdflash import DFlashPipeline
    from ovdflash.server.wiring import build_server_app

    pipe = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("lp_cache"))
    with serving(build_server_app(pipe, ["tiny"], block_size=4, max_num_seqs=request.param)) as url:
        yield SimpleNamespace(url=url, client=openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                                            timeout=120))


def expected(reference, prompt, max_tokens, logprobs, **kwargs):
    kwargs.setdefault("temperature", 0.0)
    return reference.generate(prompt, max_new_tokens=max_tokens, block_size=4, logprobs=logprobs, **kwargs)


def text_of(reference, token_id):
    return reference.tokenizer.decode([token_id], skip_special_tokens=False)


def assert_entries_match(reference, entries, result, num_top):
    """Chat `logprobs.content` entries against the pipeline's TokenLogprobs."""
    assert len(entries) == len(result.token_ids) == len(result.logprobs)
    for entry, lp in zip(entries, result.logprobs):
        assert entry.token == text_of(reference, lp.token)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert math.isclose(entry.logprob, lp.logprob, abs_tol=1e-4)
        assert len(entry.top_logprobs) == num_top
        assert [t.token for t in entry.top_logprobs] == [text_of(reference, t) for t, _ in lp.top]
        assert all(math.isclose(t.logprob, v, abs_tol=1e-4) for t, (_, v) in zip(entry.top_logprobs, lp.top))


def assert_same_entries(got, want):
    """Same tokens and alternatives, logprobs equal to rounding (a cached prompt prefix may move the last bits)."""
    assert [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in got] == \
        [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in want]
    for a, b in zip(got, want):
        assert math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
        assert all(math.isclose(x.logprob, y.logprob, abs_tol=1e-4) for x, y in zip(a.top_logprobs, b.top_logprobs))


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.9, "seed": 5}],
                         ids=["greedy", "seeded"])
def test_chat_logprobs_equal_the_pipeline_whole_and_streamed(served, reference, sampling):
    reply = served.client.chat.completions.create(model="tiny", messages=MSG, max_tokens=20, logprobs=True,
                                                  top_logprobs=3, **sampling, **CLIENT_PROCESSING)
    want = expected(reference, MSG, 20, 3, **sampling, **PIPELINE_PROCESSING)
    choice = reply.choices[0]
    assert choice.message.content == want.text
    assert reply.usage.completion_tokens == len(choice.logprobs.content)
    assert_entries_match(reference, choice.logprobs.content, want, 3)
    stream = served.client.chat.completions.create(model="tiny", messages=MSG, max_tokens=20, logprobs=True,
                                                   top_logprobs=3, stream=True, **sampling, **CLIENT_PROCESSING)
    chunks = [c for c in stream if c.choices]
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert_same_entries(streamed, choice.logprobs.content)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text


def test_completion_logprobs_equal_the_pipeline_whole_and_streamed(served, reference):
    prompt = [5, 9, 13, 200, 7]
    reply = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, logprobs=2,
                                             **CLIENT_PROCESSING)
    want = expected(reference, prompt, 16, 2, **PIPELINE_PROCESSING)
    lp = reply.choices[0].logprobs
    assert reply.choices[0].text == want.text
    assert lp.tokens == [text_of(reference, t) for t in want.token_ids]
    assert all(math.isclose(a, b.logprob, abs_tol=1e-4) for a, b in zip(lp.token_logprobs, want.logprobs, strict=True))
    assert [list(top) for top in lp.top_logprobs] == [[text_of(reference, t) for t, _ in w.top] for w in want.logprobs]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    stream = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, logprobs=2,
                                              stream=True, **CLIENT_PROCESSING)
    parts = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in
               zip([v for p in parts for v in p.token_logprobs], lp.token_logprobs, strict=True))


@pytest.fixture(scope="module")
def ar_served(tiny_pair, tmp_path_factory):
    """The same pair served without drafting (`serve --no-draft`)."""
    from test_tool_calls import serving

    from ovdflash import DFlashPipeline
    from ovdflash.server.wiring import build_server_app

    pipe = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("lp_ar_cache"))
    with serving(build_server_app(pipe, ["tiny"], draft=False)) as url:
        yield SimpleNamespace(url=url, client=openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                                            timeout=120))


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.9, "seed": 5}],
                         ids=["greedy", "seeded"])
def test_dflash_and_ar_servers_give_the_same_tokens_and_logprobs_with_and_without_penalties(
        served, ar_served, sampling):
    def chat(server, processing, stream=False):
        return server.client.chat.completions.create(model="tiny", messages=MSG, max_tokens=20, logprobs=True,
                                                     top_logprobs=3, stream=stream, **sampling, **processing)

    texts = []
    for processing in (CLIENT_PROCESSING, {}):
        dflash, ar = chat(served, processing), chat(ar_served, processing)
        assert dflash.usage.model_extra["spec_decode"]["num_drafts"] > 0
        assert ar.usage.model_extra["spec_decode"]["num_drafts"] == 0
        assert dflash.choices[0].message.content == ar.choices[0].message.content
        assert_same_entries(dflash.choices[0].logprobs.content, ar.choices[0].logprobs.content)
        streamed = [e for c in chat(served, processing, stream=True) if c.choices and c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content]
        assert_same_entries(streamed, ar.choices[0].logprobs.content)
        texts.append(ar.choices[0].message.content)

        def complete(server):
            return server.client.completions.create(model="tiny", prompt=[5, 9, 13, 200, 7], max_tokens=16,
                                                    logprobs=2, **sampling, **processing).choices[0]
        dflash, ar = complete(served), complete(ar_served)
        assert (dflash.text, dflash.logprobs.tokens) == (ar.text, ar.logprobs.tokens)
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in
                   zip(dflash.logprobs.token_logprobs, ar.logprobs.token_logprobs, strict=True))
    assert texts[0] != texts[1]  # the penalties and bias changed the reply


def test_logit_bias_forces_a_token_and_no_logprobs_means_null(served, reference):
    forced = 42
    reply = served.client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=6, temperature=0,
                                             logit_bias={str(forced): 100}, logprobs=0)
    assert reply.choices[0].logprobs.tokens == [text_of(reference, forced)] * 6
    assert reply.choices[0].logprobs.top_logprobs == [{}] * 6
    plain = served.client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
    plain_completion = served.client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4, temperature=0)
    assert plain_completion.choices[0].logprobs is None


@pytest.mark.parametrize("kwargs,param", [
    ({"logit_bias": {"100000": 1}}, "logit_bias"), ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"), ({"frequency_penalty": 2.1}, "frequency_penalty"),
    ({"extra_body": {"repetition_penalty": -1.0}}, "repetition_penalty"), ({"top_logprobs": 3}, "top_logprobs"),
])
def test_bad_values_are_a_400_naming_the_field(served, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        served.client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2, **kwargs)
    assert err.value.param == param and "\n" not in err.value.body["message"]


def test_completion_logprobs_over_20_are_a_400(served):
    with pytest.raises(openai.BadRequestError) as err:
        served.client.completions.create(model="tiny", prompt="hi", max_tokens=2, logprobs=21)
    assert err.value.param == "logprobs"
