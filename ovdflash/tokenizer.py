"""Text <-> token ids with the HF `tokenizers` library (never transformers), plus chat templates.

Contract:
- `Tokenizer.from_dir(model_dir)` reads `tokenizer.json`, and `tokenizer_config.json` for the
  bos/eos tokens; the chat template comes from `chat_template.jinja`, else from
  `tokenizer_config.json["chat_template"]`.
- `apply_chat_template(messages, add_generation_prompt, **variables)` renders the template with jinja2
  the way HF does (sandboxed, trim_blocks + lstrip_blocks, `raise_exception`, `tojson` with HF's
  arguments, `strftime_now`); extra variables reach the template as transformers passes them (`tools`:
  a list of `{"type": "function", "function": {...}}`, None when not given); `encode_chat` tokenizes the rendered text
  without adding special tokens again (the template has them).
- `IncrementalDetokenizer` turns a growing id list into text deltas, holding back an incomplete
  UTF-8 sequence (a trailing U+FFFD) until the bytes that complete it arrive; the concatenated
  deltas plus `flush()` equal `decode(all ids)`.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Sequence

import jinja2
import jinja2.sandbox
import tokenizers


def _token_str(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...} (AddedToken as saved by HF)
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        model_dir = Path(model_dir)
        tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        template_path = model_dir / "chat_template.jinja"
        template = (template_path.read_text(encoding="utf-8") if template_path.exists()
                    else config.get("chat_template"))
        if isinstance(template, list):  # HF's named-template list form: take "default"
            template = {t["name"]: t["template"] for t in template}.get("default")
        return cls(tok, template, _token_str(config.get("bos_token")), _token_str(config.get("eos_token")))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if not self.chat_template:
            raise ValueError("this model directory has no chat template "
                             "(chat_template.jinja or tokenizer_config.json:chat_template)")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        # tools and documents are always defined, None when not given, as transformers renders them
        variables = {"tools": None, "documents": None, "bos_token": self.bos_token or "",
                     "eos_token": self.eos_token or "", **kwargs}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


class IncrementalDetokenizer:
    """Streaming decode: `add(ids)` returns the newly completed text."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        # decode a short window [prefix_offset:] and diff it against [prefix_offset:read_offset]:
        # context on the left keeps leading-space rules right, and the window stays small
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        self.ids.extend(int(t) for t in token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return new_text[len(prefix_text):]
        return ""  # nothing new, or an incomplete UTF-8 sequence: wait for more bytes

    def flush(self) -> str:
        """Whatever is still held back (e.g. a truncated multi-byte character as U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text):]
