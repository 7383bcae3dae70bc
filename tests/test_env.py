"""`ovdflash env`: every fact collected is printed, --json parses, and a model's precisions are
exactly what `precision.compile_config` decides for its manifest (nothing compiled, no timing)."""
import json

import pytest
from click.testing import CliRunner

from ovdflash.cli import main
from ovdflash.manifest import load_manifest
from ovdflash.ov.host import ISA_FLAGS, PACKAGES, collect, isa_flags
from ovdflash.ov.precision import compile_config, host_precisions


def test_text_output_names_every_collected_fact():
    res = CliRunner().invoke(main, ["env"])
    assert res.exit_code == 0, res.output
    for section, value in collect().items():
        assert f"{section}:" in res.output
        for key in value if isinstance(value, dict) else ():
            assert f"  {key}: " in res.output, key
    for flag in ISA_FLAGS:
        assert f'"{flag}"' in res.output


def test_json_parses_with_host_facts():
    res = CliRunner().invoke(main, ["env", "--json"])
    assert res.exit_code == 0, res.output
    facts = json.loads(res.output)
    assert set(facts["packages"]) == set(PACKAGES) and facts["packages"]["openvino"]
    assert facts["cpu"]["inference_precisions"] == list(host_precisions())
    assert facts["cpu"]["openvino_device_name"] and "FP32" in facts["cpu"]["optimization_capabilities"]
    assert facts["cores"]["logical_cpus"] >= facts["cores"]["usable_cpus"] >= 1
    assert set(facts["cpu"]["isa"]) == set(ISA_FLAGS)


@pytest.mark.parametrize("args, precision, runner", [
    ([], None, None),
    (["--precision", "bf16"], "bf16", None),
    (["--target-runner", "stateful", "--precision", "bf16"], "bf16", "stateful"),
])
def test_model_precisions_equal_compile_config(tiny_pair, args, precision, runner):
    res = CliRunner().invoke(main, ["env", "--model", str(tiny_pair), "--json", *args])
    assert res.exit_code == 0, res.output
    model = json.loads(res.output)["model"]
    manifest = load_manifest(tiny_pair)
    expected_runner = runner or manifest["target_runner"]
    config, numerics = compile_config(manifest, {}, precision, expected_runner)
    assert model["target_runner"] == expected_runner
    assert (model["requested_precision"], model["inference_precision"], model["kv_cache_precision"]) == \
        (numerics.requested, numerics.inference, numerics.kv_cache)
    assert model["compile_config"] == json.loads(json.dumps(config))
    assert model["block_size"] == manifest["block_size"]


def test_text_output_shows_the_models_precisions(tiny_pair):
    res = CliRunner().invoke(main, ["env", "--model", str(tiny_pair)])
    assert res.exit_code == 0, res.output
    _, numerics = compile_config(load_manifest(tiny_pair), {}, None, load_manifest(tiny_pair)["target_runner"])
    assert f"  inference_precision: {numerics.inference}" in res.output
    assert f"  kv_cache_precision: {numerics.kv_cache}" in res.output


def test_a_directory_without_a_manifest_is_a_one_line_error(tmp_path):
    res = CliRunner().invoke(main, ["env", "--model", str(tmp_path)])
    assert res.exit_code != 0
    assert "no manifest.json" in res.output and "Traceback" not in res.output


def test_isa_flags_read_the_cpuinfo_flags_line():
    text = "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 avx512f amx_tile amx_bf16\n\nprocessor\t: 1\n"
    flags = isa_flags(text)
    assert flags == {f: f in ("avx2", "avx512f", "amx_tile", "amx_bf16") for f in ISA_FLAGS}
    assert not any(isa_flags("").values())
