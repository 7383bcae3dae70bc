"""Target LLM export: HF directory (or .gguf file) -> stateful OpenVINO IR with layer locators.

Contract (docs/DESIGN.md, "Target IR as saved"):

* optimum-intel stateful IR (``input_ids``, ``attention_mask``, ``position_ids``,
  ``beam_idx`` -> ``logits``), KV in ReadValue/Assign behind the beam_idx Gather, so the
  CPU plugin fuses its stateful SDPA.
* rt_info ``hidden_states_decoder_layers`` (optimum's JSON) for EVERY architecture: layer
  k -> HF ``hidden_states[k+1]``: the post-MLP residual Add of decoder layer k, before the
  final norm, except the last layer, which HF (and so z-lab and optimum) reports after the
  final norm: there the locator is the lm_head's input. optimum writes its own only for
  qwen3; we overwrite it with ours so every architecture is located the same way.
* optimum's ``KV_CACHE_PRECISION=f16`` runtime option is removed, so every weight format
  compiles with the same plugin defaults (the runtime sets precisions explicitly).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import openvino as ov

from ovdflash.ov.graphs import LOCATOR_KEY, find_lm_head

from .target_config import HYBRID_ARCHS, SUPPORTED_ARCHS, load_target_config


def _matmul_upstream(output, depth: int = 3) -> bool:
    node = output.get_node()
    for _ in range(depth):
        if node.get_type_name() == "MatMul":
            return True
        if node.get_type_name() not in ("Convert", "Multiply") or node.get_input_size() == 0:
            return False
        node = node.input_value(0).get_node()
    return node.get_type_name() == "MatMul"


def locate_decoder_layers(model: ov.Model, num_layers: int, hidden_size: int) -> dict:
    """Find each decoder layer's output: the last residual Add named `layers.<i>/` whose other input is a MatMul.

    The TorchScript export names ops after the module that produced them
    (``__module.model.layers.3/aten::add/Add_1``); the two residual adds of a layer live in
    the layer module itself, the MLP one comes last in topological order. Returns the
    optimum-format dict ``{"layers": {"<i>": {"producer": name, "output_index": 0}}}``.
    """
    found: dict[int, object] = {}
    pattern = re.compile(r"(?:^|[./])layers\.(\d+)/")
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Add":
            continue
        m = pattern.search(op.get_friendly_name())
        if not m:
            continue
        shape = op.get_output_partial_shape(0)
        if shape.rank.is_dynamic or shape.rank.get_length() != 3 or not shape[2].is_static \
                or shape[2].get_length() != hidden_size:
            continue
        if not any(_matmul_upstream(op.input_value(k)) for k in range(2)):
            continue
        found[int(m.group(1))] = op.output(0)  # later ops of the same layer overwrite: the last residual add wins
    # HF's last hidden_states entry (and so z-lab's id L-1, and optimum's locator) is the
    # final-norm output, i.e. what the lm_head MatMul reads
    found[num_layers - 1] = find_lm_head(model).input_value(0)
    missing = [i for i in range(num_layers) if i not in found]
    if missing:
        raise ValueError(f"could not locate the outputs of decoder layers {missing} in the target IR")
    return {"layers": {str(i): {"producer": found[i].get_node().get_friendly_name(),
                                        "output_index": found[i].get_index()}
                       for i in range(num_layers)}}


def annotate_layers(model: ov.Model, num_layers: int, hidden_size: int) -> dict:
    locators = locate_decoder_layers(model, num_layers, hidden_size)
    model.set_rt_info(json.dumps(locators), LOCATOR_KEY)
    return locators


def _drop_runtime_kv_hint(model: ov.Model):
    """Remove runtime_options/KV_CACHE_PRECISION, keeping the other runtime options as they were."""
    if not model.has_rt_info(["runtime_options", "KV_CACHE_PRECISION"]):
        return
    rt = model.get_rt_info()
    kept = {k: model.get_rt_info(["runtime_options", k]).astype(str)
            for k in rt["runtime_options"] if k != "KV_CACHE_PRECISION"}
    del rt["runtime_options"]
    for key, value in kept.items():
        model.set_rt_info(value, ["runtime_options", key])


def gguf_to_hf_dir(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a .gguf through transformers into a f32 HF directory (model + tokenizer).

    Byte-level BPE (gpt2-style) GGUF tokenizers are rebuilt by ``gguf_tokenizer`` because
    transformers' GGUF tokenizer conversion breaks them; other tokenizers keep transformers'.
    """
    from .gguf_tokenizer import convert_gguf_to_hf, read_gguf_tokenizer_metadata

    try:
        read_gguf_tokenizer_metadata(gguf_path)
    except ValueError:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype="float32")
        model.save_pretrained(str(out_dir))
        AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(out_dir))
        return out_dir
    return convert_gguf_to_hf(gguf_path, out_dir)


def export_target_model(hf_dir, stateful: bool = True) -> tuple[ov.Model, object]:
    """Convert a HF directory with optimum-intel (a hybrid one with export/qwen3_5.py); returns
    (ov.Model with locators, object with the HF config and generation config)."""
    if load_target_config(hf_dir).get("model_type") in HYBRID_ARCHS:
        from .qwen3_5 import convert_qwen3_5

        return convert_qwen3_5(hf_dir)
    from optimum.intel import OVModelForCausalLM

    wrapped = OVModelForCausalLM.from_pretrained(str(hf_dir), export=True, compile=False, stateful=stateful,
                                                 load_in_8bit=False, trust_remote_code=False)
    model = wrapped.model
    config = wrapped.config
    if config.model_type not in SUPPORTED_ARCHS:
        raise ValueError(f"target architecture {config.model_type!r} is not supported ({', '.join(SUPPORTED_ARCHS)})")
    annotate_layers(model, config.num_hidden_layers, config.hidden_size)
    _drop_runtime_kv_hint(model)
    return model, wrapped


def save_target(model: ov.Model, wrapped, out_dir, compress_to_fp16: bool = False) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, str(out_dir / "openvino_model.xml"), compress_to_fp16=compress_to_fp16)
    wrapped.config.save_pretrained(str(out_dir))
    if getattr(wrapped, "generation_config", None) is not None:
        wrapped.generation_config.save_pretrained(str(out_dir))
    return out_dir / "openvino_model.xml"
