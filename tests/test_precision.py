"""Numerics on every CPU: each target runner compiles and decodes under every precision this host offers.

The host's offer is read from OpenVINO (`precision.host_precisions`: OPTIMIZATION_CAPABILITIES), so an
AVX2 CI covers f32 and a CPU with BF16 (AVX-512 BF16, AMX) covers f32 and bf16. The pairing rules of
`precision.resolve` are checked for every host kind with the offer given explicitly.
"""
import json

import numpy as np
import openvino as ov
import pytest

from ovdflash import DFlashPipeline
from ovdflash.ov.precision import PRECISIONS, compile_config, host_precisions, resolve

RUNNERS = ("paged", "stateful")
OFFERED = host_precisions()
OV_TYPES = {"f32": ov.Type.f32, "bf16": ov.Type.bf16, "f16": ov.Type.f16}


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("precision", [p for p in PRECISIONS if p in OFFERED])
def test_each_runner_compiles_and_decodes_under_each_offered_precision(tiny_pair, tmp_path_factory, runner, precision):
    cache = tmp_path_factory.mktemp(f"ov_cache_{runner}_{precision}")
    pipe = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=cache, target_runner=runner, precision=precision)
    assert pipe.numerics.inference == pipe.numerics.kv_cache == precision
    assert pipe.target.compiled.get_property("INFERENCE_PRECISION_HINT") == OV_TYPES[precision]
    assert pipe.target.compiled.get_property("KV_CACHE_PRECISION") == OV_TYPES[precision]
    prompt = [5, 17, 33, 250, 7]
    dflash = pipe.generate(prompt, max_new_tokens=12, block_size=4)
    ar = pipe.generate(prompt, max_new_tokens=12, draft=False)
    for result in (dflash, ar):
        assert len(result.token_ids) == 12 and all(0 <= t < 512 for t in result.token_ids)
    assert dflash.stats.num_drafts > 0 and ar.stats.num_drafts == 0
    if precision == "f32":  # the default pair: a verify row and an AR step see the same numbers
        assert dflash.token_ids == ar.token_ids


def test_default_is_f32_inference_and_f32_kv_on_every_host_kind():
    for offered in (("f32",), ("f32", "bf16"), ("f32", "bf16", "f16")):
        for runner in RUNNERS:
            config, numerics = compile_config({}, runner=runner, offered=offered)
            assert (config["INFERENCE_PRECISION_HINT"], config["KV_CACHE_PRECISION"]) == ("f32", "f32")
            assert numerics.inference == "f32"


def test_bf16_pairs_with_a_bf16_cache_where_offered_and_falls_back_to_f32_elsewhere():
    config, numerics = compile_config({}, precision="bf16", runner="paged", offered=("f32", "bf16"))
    assert (config["INFERENCE_PRECISION_HINT"], config["KV_CACHE_PRECISION"]) == ("bf16", "bf16")
    config, numerics = compile_config({}, precision="bf16", runner="paged", offered=("f32",))  # an AVX2 CPU
    assert (config["INFERENCE_PRECISION_HINT"], config["KV_CACHE_PRECISION"]) == ("f32", "f32")
    assert numerics.requested == "bf16" and "not offered" in numerics.describe()


def test_the_paged_runner_refuses_a_mismatched_pair_in_one_line():
    with pytest.raises(ValueError, match="paged target runner cannot keep a f32 KV cache with bf16"):
        resolve({"INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "f32"}, None, "paged", ("f32", "bf16"))
    with pytest.raises(ValueError, match="cannot keep a bf16 KV cache with f32"):
        resolve({"KV_CACHE_PRECISION": "bf16"}, None, "paged", ("f32", "bf16"))
    # the stateful runner takes it, and a u8 cache goes with either inference precision
    assert resolve({"INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "f32"}, None, "stateful",
                   ("f32", "bf16"))[1].kv_cache == "f32"
    assert resolve({"KV_CACHE_PRECISION": "u8"}, "bf16", "paged", ("f32", "bf16"))[1].kv_cache == "u8"
    with pytest.raises(ValueError, match="precision must be one of"):
        resolve({}, "fp8", "paged", ("f32",))


def test_precedence_caller_then_precision_then_manifest():
    manifest = {"compile_options": {"INFERENCE_PRECISION_HINT": "f32"}}
    both = ("f32", "bf16")
    assert compile_config(manifest, precision=None, offered=both)[1].inference == "f32"   # the recorded pair
    assert compile_config(manifest, precision="bf16", offered=both)[1].inference == "bf16"  # the caller's choice
    told = compile_config(manifest, {"INFERENCE_PRECISION_HINT": "f32"}, precision="bf16", offered=both)
    assert told[1].inference == "f32"  # an explicit -c wins over --precision
    assert compile_config({}, {"ENABLE_CPU_PINNING": True}, offered=both)[0]["ENABLE_CPU_PINNING"] is True


def test_export_records_compile_options_and_the_runtime_applies_them(tiny_sources, tmp_path):
    from ovdflash_export.exporter import ExportError, export_pair

    target, drafter = tiny_sources()
    with pytest.raises(ExportError, match="INFERENCE_PRECISION_HINT"):
        export_pair(target, drafter, tmp_path / "bad", compile_options={"INFERENCE_PRECISION_HINT": "fp8"})
    assert not (tmp_path / "bad").exists()
    out = export_pair(target, drafter, tmp_path / "m", compile_options={"INFERENCE_PRECISION_HINT": "f32",
                                                                         "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"})
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["compile_options"] == {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
    pipe = DFlashPipeline.from_pretrained(out, cache_dir=tmp_path / "c", target_runner="stateful",
                                          precision=None)
    assert pipe.target.compiled.get_property("INFERENCE_PRECISION_HINT") == ov.Type.f32
    assert int(pipe.target.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == 0
    ids = pipe.generate([3, 4, 5], max_new_tokens=6).token_ids
    assert len(ids) == 6 and np.all(np.array(ids) < 512)
