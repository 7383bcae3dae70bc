"""The server's engine under timing the tests control: a real uvicorn server in a thread over the tiny
pair, whose pipeline runs a round only when the test releases one (`PacedPipeline`), so what
happens between two rounds is checked deterministically.

Checked: a client that disconnects mid-stream stops its generation within a round, leaks no
request, and the next request is served with the right text; a non-streamed request whose client
goes away while it waits in the queue never runs; beyond --max-queue: 503 with Retry-After, and
the admitted requests still finish; shutdown ends open requests with finish_reason "abort" and a
complete stream; a failure inside one request is a 500 for that request only.
"""
import contextlib
import json
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from test_serve import free_port, scrape  # noqa: E402  (tests/ is on sys.path under pytest)

MSG = [{"role": "user", "content": "Tell me a long story."}]


class PacedPipeline:
    """The tiny pipeline, but each round waits for a permit from the test (the last one's tail does not)."""

    def __init__(self, pipe):
        self._pipe = pipe
        self.permits = threading.Semaphore(0)
        self.rounds_run = 0
        self.fail_next = False

    def __getattr__(self, name):
        return getattr(self._pipe, name)

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self.permits.release()

    def stream_rounds(self, prompt, result, *args, **kwargs):
        rounds = self._pipe.stream_rounds(prompt, result, *args, **kwargs)
        try:
            while True:
                if not result.finish_reason:
                    assert self.permits.acquire(timeout=60), "the test never released a round"
                    if self.fail_next:
                        self.fail_next = False
                        raise RuntimeError("a plugin failure")
                try:
                    piece = next(rounds)
                except StopIteration:
                    return
                self.rounds_run += 1
                yield piece
        finally:
            rounds.close()


@pytest.fixture(scope="module")
def pipe(tiny_pair, tmp_path_factory):
    from ovdflash import DFlashPipeline

    return DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("engine_cache"))


# the metric sample counting the requests that ended aborted
ABORTED = ("ovdflash:request_success_total", (("finished_reason", "abort"),))


def wait_until(condition, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)


@contextlib.contextmanager
def serving(pipe, **options):
    """(url, paced pipeline, engine) of a fresh app over `pipe`, served from a thread."""
    import uvicorn

    from ovdflash.server.app import DrainingServer
    from ovdflash.server.wiring import build_server_app

    paced = PacedPipeline(pipe)
    app = build_server_app(paced, ["tiny"], block_size=4, **options)
    port = free_port()
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"),
                            shutdown_timeout=0)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, what="the server to start")
        yield f"http://127.0.0.1:{port}", paced, app.state.engine
    finally:
        paced.release(10_000)  # nothing may stay blocked on a round
        server.should_exit = True
        thread.join(60)
        assert not thread.is_alive()


def test_disconnect_mid_stream_stops_within_a_round_and_the_next_request_is_served(pipe):
    with serving(pipe) as (url, paced, engine):
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                          json={"messages": MSG, "max_tokens": 200, "temperature": 0, "stream": True}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")  # the opening chunk, before any round
            paced.release(3)
            wait_until(lambda: paced.rounds_run == 3, what="three rounds")
        # the client is gone: the server notices, drops the request, and the engine stops it
        wait_until(lambda: engine.num_open_requests == 0, what="the abort")
        paced.release(5)
        # the worker ends a request in the scheduler first and records its metrics after
        wait_until(lambda: not engine.scheduler.has_unfinished() and ABORTED in scrape(url),
                   what="the engine to stop the request and count it")
        assert paced.rounds_run <= 4  # at most the round that was already running
        metrics = scrape(url)
        assert metrics[ABORTED] == 1
        assert metrics[("ovdflash:generation_tokens_total", ())] < 200
        assert metrics[("ovdflash:num_requests_running", ())] == 0

        paced.release(10_000)
        body = httpx.post(url + "/v1/chat/completions", timeout=60,
                          json={"messages": MSG, "max_tokens": 20, "temperature": 0}).json()
        want = pipe.generate(MSG, max_new_tokens=20, temperature=0.0, block_size=4)
        assert body["choices"][0]["message"]["content"] == want.text
        assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_beyond_max_queue_is_503_with_retry_after_and_admitted_requests_finish(pipe):
    with serving(pipe, max_queue=1) as (url, paced, engine):
        results = {}

        def request(name, max_tokens):
            results[name] = httpx.post(url + "/v1/chat/completions", timeout=60,
                                       json={"messages": MSG, "max_tokens": max_tokens, "temperature": 0})

        running = threading.Thread(target=request, args=("running", 12))
        waiting = threading.Thread(target=request, args=("waiting", 8))
        running.start()
        wait_until(lambda: engine.num_open_requests == 1, what="the first request")
        waiting.start()
        wait_until(lambda: engine.num_open_requests == 2, what="the second request")
        refused = httpx.post(url + "/v1/chat/completions", timeout=60, json={"messages": MSG, "max_tokens": 4})
        assert refused.status_code == 503
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "queue_full"
        assert scrape(url)[("ovdflash:num_requests_waiting", ())] == 1
        paced.release(10_000)
        running.join(60)
        waiting.join(60)
        assert results["running"].status_code == results["waiting"].status_code == 200
        want = pipe.generate(MSG, max_new_tokens=8, temperature=0.0, block_size=4).text
        assert results["waiting"].json()["choices"][0]["message"]["content"] == want
        assert scrape(url)[("ovdflash:request_rejected_total", (("reason", "queue_full"),))] == 1


def test_a_queued_request_whose_client_left_never_runs(pipe):
    with serving(pipe) as (url, paced, engine):
        first = threading.Thread(target=lambda: httpx.post(url + "/v1/chat/completions", timeout=60,
                                                           json={"messages": MSG, "max_tokens": 6}))
        first.start()
        wait_until(lambda: engine.num_open_requests == 1, what="the first request")
        with pytest.raises(httpx.ReadTimeout):  # a client that gives up while queued
            httpx.post(url + "/v1/chat/completions", timeout=0.5, json={"messages": MSG, "max_tokens": 50})
        wait_until(lambda: engine.num_open_requests == 1, what="the queued request's abort")
        paced.release(10_000)
        first.join(60)
        wait_until(lambda: not engine.scheduler.has_unfinished() and ABORTED in scrape(url),
                   what="the engine to go idle and count the abort")
        metrics = scrape(url)
        assert metrics[ABORTED] == 1
        assert metrics[("ovdflash:generation_tokens_total", ())] == 6  # only the first request generated
        assert metrics[("ovdflash:prompt_tokens_total", ())] == len(pipe.encode_prompt(MSG))


def test_shutdown_ends_open_streams_with_abort_and_done(pipe):
    with serving(pipe) as (url, paced, engine):
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                          json={"messages": MSG, "max_tokens": 200, "temperature": 0, "stream": True,
                                "stream_options": {"include_usage": True}}) as response:
            lines = response.iter_lines()
            next(lines)
            paced.release(2)
            wait_until(lambda: paced.rounds_run == 2, what="two rounds")
            engine.begin_shutdown(0)
            paced.release(1)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        events = [json.loads(line[len("data: "):]) for line in rest[:-1]]
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "abort"
        assert 1 <= events[-1]["usage"]["completion_tokens"] < 200
        refused = httpx.post(url + "/v1/chat/completions", timeout=10, json={"messages": MSG})
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert httpx.get(url + "/health", timeout=10).status_code == 503


def test_a_failure_inside_one_request_is_a_500_for_it_alone(pipe):
    with serving(pipe) as (url, paced, engine):
        paced.fail_next = True
        paced.release(10_000)
        failed = httpx.post(url + "/v1/chat/completions", timeout=60, json={"messages": MSG, "max_tokens": 8})
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert "a plugin failure" in error["message"] and error["type"] == "server_error"
        again = httpx.post(url + "/v1/chat/completions", timeout=60,
                           json={"messages": MSG, "max_tokens": 8, "temperature": 0})
        assert again.status_code == 200
        assert again.json()["choices"][0]["message"]["content"] == \
            pipe.generate(MSG, max_new_tokens=8, temperature=0.0, block_size=4).text
        assert httpx.get(url + "/health", timeout=10).status_code == 200
