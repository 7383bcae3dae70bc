"""DFlash drafter -> stateful OpenVINO IR in optimum-intel's DFlash drafter layout.

Contract (docs/DESIGN.md, "Drafter IR as saved"):

* inputs ``inputs_embeds [1,B,H] f32`` (the block ``[last, mask*(B-1)]`` embedded with the
  target table), ``hidden_states [1,C,n*Ht] f32`` (target features of the C newly committed
  tokens), ``position_ids [1,C+B] i64``, ``attention_mask [1,P+C+B] i64`` (all ones),
  ``beam_idx [1] i32``; output ``last_hidden_state [1,B-1,H]`` (after the final norm,
  block slots 1..B-1).
* state: per layer K and V (RoPE applied) of the committed context only. The block's K/V
  are never stored, so a rejected draft needs no drafter rollback.
* rt_info ``dflash_mode``="True", ``dflash/mask_token_id``, ``dflash/target_layer_ids``
  ("1,8,15"), ``dflash/block_size``, ``dflash/kind`` ("dflash" | "dflash2").
* A DFlash 2 drafter (``ovdflash_export.dflash2``) adds inputs ``candidate_ids [1,B-1,k] i64``
  (each draft slot's top-k candidate target ids; the runtime graph feeds them from the target
  head) and ``anchor_ids [1] i64`` (the block's first token), the output
  ``transition_scores [1,B-1,k,k] f32`` (``DFlash2Drafter.transition_scores``) and the rt_info
  ``dflash/selector_top_k``, ``dflash/output_multiplier``, ``dflash/final_logit_softcapping``
  (0: none) the runtime's head applies. Its K/V state is the same as DFlash 1's.
* A DSpark drafter (``ovdflash_export.dspark``) has DFlash 1's ports, state and output shape, but
  runs the block without its last token: slot i of ``[anchor, mask*(B-2)]`` predicts the token i + 1
  after the anchor, so ``last_hidden_state [1,B-1,H]`` is every slot it ran. Its Markov and
  confidence heads go to ``dspark_heads.npz`` beside the IR (applied by ``ovdflash.ov.dspark``);
  rt_info ``dflash/kind`` "dspark", ``dflash/markov_rank``, ``dflash/confidence_head`` ("0" | "1").

Route: our own module (export/drafter.py) with explicit past/present K/V, converted by
``ov.convert_model`` (TorchScript), then made stateful by optimum's ``fuse_cache_reorder``
+ ``make_stateful`` so the beam_idx Gather exists as in optimum's own exports.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import openvino as ov
import torch
from torch import nn

from .dflash2 import DFlash2Drafter, drafter_class
from .drafter import CONFIG_NAME, DFlashDrafter, DrafterConfig
from .dspark import DSparkDrafter, save_heads

IR_INPUTS = ["inputs_embeds", "hidden_states", "position_ids", "attention_mask"]
# a DFlash 2 drafter's extra inputs and output (after IR_INPUTS and last_hidden_state)
SELECTOR_INPUTS = ["candidate_ids", "anchor_ids"]
SELECTOR_OUTPUT = "transition_scores"


class DrafterIRWrapper(nn.Module):
    """Flat-tensor forward for tracing: explicit past K/V in, present (past + context) K/V out."""

    def __init__(self, drafter: DFlashDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, inputs_embeds, hidden_states, position_ids, attention_mask, *past_flat):
        past = [(past_flat[2 * i], past_flat[2 * i + 1]) for i in range(len(past_flat) // 2)]
        # [1, K] 0/1 -> [1, 1, 1, K] bool, broadcast over heads and block queries
        mask = attention_mask[:, None, None, :].to(torch.bool)
        hidden, presents = self.drafter(inputs_embeds, hidden_states, position_ids, past, mask)
        outputs = [hidden[:, 1:, :]]  # slot 0 holds the last committed token: not a draft
        for k, v in presents:
            outputs += [k, v]
        return tuple(outputs)


class SelectorIRWrapper(DrafterIRWrapper):
    """DrafterIRWrapper plus the DFlash 2 selector: candidates and anchor in, transition scores out."""

    def forward(self, inputs_embeds, hidden_states, position_ids, attention_mask, candidate_ids, anchor_ids,
                *past_flat):
        hidden, *presents = super().forward(inputs_embeds, hidden_states, position_ids, attention_mask, *past_flat)
        return (hidden, self.drafter.transition_scores(hidden, candidate_ids, anchor_ids), *presents)


class DSparkIRWrapper(DrafterIRWrapper):
    """DSpark: the block without its last token, every slot a draft (slot i predicts anchor + i + 1)."""

    def forward(self, inputs_embeds, hidden_states, position_ids, attention_mask, *past_flat):
        past = [(past_flat[2 * i], past_flat[2 * i + 1]) for i in range(len(past_flat) // 2)]
        mask = attention_mask[:, None, None, :-1].to(torch.bool)
        hidden, presents = self.drafter(inputs_embeds[:, :-1], hidden_states, position_ids[:, :-1], past, mask)
        outputs = [hidden]
        for k, v in presents:
            outputs += [k, v]
        return tuple(outputs)


def kv_names(num_layers: int):
    ins = [f"past_key_values.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]
    outs = [f"present.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]
    return ins, outs


def convert_drafter(drafter: DFlashDrafter, stateful: bool = True) -> ov.Model:
    """Trace the drafter and return the (stateful) ov.Model with DESIGN.md names and rt_info."""
    from optimum.exporters.openvino.stateful import fuse_cache_reorder, make_stateful

    cfg = drafter.config
    drafter = drafter.float().eval()
    n_layers, kv, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    past_len, ctx_len, block = 2, 3, cfg.block_size
    gen = torch.Generator().manual_seed(0)
    example = [
        torch.randn(1, block, cfg.hidden_size, generator=gen),
        torch.randn(1, ctx_len, cfg.fc_in_features, generator=gen),
        torch.arange(past_len, past_len + ctx_len + block, dtype=torch.int64)[None],
        torch.ones(1, past_len + ctx_len + block, dtype=torch.int64),
    ]
    in_names, out_names = list(IR_INPUTS), ["last_hidden_state"]
    shapes = [
        ov.PartialShape([-1, -1, cfg.hidden_size]),
        ov.PartialShape([-1, -1, cfg.fc_in_features]),
        ov.PartialShape([-1, -1]),
        ov.PartialShape([-1, -1]),
    ]
    wrapper = DrafterIRWrapper(drafter)
    if isinstance(drafter, DFlash2Drafter):
        top_k = cfg.dflash2.selector_top_k
        example += [torch.randint(0, cfg.vocab_size, (1, block - 1, top_k), generator=gen),
                    torch.randint(0, cfg.vocab_size, (1,), generator=gen)]
        in_names += SELECTOR_INPUTS
        out_names.append(SELECTOR_OUTPUT)
        shapes += [ov.PartialShape([-1, -1, top_k]), ov.PartialShape([-1])]
        wrapper = SelectorIRWrapper(drafter)
    elif isinstance(drafter, DSparkDrafter):
        wrapper = DSparkIRWrapper(drafter)
    example += [torch.randn(1, kv, past_len, hd, generator=gen) for _ in range(2 * n_layers)]
    with torch.no_grad():
        model = ov.convert_model(wrapper, example_input=tuple(example))

    kv_in, kv_out = kv_names(n_layers)
    shapes += [ov.PartialShape([-1, kv, -1, hd])] * (2 * n_layers)
    # convert_model may drop or mangle input names: set every name and shape by position
    for port, name, shape in zip(model.inputs, in_names + kv_in, shapes):
        port.get_tensor().set_names({name})
        port.get_node().set_partial_shape(shape)
    for port, name in zip(model.outputs, out_names + kv_out):
        port.get_tensor().set_names({name})
    model.validate_nodes_and_infer_types()

    if stateful:
        not_kv_inputs = [p for p in model.inputs if p.get_any_name() in in_names]
        fuse_cache_reorder(model, not_kv_inputs, kv_in, 0)
        make_stateful(model, not_kv_inputs, kv_in, kv_out, 0, None)

    model.set_rt_info("True", ["dflash_mode"])
    model.set_rt_info(str(cfg.mask_token_id), ["dflash", "mask_token_id"])
    model.set_rt_info(",".join(str(i) for i in cfg.target_layer_ids), ["dflash", "target_layer_ids"])
    model.set_rt_info(str(cfg.block_size), ["dflash", "block_size"])
    model.set_rt_info(cfg.kind, ["dflash", "kind"])
    if cfg.dflash2 is not None:
        s = cfg.dflash2
        model.set_rt_info(str(s.selector_top_k), ["dflash", "selector_top_k"])
        model.set_rt_info(repr(s.output_multiplier), ["dflash", "output_multiplier"])
        model.set_rt_info(repr(s.final_logit_softcapping or 0.0), ["dflash", "final_logit_softcapping"])
    if cfg.dspark is not None:
        model.set_rt_info(str(cfg.dspark.markov_rank), ["dflash", "markov_rank"])
        model.set_rt_info(str(int(cfg.dspark.confidence_head)), ["dflash", "confidence_head"])
    return model


def save_drafter(model: ov.Model, drafter_dir, out_dir, compress_to_fp16: bool = False) -> Path:
    """Write openvino_model.xml/.bin and the z-lab config.json next to it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, str(out_dir / "openvino_model.xml"), compress_to_fp16=compress_to_fp16)
    shutil.copyfile(Path(drafter_dir) / CONFIG_NAME, out_dir / CONFIG_NAME)
    return out_dir / "openvino_model.xml"


def export_drafter(drafter_dir, out_dir, weight_format: str = "fp32", block_size: int | None = None) -> Path:
    """Load a z-lab checkpoint, convert, compress and save it to out_dir."""
    from .compress import compress_model

    cfg = DrafterConfig.from_dict(json.loads((Path(drafter_dir) / CONFIG_NAME).read_text()))
    drafter = (DSparkDrafter if cfg.kind == "dspark" else drafter_class(cfg)).from_pretrained(drafter_dir)
    if block_size is not None:
        drafter.config.block_size = int(block_size)
    model = convert_drafter(drafter)
    model = compress_model(model, weight_format)
    xml = save_drafter(model, drafter_dir, out_dir, compress_to_fp16=weight_format == "fp16")
    if isinstance(drafter, DSparkDrafter):
        save_heads(drafter, out_dir)
    if block_size is not None:
        cfg = json.loads((Path(out_dir) / CONFIG_NAME).read_text())
        # a DSpark config counts the drafts, ovdflash's block the anchor too
        cfg["block_size"] = int(block_size) - (isinstance(drafter, DSparkDrafter))
        (Path(out_dir) / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
    return xml
