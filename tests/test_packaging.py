"""The installed product: the wheel holds every package and the data the runtime and the export
stage read (the bench's eval prompts, the shipped drafter, the prompt templates), not the training
data, and building it prints no setuptools warning about undeclared package directories."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("setuptools")
    src = tmp_path_factory.mktemp("src")
    # a copy, so the build's own build/ and egg-info never touch the checkout
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("ovdflash", "export", "models"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "--no-index", "-w", str(out), "-v"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (whl,) = out.glob("ovdflash-*.whl")
    return set(zipfile.ZipFile(whl).namelist()), proc.stdout + proc.stderr


def test_the_wheel_ships_what_the_runtime_and_the_export_stage_read(wheel):
    names, _ = wheel
    for d in ("code", "math", "chat"):
        assert f"ovdflash_models/prompts/eval_{d}.jsonl" in names   # ovdflash bench's prompt sets
    for f in ("config.json", "model.safetensors", "draft_vocab.json"):  # models/default.py's drafter
        assert f"ovdflash_models/smollm2_dflash/{f}" in names
    templates = {p.name for p in (ROOT / "export" / "training" / "templates").glob("*.json")}
    assert templates and {f"ovdflash_export/training/templates/{t}" for t in templates} <= names
    modules = {str(p.relative_to(ROOT / "export")) for p in (ROOT / "export").rglob("*.py")}
    assert {f"ovdflash_export/{m}" for m in modules} <= names
    runtime = {str(p.relative_to(ROOT)) for p in (ROOT / "ovdflash").rglob("*.py")}
    assert runtime <= names and "ovdflash/cli/__init__.py" in names and "ovdflash_models/default.py" in names


def test_the_wheel_leaves_out_the_training_data_and_its_build_is_quiet(wheel):
    names, log = wheel
    assert not [n for n in names if n.startswith("ovdflash_models/data/") or n.endswith((".xz", ".md"))]
    assert "is absent from the `packages` configuration" not in log
