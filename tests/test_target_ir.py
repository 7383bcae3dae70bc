"""The exported target IR (through `target_for_runtime`) computes what HF transformers computes.

For llama, qwen2 and qwen3 tiny targets: logits and target features equal HF (f32) < 1e-4
over a prefill and several incremental steps; mask-based rollback equals a fresh run; the
CPU runtime graph keeps the fused stateful SDPA; default CPU settings (bf16, u8 KV) agree
on argmax within a loose tolerance.
"""
import json
from collections import Counter
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
import torch

from ovdflash import STRICT_F32
from ovdflash.ov.graphs import LOCATOR_KEY, read_layer_locators, target_for_runtime

ARCHS = ["llama", "qwen2", "qwen3"]
# the default pairs, shared with the runtime tests (test_rollback.py, test_lossless.py)
TOL = 1e-4


def _manifest(d):
    return json.loads((Path(d) / "manifest.json").read_text())


def _compile_target(model_dir, config=STRICT_F32, layer_ids=None):
    core = ov.Core()
    ids = _manifest(model_dir)["target_layer_ids"] if layer_ids is None else layer_ids
    model = target_for_runtime(core.read_model(str(Path(model_dir) / "target" / "openvino_model.xml")), ids)
    return core.compile_model(model, "CPU", config)


def _hf(model_dir):
    from transformers import AutoModelForCausalLM

    src = _manifest(model_dir)["target"]["source"]
    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


@torch.no_grad()
def _hf_reference(hf, tokens, layer_ids):
    out = hf(torch.tensor(tokens)[None], output_hidden_states=True)
    feats = torch.cat([out.hidden_states[k + 1] for k in layer_ids], dim=-1)
    return out.logits[0].numpy(), feats[0].numpy()


def _step(req, tokens, positions, mask, rows=None):
    rows = np.arange(len(tokens)) if rows is None else np.asarray(rows)
    res = req.infer({
        "input_ids": np.asarray(tokens, np.int64)[None],
        "attention_mask": np.asarray(mask, np.int64)[None],
        "position_ids": np.asarray(positions, np.int64)[None],
        "beam_idx": np.zeros(1, np.int32),
        "logits_indices": rows.astype(np.int64),
    })
    return res["logits"][0].copy(), res["target_hidden"][0].copy()


@pytest.fixture(scope="module", params=ARCHS)
def arch_pair(request, export_tiny_pair):
    return request.param, export_tiny_pair(arch=request.param)


def test_saved_ir_layout(arch_pair):
    arch, model_dir = arch_pair
    model = ov.Core().read_model(str(model_dir / "target" / "openvino_model.xml"))
    names = [p.get_any_name() for p in model.inputs]
    assert names == ["input_ids", "attention_mask", "position_ids", "beam_idx"]
    assert [p.get_any_name() for p in model.outputs] == ["logits"]
    n_layers = _manifest(model_dir)["target"]["num_layers"]
    assert sorted(read_layer_locators(model)) == list(range(n_layers))
    assert json.loads(model.get_rt_info(LOCATOR_KEY).astype(str))["layers"].keys() == {str(i) for i in range(n_layers)}
    ops = Counter(op.get_type_name() for op in model.get_ops())
    assert ops["ReadValue"] == 2 * n_layers and ops["Assign"] == 2 * n_layers
    beam = model.input("beam_idx")
    assert len(beam.get_target_inputs()) == 2 * n_layers  # one reorder Gather per KV variable
    assert not model.has_rt_info(["runtime_options", "KV_CACHE_PRECISION"])
    assert model.get_rt_info(["runtime_options", "ACTIVATIONS_SCALE_FACTOR"]).astype(str) == "8.0"


def test_runtime_graph_has_fused_stateful_sdpa(arch_pair):
    _, model_dir = arch_pair
    n_layers = _manifest(model_dir)["target"]["num_layers"]
    compiled = _compile_target(model_dir)
    runtime_ops = compiled.get_runtime_model().get_ops()

    def kind(node):
        return node.get_rt_info()["layerType"].astype(str)

    sdpa = [op for op in runtime_ops if kind(op) == "ScaledDotProductAttention"]
    assert len(sdpa) == n_layers
    # fused stateful SDPA: the past K/V come straight from the state (no Gather/Concat in between)
    for op in sdpa:
        sources = [kind(i.get_source_output().get_node()) for i in op.inputs()]
        assert sources.count("MemoryInput") == 2, sources


def test_logits_and_features_equal_hf(arch_pair):
    _, model_dir = arch_pair
    hf = _hf(model_dir)
    # every layer, the last one (HF: after the final norm) included, in a shuffled order
    layer_ids = [3, 0, 2, 1]
    tokens = np.random.RandomState(1).randint(0, 400, size=16)
    want_logits, want_feats = _hf_reference(hf, tokens, layer_ids)
    req = _compile_target(model_dir, layer_ids=layer_ids).create_infer_request()
    pos = 0
    for n in (9, 1, 4, 2):  # prefill, then incremental steps of different widths
        chunk = tokens[pos:pos + n]
        logits, feats = _step(req, chunk, range(pos, pos + n), np.ones(pos + n))
        assert logits.shape == (n, hf.config.vocab_size)
        assert feats.shape == (n, len(layer_ids) * hf.config.hidden_size)
        assert np.abs(logits - want_logits[pos:pos + n]).max() < TOL
        assert np.abs(feats - want_feats[pos:pos + n]).max() < TOL
        pos += n


def test_logits_indices_select_rows(arch_pair):
    _, model_dir = arch_pair
    hf = _hf(model_dir)
    tokens = np.random.RandomState(2).randint(0, 400, size=7)
    want_logits, _ = _hf_reference(hf, tokens, _manifest(model_dir)["target_layer_ids"])
    req = _compile_target(model_dir).create_infer_request()
    logits, feats = _step(req, tokens, range(7), np.ones(7), rows=[6])
    assert logits.shape == (1, hf.config.vocab_size) and feats.shape[0] == 7
    assert np.abs(logits[0] - want_logits[6]).max() < TOL


def test_mask_based_rollback_equals_fresh_run(arch_pair):
    """Rejected slots stay in the cache masked to 0; positions stay logical."""
    _, model_dir = arch_pair
    layer_ids = _manifest(model_dir)["target_layer_ids"]
    rng = np.random.RandomState(3)
    true_seq = rng.randint(0, 400, size=12)
    garbage = rng.randint(0, 400, size=3)
    want_logits, want_feats = _hf_reference(_hf(model_dir), true_seq, layer_ids)

    req = _compile_target(model_dir).create_infer_request()
    mask = [1] * 6
    _step(req, true_seq[:6], range(6), mask)
    # verify step: 2 good tokens then 3 rejected drafts, at logical positions 6..10
    block = np.concatenate([true_seq[6:8], garbage])
    mask += [1] * 5
    _step(req, block, range(6, 11), mask)
    mask[-3:] = [0, 0, 0]  # roll back the 3 rejected slots
    # continue with the true tokens at logical positions 8..11 (physical slots 11..14)
    mask += [1] * 4
    logits, feats = _step(req, true_seq[8:12], range(8, 12), mask)
    assert np.abs(logits - want_logits[8:12]).max() < TOL
    assert np.abs(feats - want_feats[8:12]).max() < TOL
    # without the rollback mask the answer is different (the test can fail)
    req2 = _compile_target(model_dir).create_infer_request()
    _step(req2, true_seq[:6], range(6), np.ones(6))
    _step(req2, block, range(6, 11), np.ones(11))
    bad_logits, _ = _step(req2, true_seq[8:12], range(8, 12), np.ones(15))
    assert np.abs(bad_logits - want_logits[8:12]).max() > 1e-3


# what the CPU plugin picks by default on bf16-capable Xeons (explicit: this VM defaults to f32 without AMX)
DEFAULT_XEON = {"INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "u8"}


def test_default_cpu_settings_agree_on_argmax(arch_pair):
    _, model_dir = arch_pair
    hf = _hf(model_dir)
    tokens = np.random.RandomState(4).randint(0, 400, size=24)
    want_logits, want_feats = _hf_reference(hf, tokens, _manifest(model_dir)["target_layer_ids"])
    req = _compile_target(model_dir, config=DEFAULT_XEON).create_infer_request()
    got = []
    for lo, hi in ((0, 16), (16, 20), (20, 24)):
        logits, feats = _step(req, tokens[lo:hi], range(lo, hi), np.ones(hi))
        got.append(logits)
        assert np.abs(feats - want_feats[lo:hi]).max() < 0.25 * np.abs(want_feats).max()
    got = np.concatenate(got)
    scale = np.abs(want_logits).max()
    assert np.abs(got - want_logits).max() < 0.1 * scale
    # argmax must agree wherever HF's top-2 margin is not a near-tie for bf16
    top2 = np.sort(want_logits, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.02 * scale
    assert clear.sum() >= len(tokens) // 2
    assert (got.argmax(-1)[clear] == want_logits.argmax(-1)[clear]).all()
