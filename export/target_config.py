"""The target architectures the export supports, and a target's config as the export reads it.

Contract:
- `SUPPORTED_ARCHS`: the target model types the export converts; `HYBRID_ARCHS`, the hybrid
  (linear + full attention) ones among them: converted by `qwen3_5`, run by `ovdflash.ov.hybrid`.
- `load_target_config(source) -> dict`: the config of a HF directory (`config.json`; for a
  `qwen3_5` checkpoint its `text_config`, as model type `qwen3_5_text`) or of a `.gguf` file
  (through transformers).
Imports neither torch nor openvino, so the pair checks read configs without them.
"""
from __future__ import annotations

import json
from pathlib import Path

HYBRID_ARCHS = ("qwen3_5_text", "qwen3_5")
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3") + HYBRID_ARCHS


def load_target_config(source) -> dict:
    source = Path(source)
    if source.suffix == ".gguf":
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(source.parent), gguf_file=source.name).to_dict()
    config = json.loads((source / "config.json").read_text())
    if config.get("model_type") == "qwen3_5":  # the text model's fields sit under a wrapper
        return {**config["text_config"], "model_type": "qwen3_5_text"}
    return config
