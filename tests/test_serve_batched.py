"""The server with continuous batching (BatchedBackend) over the tiny pair, served from a thread.

Checked: concurrent clients (chat and completions, streamed or not, greedy and seeded sampling,
stop strings) get exactly the pipeline's text alone while their rounds share target calls; the
load-aware "auto" drafts keep the text; a client that leaves mid-stream gives its KV blocks back;
a small KV pool makes requests wait, never fail, and lowers the context limit to what it holds
(a request beyond it is a 400); requests sharing a system prompt reuse its KV blocks (the
prefix-cache counters) with unchanged text, and --no-enable-prefix-caching turns that off.
"""
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
import openai  # noqa: E402
from test_serve import scrape, serving_app  # noqa: E402

from ovdflash.decode.scheduler import DEFAULT_PREFILL_BATCH_TOKENS  # noqa: E402
from ovdflash.ov.paged_batch import paged_compiled, pool_bytes_per_block  # noqa: E402

PROMPTS = ["Tell me a story about a cat.", "What is 2 + 2?", "Write a haiku about rain.", "List three colours.",
           "Why is the sky blue?", "Say hello in French.", "Name a prime number.", "Describe a tree."]


@pytest.fixture(scope="module")
def pipe(tiny_pair, tmp_path_factory):
    from ovdflash import DFlashPipeline

    return DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("batched_cache"))


@contextlib.contextmanager
def serving(pipe, **options):
    """(url, engine) of a fresh batched app over `pipe`, served from a thread."""
    from ovdflash.server.wiring import build_server_app

    app = build_server_app(pipe, ["tiny"], **{"max_num_seqs": 4, **options})
    with serving_app(app) as url:
        yield url, app.state.engine


def client_for(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def ask(url, i, kind):
    """One request of a mixed workload: (prompt, kwargs, text)."""
    client, prompt = client_for(url), PROMPTS[i % len(PROMPTS)]
    kwargs = [{"temperature": 0}, {"temperature": 0.9, "seed": 100 + i}, {"temperature": 0, "stop": [" the"]}][i % 3]
    max_tokens = 10 + 3 * (i % 5)
    if kind == "chat":
        messages = [{"role": "user", "content": prompt}]
        if i % 2:
            stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens,
                                                    stream=True, **kwargs)
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        else:
            text = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens,
                                                  **kwargs).choices[0].message.content
        return messages, max_tokens, kwargs, text
    text = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, **kwargs).choices[0].text
    return prompt, max_tokens, kwargs, text


@pytest.mark.parametrize("block_size,prefill_batch_tokens", [(4, DEFAULT_PREFILL_BATCH_TOKENS), (None, None),
                                                              (None, 1)])  # None: load-aware "auto" drafts
def test_concurrent_requests_share_rounds_and_get_the_texts_alone(pipe, block_size, prefill_batch_tokens):
    with serving(pipe, block_size=block_size, prefill_batch_tokens=prefill_batch_tokens) as (url, engine):
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda i: ask(url, i, "chat" if i % 4 else "completion"), range(12)))
        scheduler = engine.scheduler.batch.scheduler
        assert scheduler.prefill_batch_tokens == prefill_batch_tokens
        assert scheduler.num_batched_sequences > scheduler.num_steps  # some calls carried several sequences
        metrics = scrape(url)
        target = pipe.batch_target()
        assert target.num_reserved == 0 and len(target.free) + len(target.evictable) == target.num_blocks
    assert sum(metrics.get(("ovdflash:request_success_total", (("finished_reason", r),)), 0)
               for r in ("stop", "length")) == 12
    for prompt, max_tokens, kwargs, text in answers:
        kw = dict(kwargs)
        want = pipe.generate(prompt, max_new_tokens=max_tokens, block_size=block_size or 4, **kw)
        assert text == want.text, (prompt, kwargs)


def test_a_client_leaving_mid_stream_frees_its_blocks_and_others_finish(pipe):
    with serving(pipe, block_size=4) as (url, engine):
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": PROMPTS[0], "max_tokens": 400, "stream": True}) as response:
            lines = response.iter_lines()
            for _ in range(3):
                next(lines)
        other = client_for(url).completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0)
        aborted = ("ovdflash:request_success_total", (("finished_reason", "abort"),))
        deadline = time.monotonic() + 30
        # the worker ends the request in the scheduler first and records its metrics after
        while engine.num_open_requests or engine.scheduler.has_unfinished() or aborted not in scrape(url):
            assert time.monotonic() < deadline, "the abandoned request kept running or was never counted"
            time.sleep(0.02)
        target = pipe.batch_target()
        assert target.num_reserved == 0
        assert scrape(url)[aborted] == 1
    assert other.choices[0].text == pipe.generate(PROMPTS[1], max_new_tokens=12, block_size=4).text


def test_a_small_pool_makes_requests_wait_not_fail(pipe):
    block_tokens = pipe.batch_target().block_tokens
    # room for about two 40-token requests at once
    per_block = pool_bytes_per_block(paged_compiled(pipe.target))
    with serving(pipe, block_size=4, kv_cache_memory_bytes=str(per_block * 2 * (-(-60 // block_tokens)))) \
            as (url, engine):
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda i: client_for(url).completions.create(
                model="tiny", prompt=PROMPTS[i], max_tokens=30, temperature=0).choices[0].text, range(6)))
        scheduler = engine.scheduler.batch.scheduler
        assert scheduler.num_batched_sequences <= 2 * scheduler.num_steps
    assert answers == [pipe.generate(PROMPTS[i], max_new_tokens=30, block_size=4).text for i in range(6)]


def test_a_small_pool_lowers_the_context_limit_and_a_larger_request_is_a_400(pipe):
    per_block = pool_bytes_per_block(paged_compiled(pipe.target))
    block_tokens = pipe.batch_target().block_tokens
    with serving(pipe, block_size=4, kv_cache_memory_bytes=str(per_block)) as (url, engine):
        assert engine.max_model_len == block_tokens
        assert client_for(url).models.list().data[0].model_extra["max_model_len"] == block_tokens
        with pytest.raises(openai.BadRequestError, match="context") as info:
            client_for(url).completions.create(model="tiny", prompt=PROMPTS[0] * 5, max_tokens=100)
        assert info.value.code == "context_length_exceeded"
        ok = client_for(url).completions.create(model="tiny", prompt="Hi", max_tokens=2, temperature=0)
        assert ok.choices[0].finish_reason == "length"
    from ovdflash.server.wiring import build_server_app

    with pytest.raises(ValueError, match=f"holds {block_tokens} tokens of KV cache, fewer than --max-model-len"):
        build_server_app(pipe, ["tiny"], max_num_seqs=2, kv_cache_memory_bytes=str(per_block),
                         max_model_len=block_tokens + 1)


def test_the_prefix_cache_keeps_what_its_memory_bound_allows(pipe):
    """Default: a quarter of the pool; a size: that many blocks' bytes; 0: nothing beyond running
    requests, so distinct prompts evict cached blocks rather than touch new ones; answers unchanged."""
    from ovdflash.server.wiring import build_server_app

    per_block = pool_bytes_per_block(paged_compiled(pipe.target))
    app = build_server_app(pipe, ["tiny"], max_num_seqs=2, kv_cache_memory_bytes=str(per_block * 40))
    assert app.state.engine.scheduler.batch.scheduler.target.pool.max_idle_cached == 10
    assert "keep at most 10 more blocks" in app.state.kv_pool
    app = build_server_app(pipe, ["tiny"], max_num_seqs=2, kv_cache_memory_bytes=str(per_block * 40),
                           prefix_cache_memory_bytes=str(per_block * 3 + 1))
    assert app.state.engine.scheduler.batch.scheduler.target.pool.max_idle_cached == 3
    touched, evicted = {}, {}
    for blocks, bound in ((44, None), (48, "0")):  # another pool size: a fresh batch target
        with serving(pipe, block_size=4, max_num_seqs=2, kv_cache_memory_bytes=str(per_block * blocks),
                     prefix_cache_memory_bytes=bound) as (url, engine):
            pool = engine.scheduler.batch.scheduler.target.pool
            answers = [client_for(url).completions.create(model="tiny", prompt=PROMPTS[i] * 2, max_tokens=20,
                                                          temperature=0).choices[0].text for i in range(4)]
            touched[bound], evicted[bound] = pool.num_touched, pool.num_evicted
        assert answers == [pipe.generate(PROMPTS[i] * 2, max_new_tokens=20, block_size=4).text for i in range(4)]
    # one request at a time: with 0 the pool reuses one request's blocks, by default it keeps them all
    assert evicted == {None: 0, "0": evicted["0"]} and evicted["0"] > 0
    assert 0 < touched["0"] < touched[None] and touched[None] >= 4
    with pytest.raises(ValueError, match="--prefix-cache-memory-bytes must be a size"):
        build_server_app(pipe, ["tiny"], max_num_seqs=2, prefix_cache_memory_bytes="some")


def test_requests_sharing_a_system_prompt_reuse_its_blocks(pipe):
    system = "You are a careful assistant. Answer briefly and never make things up. " * 6
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": p}] for p in PROMPTS[:6]]

    def ask_all(url):
        client = client_for(url)
        first = client.chat.completions.create(model="tiny", messages=chats[0], max_tokens=8, temperature=0)
        with ThreadPoolExecutor(4) as pool:
            rest = list(pool.map(lambda m: client.chat.completions.create(
                model="tiny", messages=m, max_tokens=8, temperature=0), chats[1:]))
        return [r.choices[0].message.content for r in [first] + rest], [first] + rest

    pipe.prefix_cache = True
    try:
        with serving(pipe, block_size=4) as (url, engine):
            texts, replies = ask_all(url)
            metrics = scrape(url)
    finally:
        pipe.prefix_cache = False
    num_system = len(pipe.tokenizer.encode_chat([{"role": "system", "content": system}], add_generation_prompt=False))
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in replies]
    b = pipe.batch_target().block_tokens
    assert num_system >= b and cached[0] == 0 and all(c >= num_system // b * b for c in cached[1:])
    assert metrics[("ovdflash:prefix_cache_hits_total", ())] == sum(cached) > 0
    # the pool's gauges: nothing running, the shared prompt's blocks cached, all adding up to the pool
    pool = {state: metrics[("ovdflash:kv_pool_blocks", (("state", state),))] for state in ("used", "cached", "free")}
    assert pool["used"] == 0 and pool["cached"] >= num_system // b and sum(pool.values()) == engine.scheduler.batch.scheduler.target.pool_blocks
    assert metrics[("ovdflash:resident_memory_bytes", ())] > 50 << 20
    assert metrics[("ovdflash:prefix_cache_queries_total", ())] == sum(r.usage.prompt_tokens for r in replies)
    assert texts == [pipe.generate(m, max_new_tokens=8, block_size=4, prefix_cache=False).text for m in chats]
    with serving(pipe, block_size=4) as (url, engine):  # the pipeline's prefix_cache is off: nothing reused
        _, replies = ask_all(url)
        assert ("ovdflash:prefix_cache_hits_total", ()) not in scrape(url)
    assert all(not (r.usage.prompt_tokens_details and r.usage.prompt_tokens_details.cached_tokens) for r in replies)
