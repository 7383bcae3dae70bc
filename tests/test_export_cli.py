"""`ovdflash export`: an end-to-end compressed export, and one-line validation errors.

A pair that does not fit (vocab, hidden size, fc width, layer ids, num_target_layers, mask
id) prints one line `Error: ...`, exits with code 2 and creates nothing.
"""
import json

import openvino as ov
import pytest
from click.testing import CliRunner

from ovdflash.cli import main


def _export(*args):
    return CliRunner().invoke(main, ["export", *map(str, args)])


def test_cli_export_compressed_with_block_size(tiny_sources, tmp_path):
    target, drafter = tiny_sources()
    out = tmp_path / "model"
    result = _export("--target", target, "--drafter", drafter, "--out", out,
                     "--target-weight-format", "int8", "--drafter-weight-format", "int4", "--block-size", 3,
                     "--default-block-size", 2)
    assert result.exit_code == 0, result.output
    for name in ("manifest.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "target/openvino_model.xml", "target/config.json", "drafter/openvino_model.xml",
                 "drafter/config.json"):
        assert (out / name).is_file(), name
    m = json.loads((out / "manifest.json").read_text())
    assert m["format"] == "ovdflash/1" and m["block_size"] == 3 and m["default_block_size"] == 2
    assert m["target"]["weight_format"] == "int8" and m["drafter"]["weight_format"] == "int4"
    assert m["eos_token_ids"] == [2] and m["bos_token_id"] is None  # <|im_end|> of the tiny tokenizer
    assert len(m["target"]["source_sha256"]) == 64 and "openvino" in m["versions"]
    d_ir = ov.Core().read_model(str(out / "drafter" / "openvino_model.xml"))
    assert d_ir.get_rt_info(["dflash", "block_size"]).astype(str) == "3"
    assert json.loads((out / "drafter" / "config.json").read_text())["block_size"] == 3
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"] and tok_cfg["eos_token"] == "<|im_end|>"


BAD_DRAFTERS = {
    "vocab": (dict(vocab_size=600), "vocab size mismatch"),
    "hidden": (dict(hidden_size=32, intermediate_size=64), "hidden size mismatch"),
    "fc_width": (dict(target_hidden_size=32), "drafter fc takes"),
    "layer_ids": (dict(target_layer_ids=[1, 9]), "outside the target's 4 layers"),
    "num_target_layers": (dict(num_target_layers=8), "built for 8 target layers"),
    "mask": (dict(mask_token_id=512), "mask_token_id 512 is outside the vocab"),
}


@pytest.mark.parametrize("case", sorted(BAD_DRAFTERS))
def test_cli_rejects_mismatched_pair(tiny_sources, tmp_path, case):
    from ovdflash_export.tiny import make_tiny_drafter

    target, _ = tiny_sources()
    overrides, message = BAD_DRAFTERS[case]
    drafter = make_tiny_drafter(target, tmp_path / "bad", **overrides)
    out = tmp_path / "out"
    result = _export("--target", target, "--drafter", drafter, "--out", out)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], result.output
    assert not out.exists()
    assert not list(tmp_path.glob(".out.*"))  # no temp directory left behind


def test_a_mask_token_that_ends_replies_is_refused_before_any_export(tiny_sources, tmp_path):
    """validate_pair knows the target's EOS ids from its source, so this fails in the first step."""
    from ovdflash_export.exporter import PairMismatchError, validate_pair
    from ovdflash_export.model_dir import _source_eos_ids
    from ovdflash_export.tiny import make_tiny_drafter

    target, _ = tiny_sources()
    eos = _source_eos_ids(target, json.loads((target / "config.json").read_text()))
    assert eos, "the tiny target must have an EOS for this test to mean anything"
    drafter = make_tiny_drafter(target, tmp_path / "bad", mask_token_id=eos[0])
    with pytest.raises(PairMismatchError, match=f"mask_token_id {eos[0]} is an eos token"):
        validate_pair(target, drafter)


def test_cli_rejects_unknown_weight_format(tiny_sources, tmp_path):
    target, drafter = tiny_sources()
    result = _export("--target", target, "--drafter", drafter, "--out", tmp_path / "o", "--target-weight-format", "int3")
    assert result.exit_code == 2 and not (tmp_path / "o").exists()


@pytest.mark.parametrize("value", ["5", "0", "big"])
def test_cli_rejects_a_default_block_size_outside_the_block(tiny_sources, tmp_path, value):
    target, drafter = tiny_sources()
    result = _export("--target", target, "--drafter", drafter, "--out", tmp_path / "o", "--block-size", 4,
                     "--default-block-size", value)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("Error: default block size must be 'auto' or 1..4") and value in lines[0]
    assert not (tmp_path / "o").exists()


def test_the_manifest_default_block_size_is_what_a_call_without_one_gets(tiny_pair, tmp_path):
    import shutil

    from ovdflash import DFlashPipeline

    model = tmp_path / "model"
    shutil.copytree(tiny_pair, model)
    manifest = json.loads((model / "manifest.json").read_text())
    assert manifest["default_block_size"] == "auto"   # what export writes unless told
    prompt = list(range(3, 20))
    for value, drafts_per_round in ((2, 1), (3, 2)):
        manifest["default_block_size"] = value
        (model / "manifest.json").write_text(json.dumps(manifest))
        pipe = DFlashPipeline.from_pretrained(model, cache_dir=tmp_path / "cache")
        assert pipe.default_block_size == value
        list(pipe.generate_tokens(prompt, 24))
        stats = pipe.last_stats
        # every round drafted (the last may shrink to fit max_new_tokens), never more than the default allows
        assert stats.num_drafts > 0 and len(stats.drafted_per_position) == drafts_per_round
        assert stats.drafted_per_position[0] == stats.num_drafts and stats.num_ar_steps <= 1
    for bad in (9, "fast", 0):
        manifest["default_block_size"] = bad
        (model / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ValueError, match="manifest.json: default block size must be"):
            DFlashPipeline.from_pretrained(model, cache_dir=tmp_path / "cache")


def test_the_manifest_draft_pass_sets_how_many_tokens_a_drafter_pass_runs(tiny_sources, tiny_pair, tmp_path):
    import shutil

    from ovdflash_export.drafter import SHORT_BLOCKS_KEY
    from ovdflash_export.exporter import export_pair

    from ovdflash import STRICT_F32, DFlashPipeline

    model = tmp_path / "model"
    shutil.copytree(tiny_pair, model)
    manifest = json.loads((model / "manifest.json").read_text())
    assert manifest["draft_pass"] == "full_block"  # a drafter trained on full blocks only
    prompt = list(range(5, 30))
    outputs = []
    for value, draft_block in (("full_block", manifest["block_size"]), ("exact", 0)):
        manifest["draft_pass"] = value
        (model / "manifest.json").write_text(json.dumps(manifest))
        pipe = DFlashPipeline.from_pretrained(model, cache_dir=tmp_path / "cache", **STRICT_F32)
        assert pipe.drafter.draft_block == draft_block
        outputs.append([e.token for e in pipe.generate_tokens(prompt, 30, block_size=2, eos_token_ids=[])])
    ar = [e.token for e in pipe.generate_tokens(prompt, 30, draft=False, eos_token_ids=[])]
    assert outputs == [ar, ar]
    manifest["draft_pass"] = "half"
    (model / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="manifest.json: draft_pass must be one of full_block, exact"):
        DFlashPipeline.from_pretrained(model, cache_dir=tmp_path / "cache")
    # a drafter trained with --short-blocks says so in its config; the export then drafts exact blocks
    target, drafter = tiny_sources()
    short = tmp_path / "drafter_short"
    shutil.copytree(drafter, short)
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, SHORT_BLOCKS_KEY: 0.5}))
    out = export_pair(target, short, tmp_path / "pair_short")
    assert json.loads((out / "manifest.json").read_text())["draft_pass"] == "exact"


def test_cli_rejects_missing_config(tiny_sources, tmp_path):
    _, drafter = tiny_sources()
    (tmp_path / "empty").mkdir()
    result = _export("--target", tmp_path / "empty", "--drafter", drafter, "--out", tmp_path / "o")
    assert result.exit_code == 2 and result.output.startswith("Error: ") and "config.json" in result.output
    assert not (tmp_path / "o").exists()


def test_cli_rejects_a_gguf_whose_tokenizer_it_cannot_rebuild(tiny_sources, tmp_path):
    """Before any weights load: one line naming the pre-tokenizer, nothing written."""
    from test_fetch import write_tokenizer_gguf

    _, drafter = tiny_sources()
    gguf = tmp_path / "odd.gguf"
    write_tokenizer_gguf(gguf, pre="falcon")
    result = _export("--target", gguf, "--drafter", drafter, "--out", tmp_path / "o")
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("Error: ") and "'falcon'" in lines[0] and "tokenizer.json" in lines[0]
    assert not (tmp_path / "o").exists()


def test_cli_module_imports_no_torch():
    """The export command loads the torch side lazily: `ovdflash --help` must stay light."""
    import subprocess
    import sys

    code = ("import sys, ovdflash.cli.export; from ovdflash.cli import main; main.get_command(None, 'export'); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'optimum', 'nncf', "
            "'ovdflash_export'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
