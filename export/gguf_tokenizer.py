"""GGUF -> Hugging Face directory, with a correct byte-level BPE tokenizer.

Contract:
- `build_tokenizer_from_gguf(gguf_path) -> tokenizers.Tokenizer`: the GPT-2 style byte-level
  BPE tokenizer rebuilt from the GGUF vocab and merges (`tokenizer.ggml.model == "gpt2"`).
  Needs only `gguf` + `tokenizers` (no torch).
- `write_tokenizer_files(gguf_path, out_dir)`: writes `tokenizer.json`, `tokenizer_config.json`
  (eos `<|im_end|>`, no BOS added, the GGUF's chat template) and `chat_template.jinja`.
- `convert_gguf_to_hf(gguf_path, out_dir)`: dequantizes the GGUF weights into an f32
  transformers checkpoint (config.json + model.safetensors + generation_config.json) and writes
  the rebuilt tokenizer over whatever transformers produced.

Why the rebuild: transformers' GGUF loader turns a `gpt2`/`smollm` GGUF tokenizer into a
SentencePiece-style (CodeLlama) pipeline over a byte-level vocabulary, which encodes every space
and newline as `<|endoftext|>` (id 0). Every prompt built with it is garbage.
"""
from __future__ import annotations

import json
from pathlib import Path

# GGUF token_type values (llama.cpp `llama_token_type`): 3 = control, 4 = user defined.
_SPECIAL_TOKEN_TYPES = (3, 4)


def _field(reader, key):
    """One scalar/string/array metadata value of a GGUF file, or None."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def read_gguf_tokenizer_metadata(gguf_path) -> dict:
    """The tokenizer-related metadata of a GGUF file as plain Python values."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
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


def build_tokenizer_from_gguf(gguf_path, meta: dict | None = None):
    """Byte-level BPE `tokenizers.Tokenizer` from the GGUF vocab + merges (SmolLM2 layout)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    meta = meta or read_gguf_tokenizer_metadata(gguf_path)
    tokens = meta["tokens"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False,
                               byte_fallback=False))
    # SmolLM2's pre-tokenizer ("smollm" in llama.cpp): every digit is its own word, then GPT-2 regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    specials = [AddedToken(tokens[i], special=True, normalized=False)
                for i, t in enumerate(meta["token_type"]) if int(t) in _SPECIAL_TOKEN_TYPES]
    tok.add_special_tokens(specials)
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
    # The chat format is ChatML: a turn ends with <|im_end|>, which is therefore the EOS.
    eos = "<|im_end|>" if "<|im_end|>" in tokens else tokens[meta["eos_token_id"]]
    added_decoder = {str(i): {"content": tokens[i], "lstrip": False, "normalized": False,
                              "rstrip": False, "single_word": False, "special": True}
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


def convert_gguf_to_hf(gguf_path, out_dir) -> Path:
    """Dequantize a GGUF into an f32 HF checkpoint in out_dir and rebuild its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = read_gguf_tokenizer_metadata(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    eos_id = meta["tokens"].index("<|im_end|>") if "<|im_end|>" in meta["tokens"] else meta["eos_token_id"]
    model.config.eos_token_id = eos_id
    model.config.bos_token_id = meta["bos_token_id"]
    model.config.pad_token_id = eos_id
    model.generation_config.eos_token_id = eos_id
    model.generation_config.bos_token_id = meta["bos_token_id"]
    model.generation_config.pad_token_id = eos_id
    model.save_pretrained(str(out_dir), safe_serialization=True)
    for stale in ("tokenizer.model", "added_tokens.json"):
        (out_dir / stale).unlink(missing_ok=True)
    write_tokenizer_files(gguf_path, out_dir, meta)
    return out_dir
