"""`ovdflash serve` as a client sees it: a real server process on 127.0.0.1 over the tiny exported pair,
talked to with the official `openai` client (and raw httpx where the wire itself is the point).

Checked: greedy text equals `DFlashPipeline.generate` (chat and completions, with stop strings,
seeded sampling too); streamed pieces concatenate to the same text and end in `data: [DONE]`;
8 concurrent clients x 4 requests give the sequential texts; every hard edge answers its status
and OpenAI's error JSON and /health still answers afterwards; /metrics counters equal the sums
of the responses' `usage.spec_decode`; /tokenize and /detokenize; `ovdflash bench-serve` against
this server; SIGTERM and SIGINT end an open stream cleanly and exit 0; `serve` without MODEL_DIR
loads the embedded default.
"""
import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

KEY = "sk-test-key"
MAX_MODEL_LEN = 256
MAX_REQUEST_BYTES = 64 * 1024
NAMES = ("tiny", "tiny-alias")
CHATS = ["Hello there", "Write a short poem about the sea.", "What is 2 + 2?", "List three colours."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving_app(app):
    """The base URL of `app`, served by uvicorn from a thread until the block ends."""
    import uvicorn

    from ovdflash.server.app import DrainingServer

    port = free_port()
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"),
                            shutdown_timeout=0)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(60)
        assert not thread.is_alive()


def wait_healthy(url: str, proc=None, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not become healthy in {timeout_s} s")


def start_server(model_dir, log_path, cache_dir, *args):
    port = free_port()
    cmd = [sys.executable, "-m", "ovdflash.cli", "serve", str(model_dir), "--port", str(port),
           "--cache-dir", str(cache_dir), "--log-level", "warning", *args]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
    except Exception:
        proc.kill()
        proc.wait(30)
        raise RuntimeError(f"server did not start: {open(log_path).read()[-3000:]}")
    return proc, url


def stop_server(proc, sig=signal.SIGTERM) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
        return -9


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    names = [a for n in NAMES for a in ("--served-model-name", n)]
    proc, url = start_server(tiny_pair, tmp / "server.log", tmp / "cache", "--api-key", KEY, "--max-model-len",
                             str(MAX_MODEL_LEN), "--max-request-bytes", str(MAX_REQUEST_BYTES), "--max-queue", "64",
                             "--block-size", "4", *names)
    yield url
    assert stop_server(proc) == 0, (tmp / "server.log").read_text()[-3000:]


@pytest.fixture(scope="module")
def reference(tiny_pair, tmp_path_factory):
    from ovdflash import DFlashPipeline

    return DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("ref_cache"))


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def chat(client, content, **kwargs):
    kwargs.setdefault("max_tokens", 24)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kwargs)


def expected(reference, content, max_tokens=24, **kwargs):
    kwargs.setdefault("temperature", 0.0)
    return reference.generate([{"role": "user", "content": content}], max_new_tokens=max_tokens, block_size=4,
                               **kwargs)


def post(server, path, body, key=KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(server + path, content=content, headers={**headers, "Content-Type": "application/json"},
                      timeout=60)


# -- answers ---------------------------------------------------------------------------------
def test_models_lists_the_served_names(client):
    models = client.models.list()
    assert [m.id for m in models.data] == list(NAMES)
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_greedy_chat_equals_the_pipeline(client, reference):
    for content in CHATS[:3]:
        want = expected(reference, content)
        got = chat(client, content)
        assert got.choices[0].message.content == want.text
        assert got.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
        assert got.usage.completion_tokens == len(want.token_ids)
        assert got.usage.prompt_tokens == len(reference.encode_prompt([{"role": "user", "content": content}]))
        spec = got.usage.model_extra["spec_decode"]
        assert spec["num_drafts"] == want.stats.num_drafts > 0
        assert spec["num_accepted_tokens"] == want.stats.num_accepted_tokens
        assert sum(spec["num_accepted_tokens_per_pos"]) == spec["num_accepted_tokens"]
        assert spec["mean_acceptance_length"] == pytest.approx(want.stats.mean_acceptance_length)


def test_the_alias_and_a_missing_model_name_are_served(server, client, reference):
    want = expected(reference, CHATS[0]).text
    alias = client.chat.completions.create(model="tiny-alias", messages=[{"role": "user", "content": CHATS[0]}],
                                           max_tokens=24, temperature=0)
    assert alias.model == "tiny-alias" and alias.choices[0].message.content == want
    body = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": CHATS[0]}],
                                                 "max_tokens": 24, "temperature": 0}).json()
    assert body["model"] == "tiny" and body["choices"][0]["message"]["content"] == want


def test_completions_equal_the_pipeline_on_raw_text_and_token_ids(client, reference):
    prompt = "The capital of France is"
    want = reference.generate(prompt, max_new_tokens=20, temperature=0.0, block_size=4)
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
    assert got.choices[0].text == want.text
    ids = reference.encode_prompt(prompt)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=20, temperature=0)
    assert by_ids.choices[0].text == want.text


def test_stop_strings_and_seeded_sampling_equal_the_pipeline(client, reference):
    full = expected(reference, CHATS[1], max_tokens=40).text
    stop = full[10:13]
    assert stop.strip(), full
    want = expected(reference, CHATS[1], max_tokens=40, stop=[stop])
    got = chat(client, CHATS[1], max_tokens=40, stop=[stop])
    assert got.choices[0].message.content == want.text and stop not in want.text
    assert got.choices[0].finish_reason == "stop"
    sampled = expected(reference, CHATS[2], max_tokens=30, temperature=0.8, seed=7)
    for _ in range(2):
        got = chat(client, CHATS[2], max_tokens=30, temperature=0.8, seed=7)
        assert got.choices[0].message.content == sampled.text


def test_streamed_chat_concatenates_to_the_same_text(client, reference):
    want = expected(reference, CHATS[1], max_tokens=40)
    stream = chat(client, CHATS[1], max_tokens=40, stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == want.text
    assert len([p for p in pieces if p]) > 1  # really in pieces
    assert finish == "length"
    assert usage.completion_tokens == len(want.token_ids)
    assert usage.model_extra["spec_decode"]["num_drafts"] == want.stats.num_drafts


def test_streamed_completion_on_the_wire_ends_with_done(server, reference):
    want = reference.generate("Once upon a time", max_new_tokens=20, temperature=0.0, block_size=4)
    with httpx.stream("POST", server + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0,
                            "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert all("usage" not in e for e in events)  # no usage chunk unless asked for
    assert "".join(e["choices"][0]["text"] for e in events) == want.text


def test_eight_concurrent_clients_get_the_sequential_texts(server, client):
    prompts = [f"{CHATS[i % 4]} ({i})" for i in range(32)]
    sequential = [chat(client, p, max_tokens=16).choices[0].message.content for p in prompts]

    def one_client(k):
        own = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=300)
        return [chat(own, prompts[k * 4 + j], max_tokens=16).choices[0].message.content for j in range(4)]

    with ThreadPoolExecutor(8) as pool:
        concurrent = [text for texts in pool.map(one_client, range(8)) for text in texts]
    assert concurrent == sequential


def test_tokenize_and_detokenize(server, reference):
    body = post(server, "/tokenize", {"prompt": "Hello there"}).json()
    assert body["tokens"] == reference.encode_prompt("Hello there") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    messages = [{"role": "user", "content": "Hi"}]
    assert post(server, "/tokenize", {"messages": messages}).json()["tokens"] == reference.encode_prompt(messages)
    text = post(server, "/detokenize", {"tokens": body["tokens"]}).json()["prompt"]
    assert text == reference.tokenizer.decode(body["tokens"])


# -- hard edges ------------------------------------------------------------------------------
MSG = [{"role": "user", "content": "hi"}]
LONG_IDS = [5] * (MAX_MODEL_LEN + 20)
EDGES = [
    # (name, path, body or raw bytes, key, status, param, words in the message)
    ("malformed JSON", "/v1/chat/completions", b'{"messages": [', KEY, 400, None, ["JSON"]),
    ("not an object", "/v1/chat/completions", b"[1, 2]", KEY, 400, None, ["object"]),
    ("max_tokens as a string", "/v1/chat/completions", {"messages": MSG, "max_tokens": "10"}, KEY, 400,
     "max_tokens", []),
    ("temperature as a bool", "/v1/chat/completions", {"messages": MSG, "temperature": True}, KEY, 400,
     "temperature", []),
    ("content as a number", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, KEY, 400,
     "messages[0].content", []),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "function", "content": "x"}]}, KEY, 400,
     "messages[0].role", []),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-9", "messages": MSG}, KEY, 404, "model", ["gpt-9"]),
    ("empty messages", "/v1/chat/completions", {"messages": []}, KEY, 400, "messages", ["empty"]),
    ("no messages", "/v1/chat/completions", {"model": "tiny"}, KEY, 400, "messages", []),
    ("prompt over the context", "/v1/completions", {"prompt": LONG_IDS}, KEY, 400, "prompt",
     [str(len(LONG_IDS)), str(MAX_MODEL_LEN)]),
    ("chat over the context", "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 400}]},
     KEY, 400, "messages", [str(MAX_MODEL_LEN), "tokens"]),
    ("max_tokens beyond the context", "/v1/completions", {"prompt": [5] * 10, "max_tokens": 500}, KEY, 400,
     "max_tokens", ["500", "10", str(MAX_MODEL_LEN - 10)]),
    ("max_completion_tokens beyond the context", "/v1/chat/completions",
     {"messages": MSG, "max_completion_tokens": 999}, KEY, 400, "max_completion_tokens", ["999"]),
    ("max_tokens zero", "/v1/chat/completions", {"messages": MSG, "max_tokens": 0}, KEY, 400, "max_tokens", []),
    ("n above the limit", "/v1/chat/completions", {"messages": MSG, "n": 17}, KEY, 400, "n", ["17"]),
    ("top_logprobs over 20", "/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 21}, KEY,
     400, "top_logprobs", []),
    ("tools", "/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function"}]}, KEY, 400,
     "tools[0].function", []),
    ("presence penalty over 2", "/v1/chat/completions", {"messages": MSG, "presence_penalty": 2.5}, KEY, 400,
     "presence_penalty", []),
    ("unknown field", "/v1/chat/completions", {"messages": MSG, "frobnicate": 1}, KEY, 400, "frobnicate", []),
    ("empty stop string", "/v1/chat/completions", {"messages": MSG, "stop": ["ok", ""]}, KEY, 400, "stop[1]", []),
    ("two prompts", "/v1/completions", {"prompt": ["a", "b"]}, KEY, 400, "prompt", []),
    ("token id out of range", "/v1/completions", {"prompt": [1, 10 ** 6]}, KEY, 400, "prompt[1]", []),
    ("echo", "/v1/completions", {"prompt": "a", "echo": True}, KEY, 400, "echo", []),
    ("oversize body", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * MAX_REQUEST_BYTES}]},
     KEY, 413, None, [str(MAX_REQUEST_BYTES)]),
    ("missing API key", "/v1/chat/completions", {"messages": MSG}, None, 401, None, ["API key"]),
    ("wrong API key", "/v1/chat/completions", {"messages": MSG}, "sk-wrong", 401, None, ["API key"]),
    ("wrong API key on completions", "/v1/completions", {"prompt": "a"}, "sk-wrong", 401, None, []),
    ("unknown path", "/v1/embeddings", {"input": "a"}, KEY, 404, None, []),
]


@pytest.mark.parametrize("name,path,body,key,status,param,words", EDGES, ids=[e[0] for e in EDGES])
def test_hard_edges_answer_openai_error_json(server, name, path, body, key, status, param, words):
    raw = body if isinstance(body, bytes) else None
    response = post(server, path, body, key=key, raw=raw)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert "Traceback" not in error["message"] and all(w in error["message"] for w in words), error["message"]
    assert httpx.get(server + "/health", timeout=10).status_code == 200


def test_client_errors_map_to_the_openai_exceptions(server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="nope", max_retries=0).models.list()
    good = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        good.chat.completions.create(model="nope", messages=MSG)
    with pytest.raises(openai.BadRequestError, match="context"):
        good.completions.create(model="tiny", prompt=LONG_IDS)


# -- metrics ---------------------------------------------------------------------------------
def scrape(server) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(httpx.get(server + "/metrics", timeout=10).text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            values[(sample.name, labels)] = sample.value
    return values


def test_metrics_agree_with_the_responses(server, client):
    before = scrape(server)
    usages = [chat(client, c, max_tokens=30).usage for c in CHATS]
    stream = chat(client, CHATS[0], max_tokens=30, stream=True, stream_options={"include_usage": True})
    usages += [chunk.usage for chunk in stream if chunk.usage is not None]
    usages.append(client.completions.create(model="tiny", prompt="Once", max_tokens=12, temperature=0).usage)
    after = scrape(server)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    specs = [u.model_extra["spec_decode"] for u in usages]
    for field in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_lookup_drafts"):
        assert delta(f"ovdflash:spec_decode_{field}_total") == sum(s[field] for s in specs), field
    assert sum(s["num_drafts"] for s in specs) > 0
    for pos in range(3):
        assert delta("ovdflash:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == \
            sum(s["num_accepted_tokens_per_pos"][pos] for s in specs if len(s["num_accepted_tokens_per_pos"]) > pos)
    assert delta("ovdflash:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("ovdflash:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    finished = sum(delta("ovdflash:request_success_total", finished_reason=r) for r in ("stop", "length"))
    assert finished == len(usages)
    assert delta("ovdflash:time_to_first_token_seconds_count") == len(usages)
    assert after[("ovdflash:num_requests_running", ())] == 0


# -- the load generator ----------------------------------------------------------------------
def test_bench_serve_measures_this_server(server, tmp_path):
    from click.testing import CliRunner

    from ovdflash.cli import main

    out = tmp_path / "load.json"
    result = CliRunner().invoke(main, ["bench-serve", "--base-url", server + "/v1", "--api-key", KEY,
                                       "--prompt-set", "math", "--num-prompts", "6", "--concurrency", "3",
                                       "--max-tokens", "12", "--output-json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["completed"] == 6 and report["failed"] == 0 and report["model"] == "tiny"
    assert 6 <= report["total_output_tokens"] <= 6 * 12
    assert report["ttft_ms"]["median"] > 0 and report["tpot_ms"]["p99"] >= report["tpot_ms"]["median"] > 0
    assert report["output_throughput"] > 0 and report["spec_decode"]["num_drafts"] > 0
    from ovdflash.bench.load import eval_prompts

    assert sorted(r["prompt"] for r in report["replies"]) == sorted(eval_prompts(["math"], 6))
    assert all(r["ok"] and r["text"] for r in report["replies"])
    assert "TTFT (ms)" in result.output and "output throughput" in result.output


def test_bench_serve_counts_failures(server):
    from click.testing import CliRunner

    from ovdflash.cli import main

    result = CliRunner().invoke(main, ["bench-serve", "--base-url", server + "/v1", "--api-key", KEY, "--model",
                                       "nope", "--prompt-set", "math", "--num-prompts", "2"])
    assert result.exit_code == 1
    assert "failed requests" in result.output and "NotFoundError" in result.output


# -- process life ----------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_open_streams_cleanly_and_exits_0(tiny_pair, tmp_path, sig):
    proc, url = start_server(tiny_pair, tmp_path / "server.log", tmp_path / "cache", "--shutdown-timeout", "0")
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": "Once upon a time", "max_tokens": 480, "temperature": 0,
                                "stream": True, "stream_options": {"include_usage": True}}) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            proc.send_signal(sig)
            rest = [line for line in lines if line]
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    log = (tmp_path / "server.log").read_text()
    assert code == 0, log[-3000:]
    assert first.startswith("data: ") and rest[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: "):]) for line in [first] + rest[:-1]]
    finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0] in ("abort", "length")
    assert events[-1]["usage"]["completion_tokens"] >= 1
    assert "Traceback" not in log


def test_serve_without_model_dir_uses_the_embedded_default(tiny_pair, monkeypatch):
    from click.testing import CliRunner
    from ovdflash_models import default as default_mod

    from ovdflash.cli import main
    from ovdflash.server import app as app_module

    calls, served = [], []
    monkeypatch.setattr(default_mod, "ensure_default_model", lambda *a, **k: calls.append(1) or tiny_pair)
    monkeypatch.setattr(app_module, "run_server", lambda app, host, port, *a: served.append((app, host, port)))
    result = CliRunner().invoke(main, ["serve", "--port", "9"])
    assert result.exit_code == 0, result.output
    assert calls == [1] and len(served) == 1
    app, host, port = served[0]
    assert host == "127.0.0.1" and port == 9
    assert app.state.engine.pipeline.model_dir == tiny_pair


@pytest.mark.parametrize("args,words", [
    (["--host", "0.0.0.0"], ["--api-key", "--allow-open"]),
    (["--max-num-seqs", "0"], ["--max-num-seqs"]),
    (["--kv-cache-memory-bytes", "lots"], ["--kv-cache-memory-bytes", "4G"]),
    (["--prefix-cache-memory-bytes", "-1M"], ["--prefix-cache-memory-bytes", "(or 0)"]),
    (["--max-num-seqs", "4", "--target-runner", "stateful"], ["paged target runner", "stateful"]),
    (["--block-size", "x"], ["--block-size"]),
])
def test_serve_refuses_bad_options_in_one_line(tiny_pair, args, words):
    from click.testing import CliRunner

    from ovdflash.cli import main

    result = CliRunner().invoke(main, ["serve", str(tiny_pair), *args])
    assert result.exit_code != 0
    assert all(w in result.output for w in words), result.output
    assert "Traceback" not in result.output


def test_the_runtime_does_not_import_the_server_and_the_server_not_torch():
    code = ("import sys, ovdflash.pipeline, ovdflash.cli.serve\n"
            "from ovdflash.cli import main\n"
            "main.get_command(None, 'serve'); main.get_command(None, 'bench-serve')\n"
            "print('BEFORE', sorted({m.split('.')[0] for m in sys.modules} & {'fastapi', 'uvicorn', 'starlette'}))\n"
            "import ovdflash.server.app, ovdflash.bench.load\n"
            "print('AFTER', sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'ovdflash_export'}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "BEFORE []" in proc.stdout and "AFTER []" in proc.stdout, proc.stdout
