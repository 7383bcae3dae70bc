"""The drafter IR equals our PyTorch drafter, and the runtime drafter graph drafts what torch drafts.

* saved IR: DESIGN.md names, stateful (K/V per layer behind the beam_idx Gather), rt_info;
* f32 inference + f32 KV: `last_hidden_state` equals the PyTorch drafter < 1e-4 over 4
  consecutive rounds with the state carried; the state holds committed context only;
* `drafter_for_runtime`: `draft_tokens` equal torch argmax(target lm_head(drafter(target
  embedding(block)))), and the grafted embedding/lm_head share the target's weight memory.
"""
import json
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
import torch
from ovdflash_export.drafter import DFlashDrafter

from ovdflash import STRICT_F32
from ovdflash.ov.graphs import drafter_for_runtime, find_embedding_gather, find_lm_head, target_for_runtime

TOL = 1e-4


def _manifest(d):
    return json.loads((Path(d) / "manifest.json").read_text())


def _read(model_dir, which):
    return ov.Core().read_model(str(Path(model_dir) / which / "openvino_model.xml"))


@pytest.fixture(scope="module")
def pair2(export_tiny_pair):
    """A 2-layer drafter with 3 features (GQA 4/2) on a llama target with tied embeddings.

    The default `tiny_pair` (qwen3, untied, 1 layer) covers the other case; the same
    arguments as test_target_ir.py's llama pair, so the export is shared.
    """
    return export_tiny_pair(arch="llama", num_drafter_layers=2, target_layer_ids=(0, 1, 3))


def test_saved_drafter_ir_layout(pair2):
    model = _read(pair2, "drafter")
    names = [p.get_any_name() for p in model.inputs]
    assert names == ["inputs_embeds", "hidden_states", "position_ids", "attention_mask", "beam_idx"]
    types = {p.get_any_name(): p.get_element_type() for p in model.inputs}
    assert types["inputs_embeds"] == ov.Type.f32 and types["position_ids"] == ov.Type.i64
    assert types["attention_mask"] == ov.Type.i64 and types["beam_idx"] == ov.Type.i32
    assert [p.get_any_name() for p in model.outputs] == ["last_hidden_state"]
    assert model.get_rt_info("dflash_mode").astype(str) == "True"
    m = _manifest(pair2)
    assert model.get_rt_info(["dflash", "target_layer_ids"]).astype(str) == "0,1,3"
    assert int(model.get_rt_info(["dflash", "mask_token_id"]).astype(str)) == m["mask_token_id"]
    assert int(model.get_rt_info(["dflash", "block_size"]).astype(str)) == m["block_size"]
    read_values = [op for op in model.get_ops() if op.get_type_name() == "ReadValue"]
    assert len(read_values) == 2 * 2
    assert len(model.input("beam_idx").get_target_inputs()) == 4  # one reorder Gather per variable


def _rounds():
    """(ctx_len, start) per round: a prompt, then a+1 committed tokens per round."""
    start = 0
    for ctx_len in (7, 2, 4, 1):
        start += ctx_len
        yield ctx_len, start


@torch.no_grad()
def test_drafter_ir_equals_torch_over_rounds(pair2):
    drafter = DFlashDrafter.from_pretrained(_manifest(pair2)["drafter"]["source"])
    cfg = drafter.config
    bs = _manifest(pair2)["block_size"]
    req = ov.Core().compile_model(_read(pair2, "drafter"), "CPU", STRICT_F32).create_infer_request()
    gen = torch.Generator().manual_seed(0)
    past, kept = None, 0
    for ctx_len, start in _rounds():
        embeds = torch.randn(1, bs, cfg.hidden_size, generator=gen)
        feats = torch.randn(1, ctx_len, cfg.fc_in_features, generator=gen)
        pos = torch.arange(start - ctx_len, start + bs)[None]
        want, past = drafter(embeds, feats, pos, past)
        res = req.infer({
            "inputs_embeds": embeds.numpy(), "hidden_states": feats.numpy(), "position_ids": pos.numpy(),
            "attention_mask": np.ones((1, kept + ctx_len + bs), np.int64), "beam_idx": np.zeros(1, np.int32),
        })
        got = res["last_hidden_state"]
        assert got.shape == (1, bs - 1, cfg.hidden_size)
        assert np.abs(got - want[:, 1:].numpy()).max() < TOL
        kept += ctx_len
    # the state holds exactly the committed context: K/V [1, kv, kept, hd], block K/V never stored
    for state in req.query_state():
        assert state.state.shape == [1, cfg.num_key_value_heads, kept, cfg.head_dim]
        layer, kind = state.name.split(".")[1], state.name.split(".")[2][:5]
        want_kv = past[int(layer)][0 if kind.startswith("key") else 1]
        assert np.abs(state.state.data - want_kv.numpy()).max() < TOL


@torch.no_grad()
def test_runtime_drafter_tokens_equal_torch_argmax(pair2):
    from transformers import AutoModelForCausalLM

    m = _manifest(pair2)
    drafter = DFlashDrafter.from_pretrained(m["drafter"]["source"])
    hf = AutoModelForCausalLM.from_pretrained(m["target"]["source"], dtype=torch.float32).eval()
    target = target_for_runtime(_read(pair2, "target"), m["target_layer_ids"])
    model = drafter_for_runtime(_read(pair2, "drafter"), target)
    assert {p.get_any_name() for p in model.inputs} == {"input_ids", "hidden_states", "position_ids",
                                                         "attention_mask", "beam_idx"}
    assert [p.get_any_name() for p in model.outputs] == ["draft_tokens"]
    req = ov.Core().compile_model(model, "CPU", STRICT_F32).create_infer_request()
    bs, mask_id = m["block_size"], m["mask_token_id"]
    rng = np.random.RandomState(0)
    gen = torch.Generator().manual_seed(1)
    past, kept, compared = None, 0, 0
    for ctx_len, start in _rounds():
        block = np.array([rng.randint(0, 400)] + [mask_id] * (bs - 1), np.int64)
        feats = torch.randn(1, ctx_len, drafter.config.fc_in_features, generator=gen) * 2
        pos = torch.arange(start - ctx_len, start + bs)[None]
        hidden, past = drafter(hf.get_input_embeddings()(torch.tensor(block)[None]), feats, pos, past)
        logits = hf.lm_head(hidden[:, 1:])
        want = logits.argmax(-1).numpy()
        res = req.infer({
            "input_ids": block[None], "hidden_states": feats.numpy(), "position_ids": pos.numpy(),
            "attention_mask": np.ones((1, kept + ctx_len + bs), np.int64), "beam_idx": np.zeros(1, np.int32),
        })
        got = res["draft_tokens"]
        assert got.dtype == np.int64 and got.shape == (1, bs - 1)
        assert (got == want).all(), (got, want)
        compared += got.size
        kept += ctx_len
    assert compared == 4 * (bs - 1)


def _constant_data_ptrs(node_output):
    """Data pointers of the Constants in the subgraph that produces node_output."""
    ptrs, stack, seen = set(), [node_output.get_node()], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.get_type_name() == "Constant" and node.get_output_size() == 1 and \
                len(node.get_output_partial_shape(0)) == 2:
            ptrs.add(node.get_data(copy=False).ctypes.data if hasattr(node, "get_data") else node.data.ctypes.data)
        stack.extend(i.get_source_output().get_node() for i in node.inputs())
    return ptrs


def test_grafted_head_reuses_target_weights(tiny_pair):
    m = _manifest(tiny_pair)
    target = target_for_runtime(_read(tiny_pair, "target"), m["target_layer_ids"])
    table_ptrs = _constant_data_ptrs(find_embedding_gather(target).input_value(0))
    head_ptrs = _constant_data_ptrs(find_lm_head(target).input_value(1))
    assert len(table_ptrs) == 1 and len(head_ptrs) == 1  # qwen3 tiny: untied [V,H] tables
    model = drafter_for_runtime(_read(tiny_pair, "drafter"), target)
    draft_gather = find_embedding_gather(model)
    assert _constant_data_ptrs(draft_gather.input_value(0)) == table_ptrs
    tokens = model.output("draft_tokens").get_node()
    # walk up from draft_tokens to the head MatMul and check it reads the target's weight memory
    node = tokens.input_value(0).get_node()
    while node.get_type_name() != "MatMul":
        node = node.input_value(0).get_node()
    assert _constant_data_ptrs(node.input_value(1)) == head_ptrs
