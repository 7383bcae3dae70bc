"""`ovdflash serve`'s app as replicas on Ray Serve: a local Ray instance on loopback (2 CPUs, no
dashboard, small object store), 2 replicas of the tiny pair (1 CPU, 1 OpenVINO thread each) behind
Ray's proxy, talked to with the official `openai` client.

Checked: without Ray, `serve --replicas` is a one-line error naming the extra; `ovdflash serve
--replicas 2` serves both replicas and exits 0 on SIGTERM; through the Python entry, 16 requests
(half streamed) give the texts of `DFlashPipeline.generate` under the same numerics, and their
`x-ovdflash-replica` headers name both replicas; /health lists both replicas, ok, with one
OpenVINO thread each; /metrics carries each replica's series labelled by replica and their
generation tokens sum to the responses' completion tokens; after one replica's actor is killed,
every request sent afterwards succeeds (failures are counted, the client never retries), the dead
replica serves nothing more, the other answers while Ray Serve brings up a new replica, which
then serves requests and shows in /health.
"""
import importlib.util
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

from ovdflash.server.ray_app import REPLICA_HEADER  # noqa: E402  (imports no Ray)

# not importorskip: Ray must not be imported before start_local_ray
requires_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                  reason="Ray is not installed (pip install 'ovdflash[ray]')")
STRICT = ("INFERENCE_PRECISION_HINT=f32", "KV_CACHE_PRECISION=f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE=0")
PROMPTS = ["Hello there", "Write a short poem about the sea.", "What is 2 + 2?", "List three colours."]
MAX_TOKENS = 16
REPORT_INTERVAL_S = 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(url, timeout=30) -> dict:
    response = httpx.get(url + "/health", timeout=timeout)
    assert response.status_code == 200, response.text
    return response.json()


def test_replicas_without_ray_is_a_one_line_error(tiny_pair):
    hide_ray = "import sys; sys.modules['ray'] = None; from ovdflash.cli import main; main()"
    done = subprocess.run([sys.executable, "-c", hide_ray, "serve", str(tiny_pair), "--replicas", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'ovdflash[ray]'" in lines[0], done.stderr


@requires_ray
def test_cli_serves_replicas_and_stops_on_sigterm(tiny_pair, tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "ovdflash.cli", "serve", str(tiny_pair), "--replicas", "2",
                             "--port", str(port), "--cache-dir", str(tmp_path / "cache"), "--block-size", "4",
                             "--served-model-name", "tiny", "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline, state = time.monotonic() + 240, {}
        while time.monotonic() < deadline and proc.poll() is None:
            try:  # the state seen "ok" is the one checked: a second read may race a late report on a busy host
                state = httpx.get(url + "/health", timeout=5).json()
                if state.get("status") == "ok":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        assert state.get("status") == "ok" and len(state["replicas"]) == 2, state
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        replica, text, _ = ask(client, PROMPTS[0], stream=True)
        assert text and replica in {r["replica"] for r in state["replicas"]}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.fixture(scope="module")
def ray_server(tiny_pair, tmp_path_factory):
    from ovdflash.server import ray_app

    ray_app.start_local_ray(num_cpus=2, object_store_memory=80 << 20)
    import ray
    from ray import serve

    port = free_port()
    try:
        app = ray_app.build_ray_app(tiny_pair, replicas=2, num_cpus_per_replica=1, served_model_names=("tiny",),
                                    block_size=4, config=STRICT, cache_dir=tmp_path_factory.mktemp("ray_cache"),
                                    max_model_len=256, report_interval_s=REPORT_INTERVAL_S,
                                    health_check_period_s=1.0)
        ray_app.run_app(app, "127.0.0.1", port, "warning")
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_pair, tmp_path_factory):
    from ovdflash import STRICT_F32, DFlashPipeline

    return DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("ref_cache"),
                                          **STRICT_F32, INFERENCE_NUM_THREADS="1")


@pytest.fixture
def client(ray_server):
    return openai.OpenAI(base_url=ray_server + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, prompt: str, stream: bool) -> tuple[str, str, int]:
    """(replica tag, text, completion tokens) of one greedy chat request."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0,
        stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}))
    replica = raw.headers.get(REPLICA_HEADER)
    body = raw.parse()
    if not stream:
        return replica, body.choices[0].message.content, body.usage.completion_tokens
    pieces, tokens = [], None
    for chunk in body:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return replica, "".join(pieces), tokens


def expected(reference, prompt):
    return reference.generate([{"role": "user", "content": prompt}], max_new_tokens=MAX_TOKENS, block_size=4,
                              temperature=0.0).text


@requires_ray
def test_replicas_answer_name_themselves_and_report(ray_server, client, reference):
    jobs = [(PROMPTS[i % len(PROMPTS)], i % 2 == 1) for i in range(16)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda job: ask(client, *job), jobs))
    want = {p: expected(reference, p) for p in PROMPTS}
    for (prompt, stream), (replica, text, _) in zip(jobs, results):
        assert text == want[prompt], (prompt, stream, replica)
    tags = {replica for replica, _, _ in results}
    assert None not in tags and len(tags) == 2, tags

    state = health(ray_server)
    assert state["status"] == "ok" and state["replicas_ok"] == 2, state
    listed = {r["replica"]: r for r in state["replicas"]}
    assert set(listed) == tags, state
    assert all(r["status"] == "ok" and r["inference_threads"] == 1 for r in listed.values()), state

    time.sleep(3 * REPORT_INTERVAL_S)  # every replica has reported its counters since the last request
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(ray_server + "/metrics", timeout=30).text
    generated = {s.labels["replica"]: s.value for f in text_string_to_metric_families(text)
                 for s in f.samples if s.name == "ovdflash:generation_tokens_total"}
    assert set(generated) == tags, text[:2000]
    assert sum(generated.values()) == sum(tokens for _, _, tokens in results)


def replica_actor(tag: str):
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and a["name"].endswith("#" + tag)]
    assert len(names) == 1, names
    return ray.get_actor(names[0], namespace="serve")


@requires_ray
def test_killed_replica_is_replaced_while_the_other_answers(ray_server, client):
    import ray

    before = {r["replica"] for r in health(ray_server)["replicas"] if r["status"] == "ok"}
    assert len(before) == 2
    victim = sorted(before)[0]
    ray.kill(replica_actor(victim))

    served, failures, lock = [], [], threading.Lock()

    def one(i):
        try:
            replica, text, _ = ask(client, PROMPTS[i % len(PROMPTS)], stream=i % 2 == 0)
            assert text, "empty answer"
            with lock:
                served.append(replica)
        except Exception as exc:  # counted, never retried
            with lock:
                failures.append(f"{type(exc).__name__}: {exc}")

    deadline, i = time.monotonic() + 150, 0
    newcomers = set()
    with ThreadPoolExecutor(2) as pool:
        while time.monotonic() < deadline:
            list(pool.map(one, range(i, i + 2)))
            i += 2
            newcomers = set(served) - before
            if newcomers and sum(r in newcomers for r in served) >= 2:
                break
    assert not failures, f"{len(failures)} of {i} requests failed after the kill: {failures[:3]}"
    assert victim not in served, "the killed replica still answered"
    assert any(r in before for r in served), "the surviving replica answered nothing while the other restarted"
    assert newcomers, f"no new replica served within the deadline ({i} requests, all by {set(served)})"
    want_ok = (before - {victim}) | newcomers
    for _ in range(40):  # a new replica reports within an interval; the dead one goes silent after silent_after_s
        state = health(ray_server)
        ok = {r["replica"] for r in state["replicas"] if r["status"] == "ok"}
        if ok == want_ok:
            break
        time.sleep(REPORT_INTERVAL_S)
    assert ok == want_ok and state["status"] == "ok", state


def test_replica_settings_carry_the_batch_budgets_the_cache_bound_and_the_confidence_threshold(tiny_pair):
    from ovdflash.server.ray_app import replica_settings

    from ovdflash.decode.scheduler import DEFAULT_PREFILL_BATCH_TOKENS

    settings = replica_settings(tiny_pair, 2, 1.0, max_num_batched_tokens=256, confidence_threshold=0.5)
    assert settings.options.max_num_batched_tokens == 256 and settings.options.confidence_threshold == 0.5
    assert settings.options.prefill_batch_tokens == DEFAULT_PREFILL_BATCH_TOKENS
    assert replica_settings(tiny_pair, 2, 1.0, prefill_batch_tokens=None).options.prefill_batch_tokens is None
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        replica_settings(tiny_pair, 2, 1.0, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="--prefill-batch-tokens"):
        replica_settings(tiny_pair, 2, 1.0, prefill_batch_tokens=0)
    with pytest.raises(ValueError, match="confidence_threshold"):
        replica_settings(tiny_pair, 2, 1.0, confidence_threshold=1.5)
    assert replica_settings(tiny_pair, 2, 1.0, prefix_cache_memory_bytes="0").options.prefix_cache_memory_bytes == "0"
    with pytest.raises(ValueError, match="--prefix-cache-memory-bytes must be a size"):
        replica_settings(tiny_pair, 2, 1.0, prefix_cache_memory_bytes="half")
