"""Memory that stays bounded under varied traffic (docs/SERVING.md, Memory).

Checked: every model the runtime compiles for the CPU carries the runtime-cache bound, and oneDNN's
primitive cache is bounded before the first compile unless the environment sets it (the CPU
plugin keeps one executor per input shape it meets, and without a bound a server meeting new
prompt lengths, batch mixes and verify widths grows by GBs); a few hundred prompts of distinct
lengths, single and batched, meet more distinct shapes than that bound (so the bound is what keeps
the plugin's caches finite), keep the outputs unchanged and leave nothing per request behind; the
default KV pool is one full context shared by the batch, capped by the memory available, and the
start-up line says what it holds; the pool's used / cached / free blocks add up to the pool.
"""
import os
import platform

import numpy as np
import openvino as ov
import pytest

from ovdflash.manifest import load_manifest
from ovdflash.ov import compile as ov_compile
from ovdflash.ov import paged
from ovdflash.ov import runners
from ovdflash.ov.paged_batch import (
    batch_target_for,
    block_tokens_of,
    cache_inputs_of,
    default_pool_blocks,
    describe_pool,
    paged_compiled,
    pool_bytes_per_block,
)


class RecordingCore(ov.Core):
    """An ov.Core that records the config of every compile_model call."""

    def __init__(self):
        super().__init__()
        self.configs = []
        self.onednn = []  # oneDNN's primitive cache bound in the environment at each compile

    def compile_model(self, model, device=None, config=None):
        self.configs.append(dict(config or {}))
        self.onednn.append(os.environ.get(ov_compile.ONEDNN_CACHE_VARIABLE))
        return super().compile_model(model, device, config or {})


@pytest.mark.parametrize("target_runner", ["paged", "stateful"])
def test_every_cpu_compile_is_bounded(tiny_pair, target_runner, monkeypatch):
    monkeypatch.delenv(ov_compile.ONEDNN_CACHE_VARIABLE, raising=False)
    core = RecordingCore()
    ov_compile.compile_runners(tiny_pair, load_manifest(tiny_pair), "CPU", {}, core=core, target_runner=target_runner)
    assert len(core.configs) == 2  # target and drafter
    for config in core.configs:
        assert config["CPU_RUNTIME_CACHE_CAPACITY"] == str(ov_compile.RUNTIME_CACHE_CAPACITY)
    assert core.onednn == [str(ov_compile.ONEDNN_CACHE_CAPACITY)] * 2
    monkeypatch.setenv(ov_compile.ONEDNN_CACHE_VARIABLE, "512")  # the user's value wins
    ov_compile.cpu_defaults("CPU", {})
    assert os.environ[ov_compile.ONEDNN_CACHE_VARIABLE] == "512"
    # a value the caller sets wins
    core = RecordingCore()
    ov_compile.compile_runners(tiny_pair, load_manifest(tiny_pair), "CPU", {"CPU_RUNTIME_CACHE_CAPACITY": "7"}, core=core)
    assert {c["CPU_RUNTIME_CACHE_CAPACITY"] for c in core.configs} == {"7"}
    assert "CPU_RUNTIME_CACHE_CAPACITY" not in ov_compile.cpu_defaults("GPU", {})


def test_hybrid_compiles_are_bounded(export_tiny_pair):
    model_dir = export_tiny_pair(arch="qwen3_5_text")
    core = RecordingCore()
    ov_compile.compile_runners(model_dir, load_manifest(model_dir), "CPU", {}, core=core, target_runner="hybrid")
    assert len(core.configs) == 3  # the hybrid target, its replay graph and the drafter
    assert all(c["CPU_RUNTIME_CACHE_CAPACITY"] == str(ov_compile.RUNTIME_CACHE_CAPACITY) for c in core.configs)


def test_distinct_lengths_leave_nothing_behind(tiny_pair, tmp_path, monkeypatch):
    from ovdflash import DFlashPipeline

    shapes = {}  # compiled model -> distinct input shape signatures its requests ran
    run = runners.run_request

    def recording_run(request, inputs):
        key = request.get_compiled_model().get_runtime_model().get_friendly_name() + str(
            sorted(i.get_any_name() for i in request.model_inputs))
        shapes.setdefault(key, set()).add(tuple((k, np.shape(v)) for k, v in sorted(inputs.items())))
        return run(request, inputs)

    monkeypatch.setattr(runners, "run_request", recording_run)
    monkeypatch.setattr(paged, "run_request", recording_run)
    pipe = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 500, size=n)] for n in range(2, 202)]  # 200 distinct lengths
    singles = [[e.token for e in pipe.generate_tokens(p, max_new_tokens=2 + i % 7)] for i, p in enumerate(prompts[:60])]
    from ovdflash.batch_generation import BatchGeneration

    batch = BatchGeneration(pipe, max_batch_size=4)
    for i, p in enumerate(prompts):
        batch.add(i, p, max_new_tokens=2 + i % 7, block_size="auto" if i % 2 else 4)
    outs = {}
    while batch.has_work():
        for o in batch.step():
            if o.finished:
                outs[o.request_id] = o.result.token_ids
    assert len(outs) == len(prompts)
    for i, single in enumerate(singles):  # batching and new shapes change no output
        assert outs[i] == single
    # more distinct shapes than the plugin may keep executors for: the bound is what keeps it finite
    assert max(len(s) for s in shapes.values()) > ov_compile.RUNTIME_CACHE_CAPACITY
    # nothing per request is kept once it ended
    target = batch.scheduler.target
    assert not batch.requests and not batch.scheduler.running and not batch.scheduler.waiting
    assert not target.seqs and not target.refs and target.num_referenced == 0 and target.num_budgeted == 0
    drafters = batch.scheduler.drafters  # the batch's drafter rows: no context of an ended request
    assert not drafters.members and drafters.state_rows == drafters.length == 0
    usage = batch.pool_usage()
    assert usage["used"] == 0 and usage["cached"] + usage["free"] == target.pool_blocks
    assert usage["cached"] == len(target.cached) and usage["allocated"] <= target.pool_blocks


def test_default_pool_is_one_context_capped_by_memory(tiny_pair, tmp_path):
    from ovdflash import DFlashPipeline

    pipe = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path)
    compiled = paged_compiled(pipe.target)
    block_tokens = block_tokens_of(cache_inputs_of(compiled))
    one_context = -(-pipe.target.max_length // block_tokens)
    assert default_pool_blocks(compiled, pipe.target.max_length, available=1 << 40) == one_context
    per_block = pool_bytes_per_block(compiled)
    small = default_pool_blocks(compiled, pipe.target.max_length, available=40 * per_block)
    assert small == 10  # a quarter of what is available
    assert batch_target_for(pipe.target).pool_blocks == default_pool_blocks(compiled, pipe.target.max_length)
    text = describe_pool(compiled, 10)
    assert f"{10 * block_tokens} tokens in 10 blocks" in text and "f32 KV" in text and "prefix features" in text
    assert "prefix features" not in describe_pool(compiled, 10, prefix_caching=False)


def test_free_heap_goes_back_on_glibc():
    from ovdflash.ov.memory import release_free_heap

    blocks = [bytearray(64 << 10) for _ in range(2000)]  # 128 MB of the C heap, then freed
    del blocks
    assert release_free_heap() is (platform.libc_ver()[0] == "glibc")


class InstantBackend:
    """A server backend whose every request finishes at its first step (no model)."""

    def __init__(self):
        self.waiting = []

    num_running = property(lambda self: 0)
    num_waiting = property(lambda self: len(self.waiting))

    def has_unfinished(self):
        return bool(self.waiting)

    def add(self, request_id, prompt_ids, params):
        self.waiting.append(request_id)

    def abort(self, request_id):
        return []

    def step(self):
        from ovdflash.decode.stats import GenerationStats
        from ovdflash.server.engine import RequestOutput

        done, self.waiting = self.waiting, []
        return [RequestOutput(r, "x", 1, True, "length", GenerationStats()) for r in done]


def test_the_server_trims_the_heap_as_requests_finish(monkeypatch):
    import asyncio

    from ovdflash.ov import memory
    from ovdflash.server import engine as server_engine

    trims = []
    monkeypatch.setattr(memory, "release_free_heap", lambda: trims.append(1) or True)
    monkeypatch.setattr(server_engine, "TRIM_INTERVAL_S", 0.0)

    async def run():
        engine = server_engine.AsyncEngine(InstantBackend(), max_num_seqs=1, max_queue=8)
        engine.start()
        for i in range(5):
            outputs = [o async for o in engine.add(f"r{i}", [1, 2], server_engine.RequestParams(max_tokens=1))]
            assert outputs[-1].finished
        engine.close()

    asyncio.run(run())
    assert len(trims) >= 5  # each finished request (and the idle worker) gives the free heap back
