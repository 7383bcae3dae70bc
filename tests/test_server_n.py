"""`n` choices through the server, end to end with the official `openai` client on the real tiny pair, one
request at a time and continuously batched.

Checked: a seeded n=3 request gives the same choices twice, its choice 0 is the n=1 reply with that seed, and
choice i is the n=1 reply seeded `choice_seed(seed, i)`; sampled choices differ from each other, seeded or not;
greedy n=2 gives equal choices; each choice has its `index`, finish_reason and logprobs, and a grammar holds
every choice; `usage` sums the choices' tokens and spec_decode counts with the prompt counted once; streamed
n=3 carries each choice's index, one finish chunk per choice and one usage chunk at the end, and reassembles
to the non-streamed reply; the later choices of a new prompt share its cached KV (batched: the first choice's
full blocks; one at a time: what the previous choice left); n=0, n above the server's limit and a non-integer
n are 400s naming `n`.
"""
from types import SimpleNamespace

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

MSG = [{"role": "user", "content": "Tell me about the sea."}]
SAMPLED = {"temperature": 1.0, "max_tokens": 12}
SEED = 7


@pytest.fixture(scope="module", params=[1, 4], ids=["sequential", "batched"])
def served(request, tiny_pair, tmp_path_factory):
    from test_tool_calls import serving  # tests/ is on sys.path under pytest

    from ovdflash import DFlashPipeline
    from ovdflash.server.wiring import build_server_app

    pipe = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("n_cache"))
    pipe.prefix_cache = True  # as `ovdflash serve` runs by default
    app = build_server_app(pipe, ["tiny"], block_size=4, max_num_seqs=request.param)
    with serving(app) as url:
        yield SimpleNamespace(url=url, pipe=pipe, batched=request.param > 1, max_choices=app.state.engine.max_choices,
                              client=openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120))


def chat(served, **kwargs):
    return served.client.chat.completions.create(model="tiny", messages=MSG, **kwargs)


def texts(reply) -> list[str]:
    assert [c.index for c in reply.choices] == list(range(len(reply.choices)))
    return [c.message.content for c in reply.choices]


def test_seeded_choices_repeat_and_choice_i_is_the_single_reply_with_its_seed(served):
    from ovdflash.server.engine import choice_seed

    first = chat(served, n=3, seed=SEED, **SAMPLED)
    again = chat(served, n=3, seed=SEED, **SAMPLED)
    assert texts(first) == texts(again)
    singles = [chat(served, n=1, seed=choice_seed(SEED, i), **SAMPLED).choices[0].message.content for i in range(3)]
    assert choice_seed(SEED, 0) == SEED
    assert texts(first) == singles


@pytest.mark.parametrize("seed", [SEED, None], ids=["seeded", "unseeded"])
def test_sampled_choices_differ_from_each_other(served, seed):
    reply = chat(served, n=3, seed=seed, **SAMPLED)
    assert len(set(texts(reply))) == 3, texts(reply)


def test_greedy_choices_are_equal(served):
    single = chat(served, temperature=0, max_tokens=12)
    reply = chat(served, n=2, temperature=0, max_tokens=12)
    assert texts(reply) == [single.choices[0].message.content] * 2
    assert [c.finish_reason for c in reply.choices] == [single.choices[0].finish_reason] * 2


def test_usage_sums_the_choices_and_logprobs_cover_each(served):
    from ovdflash.server.engine import choice_seed

    reply = chat(served, n=3, seed=SEED, logprobs=True, top_logprobs=2, **SAMPLED)
    singles = [chat(served, seed=choice_seed(SEED, i), **SAMPLED) for i in range(3)]
    counts = [len(c.logprobs.content) for c in reply.choices]
    assert counts == [s.usage.completion_tokens for s in singles]
    assert all(len(entry.top_logprobs) == 2 for c in reply.choices for entry in c.logprobs.content)
    assert reply.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert reply.usage.completion_tokens == sum(counts)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + sum(counts)
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert reply.usage.model_extra["spec_decode"][name] == sum(s.usage.model_extra["spec_decode"][name] for s in singles), name


def test_a_grammar_holds_every_choice(served):
    options = ["yes", "no", "maybe"]
    reply = chat(served, n=3, extra_body={"structured_outputs": {"choice": options}}, **SAMPLED)
    assert all(text in options for text in texts(reply)), texts(reply)
    assert all(c.finish_reason == "stop" for c in reply.choices)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_choices_reassemble_to_the_whole_reply(served, endpoint):
    kwargs = {"n": 3, "seed": SEED, **SAMPLED}
    if endpoint == "chat":
        whole = chat(served, **kwargs)
        stream = chat(served, stream=True, stream_options={"include_usage": True}, **kwargs)
        want = texts(whole)
    else:
        create = served.client.completions.create
        whole = create(model="tiny", prompt="The sea is", **kwargs)
        stream = create(model="tiny", prompt="The sea is", stream=True, stream_options={"include_usage": True},
                        **kwargs)
        want = [c.text for c in whole.choices]
    pieces, finish, usages, after_usage = [""] * 3, [[] for _ in range(3)], [], []
    for chunk in stream:
        if not chunk.choices:
            usages.append(chunk.usage)
            continue
        after_usage += usages
        (choice,) = chunk.choices
        pieces[choice.index] += (choice.delta.content or "") if endpoint == "chat" else choice.text
        if choice.finish_reason is not None:
            finish[choice.index].append(choice.finish_reason)
    assert pieces == want
    assert finish == [[c.finish_reason] for c in whole.choices]
    assert len(usages) == 1 and not after_usage, "one usage chunk, after every choice's chunks"
    assert (usages[0].prompt_tokens, usages[0].completion_tokens) == \
        (whole.usage.prompt_tokens, whole.usage.completion_tokens)


def test_bad_n_is_a_400_naming_n(served):
    for n in (0, served.max_choices + 1, 1.5, "2"):
        response = httpx.post(served.url + "/v1/chat/completions", json={"messages": MSG, "n": n, "max_tokens": 2},
                              timeout=60)
        assert response.status_code == 400, (n, response.text)
        error = response.json()["error"]
        assert error["param"] == "n" and error["message"].startswith(("n ", "n:")) and "\n" not in error["message"]
    with pytest.raises(openai.BadRequestError) as err:
        served.client.completions.create(model="tiny", prompt="a", n=served.max_choices + 1, max_tokens=2)
    assert err.value.param == "n"


def test_later_choices_share_the_prompts_cached_blocks(served):
    from test_serve import scrape

    hits = ("ovdflash:prefix_cache_hits_total", ())
    messages = [{"role": "user", "content": "Name the seven seas, one by one, with a fact about each. " * 4}]
    before = scrape(served.url).get(hits, 0)
    reply = served.client.chat.completions.create(model="tiny", messages=messages, n=3, max_tokens=4, temperature=0)
    shared = scrape(served.url)[hits] - before
    num_prompt = reply.usage.prompt_tokens
    # usage counts the prompt once, as the first choice found it
    first = reply.usage.prompt_tokens_details.cached_tokens
    if served.batched:
        block = served.pipe.batch_target().block_tokens
        # the prompt is new but for the chat template's first tokens, which an earlier request's block gives by a
        # copy; the later choices share the full blocks the first one prefilled
        assert first < block
        assert num_prompt > block and shared == first + 2 * ((num_prompt - 1) // block * block), (shared, num_prompt)
    else:  # one after another: each later choice reuses the KV its predecessor left, all but the prompt's last token
        assert first == 0
        assert shared == 2 * (num_prompt - 1), (shared, num_prompt)
