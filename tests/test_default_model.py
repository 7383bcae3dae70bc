"""ensure_default_model: exports once, re-exports only when the shipped drafter changes."""
import json
import sys
import types

import pytest

from ovdflash_models import default as default_mod


@pytest.fixture
def fake_world(tmp_path, monkeypatch):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    (drafter / "model.safetensors").write_bytes(b"v1")
    monkeypatch.setattr(default_mod, "SHIPPED_DRAFTER", drafter)
    monkeypatch.setattr(default_mod, "fetch_smollm2", lambda cache_dir=None, progress=True: tmp_path / "hf")
    calls = []

    def export_pair(target, drafter_dir, out_dir, **kw):
        calls.append((target, drafter_dir, kw))
        out_dir.mkdir(parents=True)
        (out_dir / "manifest.json").write_text(json.dumps({"format": "ovdflash/1"}))
        return out_dir

    fake = types.ModuleType("ovdflash_export.exporter")
    fake.export_pair = export_pair
    monkeypatch.setitem(sys.modules, "ovdflash_export.exporter", fake)
    return tmp_path, drafter, calls


def test_exports_once_then_reuses(fake_world):
    root, drafter, calls = fake_world
    out = default_mod.ensure_default_model(root / "cache", progress=False)
    assert out == root / "cache" / default_mod.EXPORT_DIRNAME
    assert (out / "manifest.json").is_file()
    assert calls[0][0] == root / "hf" and calls[0][1] == drafter
    assert calls[0][2]["target_weight_format"] == default_mod.TARGET_WEIGHT_FORMAT
    assert calls[0][2]["default_block_size"] == default_mod.DEFAULT_BLOCK_SIZE == 4
    assert calls[0][2]["compile_options"] == {"INFERENCE_PRECISION_HINT": "f32"}  # SmolLM2 runs f32 everywhere
    assert default_mod.ensure_default_model(root / "cache", progress=False) == out
    assert len(calls) == 1


def test_new_drafter_checkpoint_triggers_reexport(fake_world):
    root, drafter, calls = fake_world
    default_mod.ensure_default_model(root / "cache", progress=False)
    (drafter / "model.safetensors").write_bytes(b"v2")
    out = default_mod.ensure_default_model(root / "cache", progress=False)
    assert len(calls) == 2 and (out / "manifest.json").is_file()
    assert not out.with_name(out.name + ".tmp").exists()


def test_missing_shipped_drafter_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(default_mod, "SHIPPED_DRAFTER", tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="shipped drafter"):
        default_mod.ensure_default_model(tmp_path, progress=False)


def test_new_export_recipe_triggers_reexport(fake_world, monkeypatch):
    root, drafter, calls = fake_world
    default_mod.ensure_default_model(root / "cache", progress=False)
    assert calls[0][2]["drafter_weight_format"] == default_mod.DRAFTER_WEIGHT_FORMAT
    monkeypatch.setattr(default_mod, "EXPORT_RECIPE", default_mod.EXPORT_RECIPE + ";changed")
    default_mod.ensure_default_model(root / "cache", progress=False)
    assert len(calls) == 2


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_model_name_is_a_clear_error_not_the_current_directory(name, tmp_path, monkeypatch):
    from ovdflash import DFlashPipeline
    monkeypatch.chdir(tmp_path)
    (tmp_path / "manifest.json").write_text("{}")  # a current directory that would load if "" meant "."
    with pytest.raises(ValueError, match="model_dir is empty"):
        DFlashPipeline.from_pretrained(name)
