"""Qwen3.5 text targets (Gated DeltaNet + full attention) -> the hybrid target IR, on transformers 5.5.

Contract (the IR's ports: `ovdflash.ov.hybrid`; docs/DESIGN.md, "Hybrid targets"):

* The model types exported here are `target_config.HYBRID_ARCHS`: `qwen3_5_text`, and `qwen3_5` (the
  checkpoint layout whose text model sits under a wrapper, `text_config` in config.json).
* `load_text_model(hf_dir)` -> (Qwen3_5ForCausalLM in f32, its text config): for `qwen3_5` the text
  weights (`model.language_model.*`, `lm_head.*`) are loaded into a text-only model; vision weights
  are ignored.
* `convert_qwen3_5(hf_dir)` -> (ov.Model, wrapped) with `wrapped.config` / `wrapped.generation_config`
  (what `target.save_target` writes). Our own torch wrapper around the HF modules is traced with
  `ov.convert_model` (optimum-intel 2.2.0's Qwen3.5 patcher needs transformers <= 5.2): the Gated
  DeltaNet recurrence becomes `ovdflash.ov.hybrid.gated_delta_loop` (a ModuleExtension), the conv and
  recurrent states are plain inputs/outputs, and the full-attention K/V become ReadValue/Assign
  states behind a `beam_idx` Gather (as optimum's stateful IRs). Inputs: `input_ids`,
  `attention_mask` (physical slots, past + T; rejected slots 0), `position_ids` (logical),
  `beam_idx`, then `conv_state.<i>`, `recurrent_state.<i>` per linear-attention layer i.
* rt_info `hidden_states_decoder_layers` (same semantics as `target.locate_decoder_layers`: layer k's
  output = HF `hidden_states[k+1]`, the last layer after the final norm) is written from the
  traced graph's own layer outputs, not from name patterns.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import openvino as ov
import torch
import torch.nn.functional as F

from ovdflash.ov.graphs import LOCATOR_KEY, find_lm_head
from ovdflash.ov.hybrid import CONV_STATE, CONV_WINDOW, LOOP_INPUTS, RECURRENT_OUT, RECURRENT_STATE, gated_delta_loop

from .target_config import load_target_config

_CELL_OP = "OVDFlashGatedDeltaLoop"


class GatedDeltaCell(torch.nn.Module):
    """The recurrence in torch (for tracing shapes); converted to `gated_delta_loop`. Returns out and
    final state flattened into one vector (a ModuleExtension op has one output)."""

    def forward(self, query, key, value, g, beta, state):
        outs = []
        for t in range(key.shape[2]):
            state = state * g[:, :, t].exp()[..., None, None]
            kv_mem = (state * key[:, :, t, :, None]).sum(-2)
            delta = (value[:, :, t] - kv_mem) * beta[:, :, t, None]
            state = state + key[:, :, t, :, None] * delta[:, :, None, :]
            outs.append((state * query[:, :, t, :, None]).sum(-2))
        return torch.cat([torch.stack(outs, 2).reshape(-1), state.reshape(-1)])


def _convert_cell(context):
    out, state = gated_delta_loop(*(context.get_input(i) for i in range(6)))
    flat = ov.opset14.constant(np.array([-1], dtype=np.int64))
    return [ov.opset14.concat([ov.opset14.reshape(out, flat, False), ov.opset14.reshape(state, flat, False)], 0).output(0)]


def _l2norm(x, eps: float = 1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class HybridTextWrapper(torch.nn.Module):
    """Qwen3_5ForCausalLM with explicit state ports (module contract); returns a flat tuple:
    logits, per linear layer (conv_window, recurrent_state_out, key, value, g, beta), per full layer
    (present key, present value), then the outputs of layers 0..L-2 (located, then dropped)."""

    def __init__(self, causal_lm):
        super().__init__()
        self.lm = causal_lm
        self.cfg = causal_lm.config
        self.types = list(self.cfg.layer_types)
        self.linear = [i for i, t in enumerate(self.types) if t == "linear_attention"]
        self.full = [i for i, t in enumerate(self.types) if t == "full_attention"]
        self.cell = GatedDeltaCell()

    def _gdn(self, layer, x, conv_state, state):
        gdn = layer.linear_attn
        b, t, _ = x.shape
        mixed = gdn.in_proj_qkv(x).transpose(1, 2)                       # [B, conv_dim, T]
        window = torch.cat([conv_state, mixed], dim=-1)                   # [B, conv_dim, K+T]
        # the last K inputs are the state (HF's layout) and a Slice keeps the last T outputs: the
        # pattern the plugin's PagedCausalConv1DFusion matches
        conv = F.conv1d(window, gdn.conv1d.weight, gdn.conv1d.bias, padding=0, groups=gdn.conv_dim)
        conv = F.silu(conv[:, :, -t:])
        q, k, v = torch.split(conv.transpose(1, 2), [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
        # static head counts: the CPU plugin fuses the loop into its GatedDeltaNet kernel only then
        q = q.reshape(b, -1, gdn.num_k_heads, gdn.head_k_dim)
        k = k.reshape(b, -1, gdn.num_k_heads, gdn.head_k_dim)
        v = v.reshape(b, -1, gdn.num_v_heads, gdn.head_v_dim)
        z = gdn.in_proj_z(x).reshape(b, -1, gdn.num_v_heads, gdn.head_v_dim)
        beta = gdn.in_proj_b(x).sigmoid()
        g = -gdn.A_log.float().exp() * F.softplus(gdn.in_proj_a(x).float() + gdn.dt_bias)
        if gdn.num_v_heads // gdn.num_k_heads > 1:
            q = q.repeat_interleave(gdn.num_v_heads // gdn.num_k_heads, dim=2)
            k = k.repeat_interleave(gdn.num_v_heads // gdn.num_k_heads, dim=2)
        q, k = _l2norm(q), _l2norm(k)
        q, k, v, beta, g = (y.transpose(1, 2).contiguous().float() for y in (q, k, v, beta, g))
        q = q * (1.0 / q.shape[-1] ** 0.5)
        flat = self.cell(q, k, v, g, beta, state)
        out = flat[: v.numel()].reshape(v.shape)
        new_state = flat[v.numel():].reshape(state.shape)
        core = gdn.norm(out.transpose(1, 2).reshape(-1, gdn.head_v_dim), z.reshape(-1, gdn.head_v_dim))
        return gdn.out_proj(core.reshape(b, t, -1)), [window, new_state, k, v, g, beta]

    def _attention(self, layer, x, cos_sin, mask, past_k, past_v):
        from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb, repeat_kv

        attn = layer.self_attn
        shape = x.shape[:-1]
        q, gate = torch.chunk(attn.q_proj(x).view(*shape, -1, attn.head_dim * 2), 2, dim=-1)
        gate = gate.reshape(*shape, -1)
        q = attn.q_norm(q).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(x).view(*shape, -1, attn.head_dim)).transpose(1, 2)
        v = attn.v_proj(x).view(*shape, -1, attn.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *cos_sin)
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        groups = attn.num_key_value_groups
        out = F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask,
                                             scale=attn.scaling)
        out = out.transpose(1, 2).reshape(*shape, -1) * torch.sigmoid(gate)
        return attn.o_proj(out), [k, v]

    def forward(self, input_ids, attention_mask, position_ids, *states):
        text = self.lm.model
        n_lin = len(self.linear)
        x = text.embed_tokens(input_ids)
        cos_sin = text.rotary_emb(x, position_ids)
        # physical slot P+i attends to slots j <= P+i whose attention_mask is 1
        q_len, kv_len = input_ids.shape[1], attention_mask.shape[1]
        rows = torch.arange(q_len)[:, None] + (kv_len - q_len)
        allowed = (torch.arange(kv_len)[None, :] <= rows)[None] & (attention_mask[:, None, :] > 0)
        mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None]
        lin_out, full_out, layer_out = [], [], []
        for i, layer in enumerate(text.layers):
            h = layer.input_layernorm(x)
            if self.types[i] == "linear_attention":
                j = self.linear.index(i)
                h, extra = self._gdn(layer, h, states[2 * j], states[2 * j + 1])
                lin_out += extra
            else:
                j = self.full.index(i)
                h, extra = self._attention(layer, h, cos_sin, mask, states[2 * n_lin + 2 * j],
                                           states[2 * n_lin + 2 * j + 1])
                full_out += extra
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            layer_out.append(x)
        logits = self.lm.lm_head(text.norm(x))
        return (logits, *lin_out, *full_out, *layer_out[:-1])


def load_text_model(hf_dir):
    """(Qwen3_5ForCausalLM f32 eval, text config) for a qwen3_5_text or qwen3_5 directory."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    hf_dir = Path(hf_dir)
    raw = json.loads((hf_dir / "config.json").read_text())
    if raw.get("model_type") == "qwen3_5_text":
        model = Qwen3_5ForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
        return model.eval(), model.config
    if raw.get("model_type") != "qwen3_5":
        raise ValueError(f"not a Qwen3.5 checkpoint (model_type {raw.get('model_type')!r}): {hf_dir}")
    from safetensors.torch import load_file

    fields = {k: v for k, v in load_target_config(hf_dir).items() if k != "model_type"}
    config = Qwen3_5TextConfig(**fields)
    model = Qwen3_5ForCausalLM(config).float().eval()
    weights = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            if name.startswith("model.language_model."):
                weights["model." + name[len("model.language_model."):]] = tensor.float()
            elif name.startswith("lm_head."):
                weights[name] = tensor.float()
    if config.tie_word_embeddings and "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    missing = sorted(set(model.state_dict()) - set(weights))
    if missing:
        raise ValueError(f"{hf_dir}: the checkpoint lacks text-model weights {missing[:3]}...")
    model.load_state_dict(weights, strict=False)
    return model, config


def _port_names(cfg, linear, full):
    ins = ["input_ids", "attention_mask", "position_ids"]
    ins += [f"{p}{i}" for i in linear for p in (CONV_STATE, RECURRENT_STATE)]
    kv_in = [f"past_key_values.{i}.{kind}" for i in full for kind in ("key", "value")]
    outs = ["logits"] + [f"{p}{i}" for i in linear for p in (CONV_WINDOW, RECURRENT_OUT, *LOOP_INPUTS)]
    kv_out = [f"present.{i}.{kind}" for i in full for kind in ("key", "value")]
    return ins, kv_in, outs, kv_out


def convert_qwen3_5(hf_dir):
    """Trace and convert (module contract); returns (ov.Model, wrapped config holder)."""
    from openvino.frontend.pytorch import ConversionExtension, ModuleExtension
    from optimum.exporters.openvino.stateful import fuse_cache_reorder, make_stateful

    model, cfg = load_text_model(hf_dir)
    wrapper = HybridTextWrapper(model).eval()
    linear, full = wrapper.linear, wrapper.full
    gdn = model.model.layers[linear[0]].linear_attn if linear else None
    past, t = 3, 2
    gen = torch.Generator().manual_seed(0)
    example = [torch.randint(0, cfg.vocab_size, (1, t)), torch.ones(1, past + t, dtype=torch.int64),
               torch.arange(past, past + t)[None]]
    shapes = [ov.PartialShape([-1, -1])] * 3  # any batch: openvino's paged transformation needs it
    for _ in linear:
        conv = [1, gdn.conv_dim, gdn.conv_kernel_size]
        rec = [1, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim]
        example += [torch.randn(*conv, generator=gen), torch.randn(*rec, generator=gen) * 0.1]
        shapes += [ov.PartialShape([-1, *conv[1:]]), ov.PartialShape([-1, *rec[1:]])]
    kv_shape = [1, cfg.num_key_value_heads, past, cfg.head_dim]
    for _ in full:
        example += [torch.randn(*kv_shape, generator=gen), torch.randn(*kv_shape, generator=gen)]
        shapes += [ov.PartialShape([-1, cfg.num_key_value_heads, -1, cfg.head_dim])] * 2
    with torch.no_grad():
        ov_model = ov.convert_model(
            wrapper, example_input=tuple(example),
            extension=[ModuleExtension(GatedDeltaCell, _CELL_OP), ConversionExtension(_CELL_OP, _convert_cell)])
    ins, kv_in, outs, kv_out = _port_names(cfg, linear, full)
    for port, name, shape in zip(ov_model.inputs, ins + kv_in, shapes):
        port.get_tensor().set_names({name})
        port.get_node().set_partial_shape(shape)
    ov_model.validate_nodes_and_infer_types()
    named = outs + kv_out
    layer_results = list(ov_model.outputs[len(named):])
    for port, name in zip(ov_model.outputs, named):
        port.get_tensor().set_names({name})
    # the located layer outputs: the producers of the extra results, then the lm_head's input
    num_layers = cfg.num_hidden_layers
    producers = [r.get_node().input_value(0) for r in layer_results]
    for result in layer_results:
        ov_model.remove_result(result.get_node())
    producers.append(find_lm_head(ov_model).input_value(0))
    assert len(producers) == num_layers, (len(producers), num_layers)
    locators = {"layers": {str(i): {"producer": out.get_node().get_friendly_name(), "output_index": out.get_index()}
                           for i, out in enumerate(producers)}}
    ov_model.set_rt_info(json.dumps(locators), LOCATOR_KEY)

    not_kv = [p for p in ov_model.inputs if p.get_any_name() not in kv_in]
    fuse_cache_reorder(ov_model, not_kv, kv_in, 0)
    make_stateful(ov_model, not_kv, kv_in, kv_out, 0, None)
    ov_model.set_rt_info("8.0", ["runtime_options", "ACTIVATIONS_SCALE_FACTOR"])
    generation_config = getattr(model, "generation_config", None)
    return ov_model, SimpleNamespace(config=cfg, generation_config=generation_config)


def hybrid_geometry(text_config: dict) -> dict:
    """The manifest's description of the hybrid layout (for docs and runtime checks)."""
    n = int(text_config["num_hidden_layers"])
    types = text_config.get("layer_types") or [
        "full_attention" if (i + 1) % int(text_config.get("full_attention_interval", 4)) == 0
        else "linear_attention" for i in range(n)]
    return {
        "linear_attention_layers": [i for i, t in enumerate(types) if t == "linear_attention"],
        "full_attention_layers": [i for i, t in enumerate(types) if t == "full_attention"],
        "conv_kernel": int(text_config.get("linear_conv_kernel_dim", 4)),
        "linear_value_heads": int(text_config.get("linear_num_value_heads", 32)),
        "linear_key_head_dim": int(text_config.get("linear_key_head_dim", 128)),
        "linear_value_head_dim": int(text_config.get("linear_value_head_dim", 128)),
    }
