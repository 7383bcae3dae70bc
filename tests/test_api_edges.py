"""Hard edges of the Python API and the chat CLI: bad input fails at the door in one line, state stays intact.

Each case used to return wrong output silently or fail deep inside: overlapping calls on one pipeline,
unchecked token ids, non-integer lengths and block sizes, empty stop strings, malformed messages and
manifests, damaged IR files, and a Ctrl-C'd `chat --prompt` that exited 0.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest

from ovdflash import STRICT_F32, DFlashPipeline
from ovdflash.manifest import ManifestError, load_manifest


@pytest.fixture(scope="module")
def pipe(tiny_pair, tmp_path_factory):
    return DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("ov_cache_edges"), **STRICT_F32)


PROMPTS = [[5, 6, 7], [100, 3, 9, 250, 11], [42] * 6, [7, 8, 9, 10, 11, 12, 13, 14]]


def test_threads_sharing_one_pipeline_take_turns_and_get_their_own_replies(pipe):
    expected = [pipe.generate(p, max_new_tokens=24, block_size=4).token_ids for p in PROMPTS]
    results, errors = {}, []

    def worker(k):
        try:
            for rep in range(3):
                i = (k + rep) % len(PROMPTS)
                results[k, rep] = (i, pipe.generate(PROMPTS[i], max_new_tokens=24, block_size=4).token_ids)
        except Exception as exc:  # any failure is a test failure below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert len(results) == 12 and all(ids == expected[i] for i, ids in results.values())


def test_a_paused_stream_blocks_another_call_in_its_thread_and_resumes_correctly(pipe):
    full = pipe.generate(PROMPTS[1], max_new_tokens=40, block_size=4)
    stream = pipe.stream(PROMPTS[1], max_new_tokens=40, block_size=4)
    first = next(stream)
    with pytest.raises(RuntimeError, match="already generating in this thread"):
        pipe.generate(PROMPTS[0], max_new_tokens=8)
    with pytest.raises(RuntimeError, match="already generating"):
        list(pipe.generate_tokens(PROMPTS[0], 8, draft=False))
    rest = list(stream)  # the refused calls touched nothing: the stream goes on as if alone
    assert first + "".join(rest) == full.text
    assert pipe.generate(PROMPTS[1], max_new_tokens=40, block_size=4).token_ids == full.token_ids
    closed = pipe.stream(PROMPTS[0], max_new_tokens=40)
    next(closed)
    closed.close()  # a closed stream frees the pipeline
    assert pipe.generate(PROMPTS[1], max_new_tokens=40, block_size=4).token_ids == full.token_ids


@pytest.mark.parametrize("prompt, error, match", [
    ([5, 512], ValueError, r"token id 512 at item 1 is out of range \(0\.\.511\)"),
    ([5, -1], ValueError, "token id -1 at item 1 is out of range"),
    (b"\x05\x06", TypeError, "got bytes"),
    ([5, True], TypeError, "item 1 is True"),
    ([5, 2.0], TypeError, "item 1 is 2.0"),
    ([], ValueError, "the prompt is empty"),
])
def test_token_id_prompts_are_checked(pipe, prompt, error, match):
    with pytest.raises(error, match=match):
        pipe.generate(prompt, max_new_tokens=4)
    with pytest.raises(error, match=match):
        list(pipe.generate_tokens(prompt, 4))


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=2.5), r"max_new_tokens must be an integer >= 1, got 2\.5"),
    (dict(max_new_tokens=3.0, block_size=4), r"max_new_tokens must be an integer >= 1, got 3\.0"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer >= 1, got True"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    (dict(block_size=0), "block_size must be an integer or 'auto', got 0"),
    (dict(block_size=-2), "block_size must be an integer or 'auto', got -2"),
    (dict(block_size=True), "block_size must be an integer or 'auto', got True"),
    (dict(block_size="big"), "block_size must be an integer or 'auto', got 'big'"),
    (dict(block_size=99), "block_size 99 exceeds the drafter's trained block size 4"),
    (dict(stop=""), "stop strings must not be empty"),
    (dict(stop=["x", ""]), r"stop strings must not be empty \(stop\[1\]\)"),
])
def test_lengths_block_sizes_and_stops_are_checked(pipe, kwargs, match):
    kwargs.setdefault("max_new_tokens", 8)
    with pytest.raises(ValueError, match=match):
        pipe.generate(PROMPTS[0], **kwargs)
    assert len(pipe.generate(PROMPTS[0], max_new_tokens=5).token_ids) == 5  # state intact


@pytest.mark.parametrize("messages, error, match", [
    ([{"role": "captain", "content": "hi"}], ValueError, r"messages\[0\]\.role must be one of system, user"),
    ([{"role": "user", "content": "hi"}, {"role": "user", "content": 3}], TypeError,
     r"messages\[1\]\.content must be a string, got int"),
    ([{"role": "user"}], TypeError, r"messages\[0\]\.content must be a string, got NoneType"),
    ([{"role": "user", "content": "hi"}, "hello"], TypeError, r"messages\[1\] must be a dict"),
    ({"role": "user", "content": "hi"}, TypeError, "got dict"),
    (42, TypeError, "got int"),
])
def test_chat_messages_are_checked_with_the_field_named(pipe, messages, error, match):
    with pytest.raises(error, match=match):
        pipe.generate(messages, max_new_tokens=4)


def test_stop_values_as_a_string_or_a_list_mean_the_same(pipe):
    one = pipe.generate([5, 6, 7], max_new_tokens=30, stop="a")
    listed = pipe.generate([5, 6, 7], max_new_tokens=30, stop=["a"])
    assert one.text == listed.text and one.finish_reason == listed.finish_reason
    with pytest.raises(TypeError, match=r"stop\[0\] must be a string"):
        pipe.generate([5, 6, 7], max_new_tokens=4, stop=[1])


@pytest.mark.parametrize("key", ["block_size", "mask_token_id", "max_position_embeddings", "target_layer_ids"])
def test_a_manifest_missing_a_key_names_it(tiny_pair, tmp_path, key):
    model = tmp_path / "m"
    shutil.copytree(tiny_pair, model)
    manifest = json.loads((model / "manifest.json").read_text())
    manifest[key] = None if key == "max_position_embeddings" else manifest.pop(key) and None
    (model / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=rf"manifest.json: the manifest lacks '{key}'"):
        load_manifest(model)
    with pytest.raises(ManifestError, match=key):
        DFlashPipeline.from_pretrained(model)


def test_a_manifest_of_the_wrong_shape_is_one_line(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not readable JSON"):
        load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "ovdflash/1", "block_size": "4"}))
    with pytest.raises(ManifestError, match="'block_size' must be int, got '4'"):
        load_manifest(tmp_path)


@pytest.mark.parametrize("role, name", [("target", "openvino_model.xml"), ("drafter", "openvino_model.bin"),
                                        ("target", "openvino_model.bin")])
def test_damaged_ir_files_name_the_model_and_the_file(tiny_pair, tmp_path, role, name):
    model = tmp_path / "m"
    shutil.copytree(tiny_pair, model)
    path = model / role / name
    if name.endswith(".xml"):
        path.write_text(path.read_text()[: len(path.read_text()) // 2])  # truncated
    else:
        path.unlink()
    with pytest.raises((RuntimeError, FileNotFoundError), match=rf"{role}/openvino_model\..*the {role} IR"):
        DFlashPipeline.from_pretrained(model, cache_dir=tmp_path / "c")


def test_export_refuses_a_target_without_a_context_length(tiny_sources, tmp_path):
    from ovdflash_export.exporter import ExportError, export_pair

    target, drafter = tiny_sources()
    copy = tmp_path / "target"
    shutil.copytree(target, copy)
    config = json.loads((copy / "config.json").read_text())
    config.pop("max_position_embeddings")
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="names no max_position_embeddings"):
        export_pair(copy, drafter, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_chat_prompt_cut_by_ctrl_c_exits_130_after_printing_what_it_has(tiny_pair, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "ovdflash.cli", "chat", str(tiny_pair), "--prompt", "Hello",
                             "-n", "480", "--block-size", "2", "--cache-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            # a suite started in the background ignores SIGINT, and a child would inherit that
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = proc.stdout.read(1)  # the reply has started
    assert first, proc.stderr.read().decode()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()
    assert (first + out).decode(errors="replace").rstrip().endswith("[stopped]")


def test_verify_checks_the_recorded_checksums(tiny_pair, tmp_path):
    cli = [sys.executable, "-m", "ovdflash.cli", "verify"]
    model = tmp_path / "m"
    shutil.copytree(tiny_pair, model)
    ok = subprocess.run(cli + [str(model)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "4 files match" in ok.stdout, ok.stderr
    data = bytearray((model / "drafter/openvino_model.bin").read_bytes())
    data[100] ^= 0xFF  # other valid-looking numbers: loads, but is not what was exported
    (model / "drafter/openvino_model.bin").write_bytes(bytes(data))
    bad = subprocess.run(cli + [str(model)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "drafter/openvino_model.bin: missing or damaged" in bad.stderr
    manifest = json.loads((model / "manifest.json").read_text())
    del manifest["files"]
    (model / "manifest.json").write_text(json.dumps(manifest))
    old = subprocess.run(cli + [str(model)], capture_output=True, text=True, timeout=120)
    assert old.returncode == 2 and "records no checksums" in old.stderr


def test_a_damaged_default_model_rebuilds_itself(tmp_path, monkeypatch):
    from ovdflash.manifest import checksum_files
    from ovdflash_models import default as default_mod

    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "model.safetensors").write_bytes(b"v1")
    monkeypatch.setattr(default_mod, "SHIPPED_DRAFTER", drafter)
    monkeypatch.setattr(default_mod, "fetch_smollm2", lambda cache_dir=None, progress=True: tmp_path / "hf")
    calls = []

    def export_pair(target, drafter_dir, out_dir, **kw):
        calls.append(out_dir)
        for name in ("target", "drafter"):
            (out_dir / name).mkdir(parents=True)
            (out_dir / name / "openvino_model.xml").write_text(f"<{name}/>")
            (out_dir / name / "openvino_model.bin").write_bytes(b"\0" * 64)
        (out_dir / "manifest.json").write_text(json.dumps({"format": "ovdflash/1", "files": checksum_files(out_dir)}))
        return out_dir

    fake = type(sys)("ovdflash_export.exporter")
    fake.export_pair = export_pair
    monkeypatch.setitem(sys.modules, "ovdflash_export.exporter", fake)
    out = default_mod.ensure_default_model(tmp_path / "cache", progress=False)
    assert default_mod.ensure_default_model(tmp_path / "cache", progress=False) == out and len(calls) == 1
    (out / "target" / "openvino_model.bin").write_bytes(b"\1" * 64)  # damaged
    assert default_mod.ensure_default_model(tmp_path / "cache", progress=False) == out and len(calls) == 2
    assert (out / "target" / "openvino_model.bin").read_bytes() == b"\0" * 64
