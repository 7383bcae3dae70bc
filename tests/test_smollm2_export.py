"""Slow: the real SmolLM2-135M-Instruct exports with a random drafter of its geometry.

Run: .venv/bin/python -m pytest -m slow -q tests/test_smollm2_export.py
The target (fp32 IR, f32 inference + f32 KV) must reproduce HF's logits and the features of
the drafter's target layers (z-lab formula for 30 layers, 5 features) over a chat prompt and
incremental steps; the grafted drafter must run and draft in-vocab tokens.
"""
import json
import time
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
import torch

from ovdflash import STRICT_F32
from ovdflash.ov.graphs import drafter_for_runtime, target_for_runtime

pytestmark = pytest.mark.slow
TOL = 1e-4


@pytest.fixture(scope="module")
def smollm2_pair(tmp_path_factory):
    from ovdflash_export.drafter import build_target_layer_ids
    from ovdflash_export.exporter import export_pair
    from ovdflash_export.tiny import make_tiny_drafter

    fetch = pytest.importorskip("ovdflash_models.fetch")
    target = fetch.fetch_smollm2()
    root = tmp_path_factory.mktemp("smollm2")
    drafter = make_tiny_drafter(target, root / "drafter", num_layers=1, block_size=8, mask_token_id=16,
                                target_layer_ids=build_target_layer_ids(30, 5))
    start = time.perf_counter()
    out = export_pair(target, drafter, root / "model", progress=print)
    print(f"SmolLM2 fp32 pair export: {time.perf_counter() - start:.1f} s")
    return target, out


@torch.no_grad()
def test_smollm2_target_features_equal_hf(smollm2_pair):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    hf_dir, model_dir = smollm2_pair
    m = json.loads((model_dir / "manifest.json").read_text())
    assert m["target"]["arch"] == "llama" and m["target"]["num_layers"] == 30 and m["vocab_size"] == 49152
    assert m["target_layer_ids"] == [1, 8, 14, 20, 27] and m["eos_token_ids"][0] == 2
    assert m["bos_token_id"] is None  # SmolLM2's tokenizer adds no BOS
    ids = m["target_layer_ids"]
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    tokens = np.array(tok.encode(prompt).ids + [504, 3575, 282, 4649, 314, 7042, 30], np.int64)

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    out = hf(torch.tensor(tokens)[None], output_hidden_states=True)
    want_logits = out.logits[0].numpy()
    want_feats = torch.cat([out.hidden_states[k + 1] for k in ids], -1)[0].numpy()

    core = ov.Core()
    target = target_for_runtime(core.read_model(str(model_dir / "target" / "openvino_model.xml")), ids)
    req = core.compile_model(target, "CPU", STRICT_F32).create_infer_request()
    n_prompt = len(tokens) - 7
    pos = 0
    for n in (n_prompt, 1, 4, 2):
        res = req.infer({"input_ids": tokens[None, pos:pos + n], "attention_mask": np.ones((1, pos + n), np.int64),
                         "position_ids": np.arange(pos, pos + n)[None], "beam_idx": np.zeros(1, np.int32),
                         "logits_indices": np.arange(n)})
        # SmolLM2's residual stream has outliers near 2.5e4: compare relative to the largest feature
        assert np.abs(res["target_hidden"][0] - want_feats[pos:pos + n]).max() < 1e-6 * np.abs(want_feats).max() + TOL
        assert np.abs(res["logits"][0] - want_logits[pos:pos + n]).max() < 1e-3
        assert (res["logits"][0].argmax(-1) == want_logits[pos:pos + n].argmax(-1)).all()
        pos += n

    drafter = drafter_for_runtime(core.read_model(str(model_dir / "drafter" / "openvino_model.xml")), target)
    d_req = core.compile_model(drafter, "CPU", STRICT_F32).create_infer_request()
    bs = m["block_size"]
    res = d_req.infer({"input_ids": np.array([[int(tokens[-1])] + [16] * (bs - 1)]),
                       "hidden_states": want_feats[None, :-1].astype(np.float32),
                       "position_ids": np.arange(len(tokens) - 1 + bs)[None],
                       "attention_mask": np.ones((1, len(tokens) - 1 + bs), np.int64),
                       "beam_idx": np.zeros(1, np.int32)})
    draft = res["draft_tokens"]
    assert draft.shape == (1, bs - 1) and ((0 <= draft) & (draft < 49152)).all()


def test_smollm2_gguf_export(smollm2_pair, tmp_path):
    """The GGUF route: same tokenizer as the fixed HF directory, int8 target that runs."""
    fetch = pytest.importorskip("ovdflash_models.fetch")
    from ovdflash_export.exporter import export_pair

    gguf = fetch.cache_root() / "downloads" / Path(fetch.GGUF_MEMBER).name
    if not gguf.is_file():
        pytest.skip(f"no GGUF at {gguf}")
    hf_dir, model_dir = smollm2_pair
    m = json.loads((model_dir / "manifest.json").read_text())
    start = time.perf_counter()
    out = export_pair(gguf, m["drafter"]["source"], tmp_path / "gguf_model", target_weight_format="int8",
                      drafter_weight_format="int8")
    print(f"SmolLM2 GGUF int8 export: {time.perf_counter() - start:.1f} s")
    g = json.loads((out / "manifest.json").read_text())
    assert g["target"]["source"].endswith(".gguf") and g["target"]["num_layers"] == 30
    assert g["eos_token_ids"][0] == 2 and g["bos_token_id"] is None
    assert json.loads((out / "tokenizer.json").read_text())["model"] == \
        json.loads((model_dir / "tokenizer.json").read_text())["model"]
    core = ov.Core()
    target = target_for_runtime(core.read_model(str(out / "target" / "openvino_model.xml")), g["target_layer_ids"])
    req = core.compile_model(target, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}).create_infer_request()
    res = req.infer({"input_ids": np.array([[1, 4093, 198]]), "attention_mask": np.ones((1, 3), np.int64),
                     "position_ids": np.arange(3)[None], "beam_idx": np.zeros(1, np.int32),
                     "logits_indices": np.array([2])})
    assert res["logits"].shape == (1, 1, 49152) and np.isfinite(res["target_hidden"]).all()
