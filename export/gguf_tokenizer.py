"""GGUF -> Hugging Face directory, with a correct byte-level BPE tokenizer.

Contract:
- `build_tokenizer_from_gguf(gguf_path) -> tokenizers.Tokenizer`: the GPT-2 style byte-level
  BPE tokenizer rebuilt from the GGUF vocab and merges (`tokenizer.ggml.model == "gpt2"`), with
  the pre-tokenizer the GGUF names in `tokenizer.ggml.pre`: `smollm` (SmolLM2), `qwen2`
  (Qwen2 / Qwen2.5 / Qwen3) or `gpt-2`. Any other raises a one-line ValueError naming it.
  Control tokens (type 3) are special; user-defined ones (type 4, e.g. Qwen's `<tool_call>`)
  are matched whole but are not special, as in the original tokenizers.
  Needs only `gguf` + `tokenizers` (no torch).
- `write_tokenizer_files(gguf_path, out_dir)`: writes `tokenizer.json`, `tokenizer_config.json`
  (eos `<|im_end|>`, no BOS added, the GGUF's chat template) and `chat_template.jinja`.
- `convert_gguf_to_hf(gguf_path, out_dir)`: dequantizes the GGUF weights into an f32
  transformers checkpoint (config.json + model.safetensors + generation_config.json, whose EOS ids
  are `gguf_eos_token_ids`) and writes the rebuilt tokenizer over whatever transformers produced.

Why the rebuild: transformers' GGUF loader turns a `gpt2`/`smollm` GGUF tokenizer into a
SentencePiece-style (CodeLlama) pipeline over a byte-level vocabulary, which encodes every space
and newline as `<|endoftext|>` (id 0). Every prompt built with it is garbage. The pre-tokenizer
must be the family's own: with another one the text still round-trips, but it is cut into words
the model never saw together (Qwen2 keeps "(self" and "\n\n" as one word, GPT-2's regex does not).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

# GGUF token_type values (llama.cpp `llama_token_type`): 3 = control, 4 = user defined.
_CONTROL, _USER_DEFINED = 3, 4
_SPECIAL_TOKEN_TYPES = (_CONTROL, _USER_DEFINED)

# Qwen2's word split (its tokenizer.json; llama.cpp's "qwen2" pre-type): case-insensitive
# contractions, a letter run with one leading non-letter, single digits, newline runs.
QWEN2_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                     r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("smollm", "qwen2", "gpt-2")


def _field(reader, key):
    """One scalar/string/array metadata value of a GGUF file, or None."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def read_gguf_tokenizer_metadata(gguf_path) -> dict:
    """The tokenizer-related metadata of a GGUF file as plain Python values. Read once per file
    version (an export validates, then converts: ~8 s each for a Qwen vocabulary); do not mutate."""
    path = Path(gguf_path)
    stat = path.stat()
    return _read_tokenizer_metadata(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _read_tokenizer_metadata(gguf_path: str, mtime_ns: int, size: int) -> dict:
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    meta = {
        "model": _field(reader, "tokenizer.ggml.model"),
        "pre": _field(reader, "tokenizer.ggml.pre"),
        "tokens": _field(reader, "tokenizer.ggml.tokens"),
        "token_type": _field(reader, "tokenizer.ggml.token_type"),
        "merges": _field(reader, "tokenizer.ggml.merges"),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "unknown_token_id": _field(reader, "tokenizer.ggml.unknown_token_id"),
        "padding_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "add_bos_token": _field(reader, "tokenizer.ggml.add_bos_token"),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    if meta["model"] != "gpt2":
        raise ValueError(f"{gguf_path}: tokenizer model {meta['model']!r} is not byte-level BPE (gpt2)")
    return meta


def _pre_tokenization(pre: str | None, gguf_path):
    """(normalizer, pre_tokenizer) of the family named by the GGUF's `tokenizer.ggml.pre`."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    if pre == "smollm":  # every digit is its own word, then GPT-2's regex
        return None, pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    if pre == "qwen2":
        return normalizers.NFC(), pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    if pre in ("gpt-2", "gpt2"):
        return None, pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    raise ValueError(f"{gguf_path}: GGUF pre-tokenizer {pre!r} is not supported (supported: "
                     f"{', '.join(PRE_TOKENIZERS)}); pass a Hugging Face directory with its tokenizer.json instead")


def check_gguf_tokenizer(gguf_path) -> None:
    """Raise the one-line ValueError a conversion would, before any weights are read: a byte-level
    BPE tokenizer whose pre-tokenizer is not one of PRE_TOKENIZERS. Other tokenizer models pass
    (transformers converts those itself)."""
    try:
        meta = read_gguf_tokenizer_metadata(gguf_path)
    except ValueError:
        return
    _pre_tokenization(meta["pre"], gguf_path)


def build_tokenizer_from_gguf(gguf_path, meta: dict | None = None):
    """Byte-level BPE `tokenizers.Tokenizer` from the GGUF vocab + merges and its family's pre-tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    meta = meta or read_gguf_tokenizer_metadata(gguf_path)
    normalizer, pre_tokenizer = _pre_tokenization(meta["pre"], gguf_path)
    tokens = meta["tokens"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False,
                               byte_fallback=False))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    types = [int(t) for t in meta["token_type"]]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == _CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == _USER_DEFINED])
    return tok


def write_tokenizer_files(gguf_path, out_dir, meta: dict | None = None) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into out_dir."""
    meta = meta or read_gguf_tokenizer_metadata(gguf_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer_from_gguf(gguf_path, meta)
    tok.save(str(out_dir / "tokenizer.json"))
    tokens = meta["tokens"]
    template = meta["chat_template"]
    eos = tokens[gguf_eos_token_ids(meta)[0]]  # ChatML: a turn ends with <|im_end|>
    added_decoder = {str(i): {"content": tokens[i], "lstrip": False, "normalized": False,
                              "rstrip": False, "single_word": False, "special": int(t) == _CONTROL}
                     for i, t in enumerate(meta["token_type"]) if int(t) in _SPECIAL_TOKEN_TYPES}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "bos_token": "<|im_start|>" if "<|im_start|>" in tokens else None,
        "eos_token": eos,
        "pad_token": eos,
        "unk_token": tokens[meta["unknown_token_id"]] if meta["unknown_token_id"] is not None else None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "added_tokens_decoder": added_decoder,
        "chat_template": template,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {k: config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")}, indent=2))
    if template:
        (out_dir / "chat_template.jinja").write_text(template)


def gguf_eos_token_ids(meta: dict) -> list[int]:
    """The ids that end a reply: `<|im_end|>` (ChatML) when the vocabulary has it, else the GGUF's
    EOS; for the Qwen2 family also `<|endoftext|>`, as Qwen's own generation_config lists both."""
    tokens = meta["tokens"]
    ids = [tokens.index("<|im_end|>") if "<|im_end|>" in tokens else int(meta["eos_token_id"])]
    if meta["pre"] == "qwen2" and "<|endoftext|>" in tokens and tokens.index("<|endoftext|>") not in ids:
        ids.append(tokens.index("<|endoftext|>"))
    return ids


def convert_gguf_to_hf(gguf_path, out_dir) -> Path:
    """Dequantize a GGUF into an f32 HF checkpoint in out_dir and rebuild its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = read_gguf_tokenizer_metadata(gguf_path)
    _pre_tokenization(meta["pre"], gguf_path)  # an unsupported tokenizer fails before the weights load
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    eos_ids = gguf_eos_token_ids(meta)
    eos_id = eos_ids[0]
    model.config.eos_token_id = eos_id
    model.config.bos_token_id = meta["bos_token_id"]
    model.config.pad_token_id = eos_id
    model.generation_config.eos_token_id = eos_ids if len(eos_ids) > 1 else eos_id
    model.generation_config.bos_token_id = meta["bos_token_id"]
    model.generation_config.pad_token_id = eos_id
    # the weights are dequantized already; newer transformers still refuse to save a "GGUF-quantized" model
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    model.save_pretrained(str(out_dir), safe_serialization=True)
    for stale in ("tokenizer.model", "added_tokens.json"):
        (out_dir / stale).unlink(missing_ok=True)
    write_tokenizer_files(gguf_path, out_dir, meta)
    return out_dir
