"""`ovdflash export` by Hugging Face id, offline, from a cache this test fills itself.

The cache is laid out as huggingface_hub lays it (`models--org--name/{blobs,snapshots/<commit>,refs/main}`,
snapshot files as links to blobs) from the tiny random sources of conftest. Each snapshot also
holds a `modeling_*.py` that records its import and raises, named by an `auto_map` in config.json
(as z-lab's drafters ship one): the export must never import it. An export by id must equal the
export of the same checkpoint from its local directory; a missing cache, a bad id and a snapshot
without weights are one line each.
"""
import hashlib
import json
import os
import sys

import pytest
from click.testing import CliRunner

from ovdflash.cli import main

COMMIT = "0123456789abcdef0123456789abcdef01234567"
EVIL_MODULE = "modeling_checkpoint_code"


def _evil_source(marker) -> str:
    return (f"import pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n"
            "raise RuntimeError('a checkpoint module was imported')\n")


def add_to_cache(cache, repo_id, files: dict, commit=COMMIT, ref="main"):
    """Write `files` {name: bytes} as the snapshot `commit` of `repo_id` in the huggingface_hub layout."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(f"{'../' * (name.count('/') + 2)}blobs/{blob.name}")
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def _checkpoint_files(src, marker, auto_map: dict) -> dict:
    files = {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()}
    config = json.loads(files["config.json"])
    config["auto_map"] = {k: f"{EVIL_MODULE}.{v}" for k, v in auto_map.items()}
    files["config.json"] = json.dumps(config, indent=2).encode()
    files[f"{EVIL_MODULE}.py"] = _evil_source(marker).encode()
    return files


def _checkpoint_copy(files: dict, out):
    out.mkdir(parents=True)
    for name, data in files.items():
        (out / name).write_bytes(data)
    return out


@pytest.fixture(scope="module")
def hub_pair(tmp_path_factory, tiny_sources):
    """(cache dir, marker path, local target dir, local drafter dir) of one checkpoint pair, cached by id."""
    root = tmp_path_factory.mktemp("hub")
    target, drafter = tiny_sources()
    marker = root / "checkpoint_code_ran"
    t_files = _checkpoint_files(target, marker, {"AutoConfig": "EvilConfig", "AutoModelForCausalLM": "EvilLM"})
    d_files = _checkpoint_files(drafter, marker, {"AutoModel": "DFlashDraftModel"})
    cache = root / "cache"
    add_to_cache(cache, "tiny-org/tiny-target", t_files)
    add_to_cache(cache, "tiny-lab/tiny-target-DFlash", d_files)
    return cache, marker, _checkpoint_copy(t_files, root / "local" / "target"), \
        _checkpoint_copy(d_files, root / "local" / "drafter")


def _offline_cache(monkeypatch, cache):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))


def _export(*args):
    return CliRunner().invoke(main, ["export", *map(str, args)])


def _one_error_line(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


def test_export_by_hub_id_equals_the_export_of_the_local_directory(hub_pair, tmp_path, monkeypatch):
    from ovdflash import STRICT_F32, DFlashPipeline
    from ovdflash_export.exporter import export_pair

    cache, marker, local_target, local_drafter = hub_pair
    _offline_cache(monkeypatch, cache)
    by_id = tmp_path / "by_id"
    result = _export("--target", "tiny-org/tiny-target", "--drafter", "tiny-lab/tiny-target-DFlash", "--out", by_id)
    assert result.exit_code == 0, result.output
    local = export_pair(local_target, local_drafter, tmp_path / "local")

    assert not marker.exists() and EVIL_MODULE not in sys.modules  # the checkpoints' own code never ran
    m_id, m_local = (json.loads((d / "manifest.json").read_text()) for d in (by_id, local))
    snapshot = cache / "models--tiny-org--tiny-target" / "snapshots" / COMMIT
    assert m_id["target"]["source"] == str(snapshot.resolve())
    for m in (m_id, m_local):
        del m["created"]
        for part in ("target", "drafter"):
            del m[part]["source"]
        # node names in the .xml files count up within a process; the weights must be the same bytes
        m["files"] = {name: digest for name, digest in m["files"].items() if name.endswith(".bin")}
    assert m_id == m_local  # the sources' checksums and the weights' checksums included
    outputs = []
    for model in (by_id, local):
        pipe = DFlashPipeline.from_pretrained(model, cache_dir=tmp_path / "ov_cache", **STRICT_F32)
        outputs.append([e.token for e in pipe.generate_tokens(list(range(3, 40)), 24, eos_token_ids=[])])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 24


def test_a_revision_and_a_commit_resolve_in_the_cache(hub_pair, monkeypatch):
    from ovdflash_export.hub import HubError, resolve_source

    cache, _, _, _ = hub_pair
    _offline_cache(monkeypatch, cache)
    snapshot = cache / "models--tiny-org--tiny-target" / "snapshots" / COMMIT
    for spec in ("tiny-org/tiny-target", "tiny-org/tiny-target@main", f"tiny-org/tiny-target@{COMMIT}"):
        source = resolve_source(spec, "target")
        assert source.path == snapshot and source.repo_id == "tiny-org/tiny-target" and source.commit == COMMIT
    with pytest.raises(HubError, match=r"^tiny-org/tiny-target at revision v2: not in the Hugging Face cache"):
        resolve_source("tiny-org/tiny-target@v2", "target")


def test_a_gguf_file_in_a_repo(tmp_path, monkeypatch):
    from ovdflash_export.hub import HubError, resolve_source

    snapshot = add_to_cache(tmp_path, "tiny-org/tiny-GGUF", {"tiny-Q8_0.gguf": b"GGUF", "README.md": b"x"})
    _offline_cache(monkeypatch, tmp_path)
    assert resolve_source("tiny-org/tiny-GGUF:tiny-Q8_0.gguf", "target").path == snapshot / "tiny-Q8_0.gguf"
    with pytest.raises(HubError, match="has no file tiny-Q4_0.gguf"):
        resolve_source("tiny-org/tiny-GGUF:tiny-Q4_0.gguf", "target")
    with pytest.raises(HubError, match="a GGUF file in the repo"):
        resolve_source("tiny-org/tiny-GGUF:weights.bin", "target")


def test_nothing_cached_offline_is_one_line_naming_the_cache(tiny_sources, tmp_path, monkeypatch):
    _, drafter = tiny_sources()
    empty = tmp_path / "empty_cache"
    _offline_cache(monkeypatch, empty)
    out = tmp_path / "o"
    line = _one_error_line(_export("--target", "Qwen/Qwen3.5-9B", "--drafter", drafter, "--out", out))
    assert line == (f"Error: Qwen/Qwen3.5-9B: not in the Hugging Face cache (HF_HUB_CACHE={empty}) and the hub "
                    "is offline: HF_HUB_OFFLINE=1; download it on a machine with network or pass a local directory")
    assert not out.exists()
    # --cache-dir wins over HF_HUB_CACHE
    other = tmp_path / "other_cache"
    line = _one_error_line(_export("--target", "Qwen/Qwen3.5-9B", "--drafter", drafter, "--out", out,
                                   "--cache-dir", other))
    assert f"(HF_HUB_CACHE={other})" in line


@pytest.mark.parametrize("spec, message", [
    ("not an id!", "no such file or directory, and not a Hugging Face id"),
    ("org/name/extra", "not of the form org/name"),
    ("./missing_dir", "no such file or directory"),
    ("org/name@", "an empty revision"),
])
def test_neither_a_path_nor_an_id_is_one_line(tiny_sources, tmp_path, monkeypatch, spec, message):
    _, drafter = tiny_sources()
    _offline_cache(monkeypatch, tmp_path / "cache")
    line = _one_error_line(_export("--target", spec, "--drafter", drafter, "--out", tmp_path / "o"))
    assert repr(spec) in line and message in line


def test_a_snapshot_without_safetensors_weights_is_one_line(tiny_sources, tmp_path, monkeypatch):
    target, _ = tiny_sources()
    add_to_cache(tmp_path / "cache", "tiny-lab/pickled-DFlash",
                 {"config.json": b"{}", "pytorch_model.bin": b"pickle", "modeling_dflash.py": b"raise SystemExit"})
    _offline_cache(monkeypatch, tmp_path / "cache")
    line = _one_error_line(_export("--target", target, "--drafter", "tiny-lab/pickled-DFlash", "--out", tmp_path / "o"))
    assert "tiny-lab/pickled-DFlash: the drafter snapshot" in line and "no *.safetensors weights" in line


def test_only_weights_configs_and_tokenizers_are_fetched():
    """What snapshot_download's own filter keeps from a z-lab-like file list: never code, never pickles."""
    from huggingface_hub.utils import filter_repo_objects

    from ovdflash_export.hub import ALLOW_PATTERNS

    repo = ["config.json", "model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
            "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
            "dflash.py", "modeling_dflash.py", "utils/helper.py", "pytorch_model.bin", "README.md", "draft_vocab.json",
            "openvino_model.xml", "openvino_model.bin", "openvino_tokenizer.xml", "training_args.bin"]
    kept = set(filter_repo_objects(repo, allow_patterns=list(ALLOW_PATTERNS)))
    assert kept == set(repo) - {"dflash.py", "modeling_dflash.py", "utils/helper.py", "pytorch_model.bin",
                                "README.md", "training_args.bin"}


def test_a_local_path_stays_a_local_path(tiny_sources):
    from ovdflash_export.hub import resolve_source

    target, _ = tiny_sources()
    source = resolve_source(target, "target")
    assert source.path == target and source.repo_id is None and str(source) == str(target)
    assert os.fspath(source) == str(target)  # usable wherever a path is
