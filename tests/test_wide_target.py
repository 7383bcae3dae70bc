"""The paged target's f32-weight copy for wide calls (`OVPagedTarget(wide=...)`) on a tiny pair exported
with fp16 target weights, under STRICT_F32: `graphs.with_f32_weights` stores the same values as f32;
calls of `wide_from` tokens or more run on the copy, which shares the KV cache tensors with the
narrow request (a sequence can move between them every call); greedy DFlash whose verifies run on
the copy equals greedy AR on the narrow one, alone and in a batch; calibration keeps the copy for
the sizes where it is faster or drops it; fp32 weights, bf16 inference or wide_target=False: no copy."""
import os

import numpy as np
import openvino as ov
import pytest

from ovdflash import STRICT_F32, DFlashPipeline
from ovdflash.decode.sampling import SamplingParams
from ovdflash.decode.scheduler import Scheduler
from ovdflash.manifest import load_manifest
from ovdflash.ov import graphs
from ovdflash.ov.compile import compile_runners
from ovdflash.ov.paged import OVPagedTarget
from ovdflash.ov.paged_batch import DrafterPool, batch_target_for
from ovdflash.ov.precision import host_precisions

CONFIG = {"INFERENCE_NUM_THREADS": 1, "CACHE_DIR": "", **STRICT_F32}


@pytest.fixture(scope="module")
def fp16_pair(export_tiny_pair):
    return export_tiny_pair(target_weight_format="fp16")


@pytest.fixture(scope="module")
def runners(fp16_pair):
    """(target with its wide copy used from 2 tokens, drafter), compiled without calibration."""
    target, drafter = compile_runners(fp16_pair, load_manifest(fp16_pair), config=CONFIG)
    assert isinstance(target, OVPagedTarget) and target.wide_request is not None
    target.wide_from = 2  # every verify and prefill runs on the f32 copy, every AR step on the f16 target
    return target, drafter


def test_f32_weights_replace_every_converted_f16_constant_of_a_copy(fp16_pair):
    model = ov.Core().read_model(fp16_pair / "target" / "openvino_model.xml")

    def converted_f16(m):
        return [op for op in m.get_ordered_ops() if op.get_type_name() == "Constant"
                and op.get_output_element_type(0) == ov.Type.f16
                and any(t.get_node().get_type_name() == "Convert" for t in op.output(0).get_target_inputs())]

    before = len(converted_f16(model))
    copy, replaced = graphs.with_f32_weights(model)
    assert replaced == before > 0
    assert converted_f16(copy) == [] and len(converted_f16(model)) == before  # the original is untouched
    assert graphs.with_f32_weights(copy)[1] == 0


def assert_narrow_step_reads_the_copys_kv(target, prompt):
    """After `prompt` was committed by a call on the copy: a narrow 1-token step reads the KV it
    wrote (its logits equal a whole forward's last row). Leaves the target at len(prompt) + 1."""
    step_logits, _ = target.forward(prompt[:1], all_logits=True)
    assert target.last_request is target.request
    step = np.array(step_logits[0])
    target.commit(1)
    target.reset()
    full, _ = target.forward(np.r_[prompt, prompt[:1]], all_logits=True)
    np.testing.assert_allclose(step, full[-1], atol=1e-4)
    target.commit(len(prompt) + 1)


def test_wide_calls_run_on_the_copy_and_share_the_cache(runners):
    target, _ = runners
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 500, 20)
    target.reset()
    target.forward(prompt, all_logits=False)
    assert target.last_request is target.wide_request
    target.commit(len(prompt))
    assert_narrow_step_reads_the_copys_kv(target, prompt)
    for name, tensor in target.caches.items():
        assert target.wide_request.get_tensor(name).data.ctypes.data == tensor.data.ctypes.data


def test_greedy_dflash_on_the_copy_equals_ar(fp16_pair, runners):
    from ovdflash.decode.sequence import generate

    target, drafter = runners
    rng = np.random.default_rng(1)
    for _ in range(6):
        prompt = rng.integers(1, 500, int(rng.integers(2, 40))).tolist()
        ar = [e.token for e in generate(target, None, prompt, 32, SamplingParams(), (), 1)]
        assert [e.token for e in generate(target, drafter, prompt, 32, SamplingParams(), (), 4)] == ar


def test_a_batch_runs_wide_calls_on_the_copy(runners):
    from ovdflash.decode.sequence import generate

    target, drafter = runners
    batch = batch_target_for(target, pool_blocks=64, prefix_caching=False)
    assert batch.wide_request is not None and batch.wide_from == 2
    scheduler = Scheduler(batch, DrafterPool(drafter), max_batch_size=4)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 500, int(rng.integers(2, 30))).tolist() for _ in range(5)]
    for i, p in enumerate(prompts):
        scheduler.add(i, p, 16, SamplingParams(), (1, 4)[i % 2])
    events = {}
    while scheduler.has_work():
        for rid, evs in scheduler.step():
            events.setdefault(rid, []).extend(e.token for e in evs)
    assert 0 < batch.num_wide_calls < scheduler.num_steps  # rounds of several tokens, and single AR steps
    for i, p in enumerate(prompts):
        assert events[i] == [e.token for e in generate(target, None, p, 16, SamplingParams(), (), 1)], i


def test_calibration_keeps_the_copy_where_it_is_faster_or_drops_it(fp16_pair, tmp_path):
    pipe = DFlashPipeline.from_pretrained(fp16_pair, cache_dir=tmp_path, INFERENCE_NUM_THREADS=1, **STRICT_F32)
    target = pipe.target
    if target.wide_request is None:  # the f16 target was as fast at every size on this host: dropped
        assert target.wide_compiled is None and target.last_request is target.request
    else:
        assert target.wide_from in (2, 4, 5, 6, 8, 12, 16, 32)
        assert target.calibrate_wide() in (None, 2, 4, 5, 6, 8, 12, 16, 32)
    assert target.committed == 0
    rng = np.random.default_rng(3)
    prompt = rng.integers(1, 500, 12).tolist()
    ar = [e.token for e in pipe.generate_tokens(prompt, 24, draft=False, eos_token_ids=[])]
    assert [e.token for e in pipe.generate_tokens(prompt, 24, block_size=4, eos_token_ids=[])] == ar


def test_no_copy_for_fp32_weights_bf16_inference_or_when_turned_off(tiny_pair, fp16_pair):
    target, _ = compile_runners(tiny_pair, load_manifest(tiny_pair), config=CONFIG, with_drafter=False)
    assert target.wide_request is None and target.wide_compiled is None
    target, _ = compile_runners(fp16_pair, load_manifest(fp16_pair), config=CONFIG, with_drafter=False,
                                wide_target=False)
    assert target.wide_request is None
    target, _ = compile_runners(fp16_pair, load_manifest(fp16_pair), config={**CONFIG, "KV_CACHE_PRECISION": "f32"},
                                with_drafter=False, target_runner="stateful")
    assert not hasattr(target, "wide_request")
    if "bf16" in host_precisions():  # bf16 inference converts the f16 weights once, at compile time
        bf16 = {**CONFIG, "INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "bf16"}
        target, _ = compile_runners(fp16_pair, load_manifest(fp16_pair), config=bf16, with_drafter=False)
        assert target.wide_request is None


def test_the_f32_ir_is_written_once_per_target_file_and_its_pages_released(fp16_pair, tmp_path, monkeypatch):
    from ovdflash.ov import wide_target
    from ovdflash.ov.memory import mapped_resident_bytes

    xml = fp16_pair / "target" / "openvino_model.xml"
    first = wide_target.f32_weights_ir(xml, tmp_path)
    assert first.is_file() and first.with_suffix(".bin").stat().st_size > xml.with_suffix(".bin").stat().st_size
    stamp = first.with_suffix(".bin").stat().st_mtime_ns
    assert wide_target.f32_weights_ir(xml, tmp_path) == first and first.with_suffix(".bin").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "wide").iterdir()] == [first.parent.name]  # no work directory left

    pipe = DFlashPipeline.from_pretrained(fp16_pair, cache_dir=tmp_path, INFERENCE_NUM_THREADS=1, wide_target=True,
                                          **STRICT_F32)
    if pipe.target.wide_xml is not None:  # kept by calibration: its file is mapped, and released after priming
        assert pipe.target.wide_xml == first
        assert mapped_resident_bytes([first.with_suffix(".bin")]) < first.with_suffix(".bin").stat().st_size // 2

    broken = tmp_path / "broken.xml"
    broken.write_text("<net>")
    broken.with_suffix(".bin").write_bytes(b"")
    with pytest.raises(RuntimeError, match="broken.xml: writing its f32-weight copy failed"):
        wide_target.f32_weights_ir(broken, tmp_path)


def test_auto_builds_the_copy_only_where_memory_allows(fp16_pair, monkeypatch):
    from ovdflash.ov import wide_target

    bin_path = fp16_pair / "target" / "openvino_model.bin"
    size = bin_path.stat().st_size
    assert wide_target.wanted(bin_path, True) and not wide_target.wanted(bin_path, False)
    monkeypatch.setattr(wide_target, "available_memory_bytes", lambda: int(8 * size / wide_target.AUTO_MEMORY_SHARE))
    assert wide_target.wanted(bin_path)
    monkeypatch.setattr(wide_target, "available_memory_bytes", lambda: int(size / wide_target.AUTO_MEMORY_SHARE))
    assert not wide_target.wanted(bin_path)
    monkeypatch.setattr(wide_target, "available_memory_bytes", lambda: None)
    assert not wide_target.wanted(bin_path)


def test_the_copys_file_pages_are_dropped_right_after_its_compile(fp16_pair, tmp_path):
    from ovdflash.ov.memory import mapped_resident_bytes

    # the load's peak: both targets' first calls would otherwise run with the f32 file resident
    target, _ = compile_runners(fp16_pair, load_manifest(fp16_pair), config={**CONFIG, "CACHE_DIR": str(tmp_path)},
                                with_drafter=False, wide_target=True)
    assert target.wide_xml is not None
    copy_bin = target.wide_xml.with_suffix(".bin")
    assert mapped_resident_bytes([copy_bin]) < copy_bin.stat().st_size // 4


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text"])
def test_the_narrow_target_is_renewed_after_calibration_and_keeps_reading_the_shared_cache(export_tiny_pair, arch):
    """recompile_narrow: a fresh narrow compile (the calibration's wide-size calls left the old one's
    kernels resident) bound to the same KV tensors (and a hybrid's state tables); nothing happens
    once the copy is dropped."""
    fp16_pair = export_tiny_pair(arch=arch, target_layer_ids=(1, 3) if arch == "qwen3_5_text" else (1, 2),
                                 target_weight_format="fp16")
    target, _ = compile_runners(fp16_pair, load_manifest(fp16_pair), config=CONFIG, with_drafter=False)
    old = target.compiled
    assert target.narrow_compiler is not None
    target.wide_from = 2
    rng = np.random.default_rng(1)
    prompt = rng.integers(1, 500, 20)
    target.forward(prompt, all_logits=False)  # on the copy, before the renewal
    target.commit(len(prompt))
    assert target.recompile_narrow()
    assert target.compiled is not old and target.narrow_compiler is None and target.last_request is target.request
    for name, tensor in target.caches.items():
        assert target.request.get_tensor(name).data.ctypes.data == tensor.data.ctypes.data
    if target.linear is not None:
        assert target.request in target.linear.requests and len(target.linear.requests) == 2
        for name, tensor in target.linear.tables.items():
            assert target.request.get_tensor(name).data.ctypes.data == tensor.data.ctypes.data
    assert_narrow_step_reads_the_copys_kv(target, prompt)
    assert not target.recompile_narrow()  # the compiler is spent

    dropped, _ = compile_runners(fp16_pair, load_manifest(fp16_pair), config=CONFIG, with_drafter=False)
    kept = dropped.compiled
    dropped.drop_wide()
    assert not dropped.recompile_narrow() and dropped.compiled is kept and dropped.narrow_compiler is None


def test_the_calibration_is_kept_per_host_and_read_back_by_later_loads(fp16_pair, tmp_path, monkeypatch):
    """The first load stores its result beside the copy's IR; later loads with the same host key apply
    the stored value (a size, or None: no copy) without calibrating; an unreadable file or a bad value
    means calibrating again."""
    import json

    from ovdflash.ov import wide_target

    def load():
        return DFlashPipeline.from_pretrained(fp16_pair, cache_dir=tmp_path, INFERENCE_NUM_THREADS=1, **STRICT_F32)

    first = load()
    files = list((tmp_path / "wide").glob("*/calibration.json"))
    assert len(files) == 1
    entries = json.loads(files[0].read_text())
    (host, stored), = entries.items()
    assert "1 threads" in host and "INFERENCE_PRECISION_HINT=f32" in host
    assert stored == (first.target.wide_from if first.target.wide_request is not None else None)

    calibrations, warmed = [], []
    real, real_warm = OVPagedTarget.calibrate_wide, OVPagedTarget.warm_calls
    monkeypatch.setattr(OVPagedTarget, "calibrate_wide",
                        lambda self, *a, **k: calibrations.append(1) or real(self, *a, **k))
    monkeypatch.setattr(OVPagedTarget, "warm_calls", lambda self, *a, **k: warmed.append(1) or real_warm(self, *a, **k))
    files[0].write_text(json.dumps({host: 12}))
    again = load()
    assert not calibrations and again.target.wide_request is not None and again.target.wide_from == 12
    assert warmed == [1] and again.target.committed == 0  # every calibration size ran once, then reset
    assert again.target.narrow_compiler is None
    prompt = np.random.default_rng(5).integers(1, 500, 12).tolist()
    ar = [e.token for e in again.generate_tokens(prompt, 16, draft=False, eos_token_ids=[])]
    assert [e.token for e in again.generate_tokens(prompt, 16, block_size=4, eos_token_ids=[])] == ar
    files[0].write_text(json.dumps({host: None}))
    compiled = []
    real_compile = ov.Core.compile_model
    monkeypatch.setattr(ov.Core, "compile_model",
                        lambda self, model, *a, **k: compiled.append(model) or real_compile(self, model, *a, **k))
    never = load()
    assert never.target.wide_request is None and never.target.wide_xml is None and not calibrations
    assert len(compiled) == 2 and warmed == [1, 1]  # target and drafter only: a copy that never pays is not built
    assert [e.token for e in never.generate_tokens(prompt, 16, block_size=4, eos_token_ids=[])] == ar
    monkeypatch.setattr(ov.Core, "compile_model", real_compile)
    for bad in ("not json", json.dumps({host: 0}), json.dumps({host: True}), json.dumps({"another host": 5})):
        files[0].write_text(bad)
        load()
    assert len(calibrations) == 4
    assert wide_target.cached_wide_from(files[0].parent / "openvino_model.xml", host)[0]  # stored again


def two_targets(fp16_pair, tmp_path):
    """Two copies a and b of the fp16 pair's target directory, and a cache directory."""
    import shutil

    pair_a, pair_b = tmp_path / "a", tmp_path / "b"
    for pair in (pair_a, pair_b):
        shutil.copytree(fp16_pair / "target", pair / "target")
    return pair_a, pair_b, tmp_path / "cache"


def test_a_changed_target_file_replaces_its_old_copy_and_leaves_other_targets_copies(fp16_pair, tmp_path):
    from ovdflash.ov import wide_target

    pair_a, pair_b, cache = two_targets(fp16_pair, tmp_path)
    old_a = wide_target.f32_weights_ir(pair_a / "target" / "openvino_model.xml", cache)
    copy_b = wide_target.f32_weights_ir(pair_b / "target" / "openvino_model.xml", cache)
    bin_a = pair_a / "target" / "openvino_model.bin"
    os.utime(bin_a, ns=(bin_a.stat().st_atime_ns, bin_a.stat().st_mtime_ns + 10**9))  # a re-export
    new_a = wide_target.f32_weights_ir(pair_a / "target" / "openvino_model.xml", cache)
    assert new_a != old_a and new_a.is_file() and not old_a.parent.exists()
    assert copy_b.is_file()
    assert sorted(p.name for p in (cache / "wide").iterdir()) == sorted([new_a.parent.name, copy_b.parent.name])


def test_writing_a_copy_removes_the_copies_of_deleted_targets(fp16_pair, tmp_path):
    import shutil

    from ovdflash.ov import wide_target

    pair_a, pair_b, cache = two_targets(fp16_pair, tmp_path)
    copy_a = wide_target.f32_weights_ir(pair_a / "target" / "openvino_model.xml", cache)
    writing = cache / "wide" / ".writing-elsewhere"  # another process's copy being written: no source yet
    writing.mkdir()
    shutil.rmtree(pair_a)
    copy_b = wide_target.f32_weights_ir(pair_b / "target" / "openvino_model.xml", cache)
    assert copy_b.is_file() and not copy_a.parent.exists() and writing.is_dir()
