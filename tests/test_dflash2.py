"""DFlash 2 drafters: export, proposals equal to z-lab's reference, lossless decoding, config errors.

A tiny random DFlash 2 drafter built with z-lab's own `DFlash2DraftModel` (`dflash==0.1.0`, the
test-only oracle; every optional transform active: input scale, logit multiplier and cap) is
exported with the default tiny qwen3 target at block 8 and run under STRICT_F32.
"""
import json

import numpy as np
import pytest
import torch
from drafter_checks import (assert_export_fails, assert_greedy_equals_ar, assert_sampled_follows_ar, assert_seeded_equals_ar,
                            edited_checkpoint, strict_pipe)

from ovdflash.manifest import load_manifest
from ovdflash.ov.dflash2 import walk

dflash_model = pytest.importorskip("dflash.model")

BLOCK = 8
TOL = 1e-4


@pytest.fixture(scope="module")
def sources(tiny_sources, tmp_path_factory):
    from ovdflash_export.tiny import make_tiny_drafter

    target, _ = tiny_sources()
    drafter = make_tiny_drafter(target, tmp_path_factory.mktemp("dflash2") / "drafter", block_size=BLOCK,
                                target_layer_ids=[1, 2], seed=7, kind="dflash2")
    return target, drafter


@pytest.fixture(scope="module")
def model_dir(sources, tmp_path_factory):
    from ovdflash_export.exporter import export_pair

    return export_pair(*sources, tmp_path_factory.mktemp("dflash2_pair") / "out")


@pytest.fixture(scope="module")
def pipe(model_dir, tmp_path_factory):
    return strict_pipe(model_dir, tmp_path_factory.mktemp("ov_cache_dflash2"))


@pytest.fixture(scope="module")
def reference(sources):
    """(z-lab's DFlash2DraftModel on the checkpoint, the HF target) in f32."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    target, drafter = sources
    config = Qwen3Config(**json.loads((drafter / "config.json").read_text()))
    config._attn_implementation = "sdpa"
    ref = dflash_model.DFlash2DraftModel.from_pretrained(str(drafter), config=config, dtype=torch.float32).eval()
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    return ref, hf


@torch.no_grad()
def reference_proposal(ref, hf, last, feats, block):
    """z-lab's greedy proposal for a block of `block` tokens after the context `feats` (positions 0..)."""
    ids = torch.full((1, block), ref.mask_token_id, dtype=torch.long)
    ids[0, 0] = last
    noise = dflash_model._raw_input_embeddings(hf, ids, float(ref.config.dflash_config["input_embedding_scale"]))
    positions = torch.arange(len(feats) + block)[None]
    hidden = ref(position_ids=positions, noise_embedding=noise, target_hidden=torch.from_numpy(feats)[None])[:, 1:]
    logits = ref.compute_logits(hidden, hf.lm_head)
    tokens, candidates, _ = ref.propose(hidden, ids[:, 0], hf.lm_head, 0.0)
    return tokens[0].numpy(), logits[0], ref.candidate_selector.hidden_projection(hidden)[0]


def ov_outputs(drafter):
    return {name: drafter.request.get_tensor(drafter.compiled.output(name)).data[0].copy()
            for name in ("draft_candidates", "draft_scores", "transition_scores")}


def test_the_manifest_and_the_ir_record_the_kind(model_dir, tiny_pair):
    import openvino as ov

    manifest = load_manifest(model_dir)
    assert manifest["drafter"]["kind"] == "dflash2"
    assert load_manifest(tiny_pair)["drafter"]["kind"] == "dflash"
    ir = ov.Core().read_model(str(model_dir / "drafter" / "openvino_model.xml"))
    assert ir.get_rt_info(["dflash", "kind"]).astype(str) == "dflash2"
    assert ir.get_rt_info(["dflash", "selector_top_k"]).astype(str) == "4"
    names = [p.get_any_name() for p in ir.inputs]
    assert names[:6] == ["inputs_embeds", "hidden_states", "position_ids", "attention_mask", "candidate_ids",
                         "anchor_ids"]
    assert [p.get_any_name() for p in ir.outputs] == ["last_hidden_state", "transition_scores"]
    assert [v for v in ir.get_ops() if v.get_type_name() == "ReadValue"]  # stateful like DFlash 1


def test_proposals_equal_the_reference_on_random_contexts(pipe, reference):
    ref, hf = reference
    drafter = pipe.drafter
    feat = drafter.compiled.input("hidden_states").get_partial_shape()[2].get_length()
    rng = np.random.default_rng(3)
    differs_from_argmax = 0
    for trial in range(8):
        first, more = int(rng.integers(1, 40)), int(rng.integers(1, 6))
        feats = rng.standard_normal((first + more, feat)).astype(np.float32)
        drafter.reset()
        lasts = [int(rng.integers(0, 400)) for _ in range(2)]
        drafter.propose(lasts[0], feats[:first], first, BLOCK - 1)
        # a second call carries the first call's context in the drafter state
        got = drafter.propose(lasts[1], feats[first:], first + more, BLOCK - 1)
        want, logits, _ = reference_proposal(ref, hf, lasts[1], feats, BLOCK)
        assert got.tolist() == want.tolist(), trial
        out = ov_outputs(drafter)
        unary, order = torch.topk(logits, 4, dim=-1)  # sorted: the runtime's top-k is too
        assert out["draft_candidates"].tolist() == order.numpy().tolist()
        assert np.abs(out["draft_scores"] - unary.numpy()).max() < TOL
        differs_from_argmax += int((got != out["draft_candidates"][:, 0]).sum())
    assert differs_from_argmax > 0  # the transition scores changed some choices: the walk is exercised


def test_transition_scores_equal_the_reference_selector(pipe, reference):
    ref, hf = reference
    sel = ref.candidate_selector
    drafter = pipe.drafter
    feat = drafter.compiled.input("hidden_states").get_partial_shape()[2].get_length()
    feats = np.random.default_rng(4).standard_normal((11, feat)).astype(np.float32)
    drafter.reset()
    drafter.propose(17, feats, len(feats), BLOCK - 1)
    out = ov_outputs(drafter)
    _, _, projected = reference_proposal(ref, hf, 17, feats, BLOCK)
    candidates = torch.from_numpy(out["draft_candidates"])
    predecessors = torch.cat([torch.full((1, 4), 17), candidates[:-1]])
    with torch.no_grad():
        want = torch.einsum("pir,pr,pjr->pij", sel.predecessor_codebook(predecessors), projected,
                            sel.successor_codebook(candidates))
    assert np.abs(out["transition_scores"] - want.numpy()).max() < TOL


def test_the_walk_adds_the_transition_from_the_previous_choice():
    candidates = np.array([[10, 11], [20, 21], [30, 31]])
    unary = np.array([[1.0, 0.0], [0.0, 0.5], [0.0, 0.0]], dtype=np.float32)
    transitions = np.zeros((3, 2, 2), dtype=np.float32)
    transitions[0, 0] = [0.0, 2.0]  # from the anchor: 11 beats 10's unary lead
    transitions[1, 1] = [1.0, 0.0]  # after 11: 20 beats 21's unary lead
    transitions[2, 0] = [0.0, 0.1]  # after 20: 31
    transitions[2, 1] = [0.1, 0.0]  # row of the choice not taken: ignored
    assert walk(candidates, unary, transitions).tolist() == [11, 20, 31]
    assert walk(candidates[:2], unary[:2], transitions[:2]).tolist() == [11, 20]


def test_every_drafter_on_the_compiled_graph_walks(pipe):
    """The batch engine's drafter pool builds OVDrafters from the compiled graph alone: they walk too."""
    from ovdflash.ov.dflash2 import SelectorWalk
    from ovdflash.ov.runners import OVDrafter

    d = pipe.drafter
    again = OVDrafter(d.compiled, d.block_size, d.mask_token_id, len(d.ones[0]) - 1, seq_axes=d.seq_axes)
    assert isinstance(again.proposals, SelectorWalk)
    feats = np.random.default_rng(6).standard_normal((5, d.compiled.input("hidden_states").get_partial_shape()[2]
                                                      .get_length())).astype(np.float32)
    d.reset()
    assert again.propose(3, feats, 5, BLOCK - 1).tolist() == d.propose(3, feats, 5, BLOCK - 1).tolist()


def test_the_selector_graph_with_a_draft_vocabulary(model_dir):
    import openvino as ov

    from ovdflash.ov.dflash2 import selector_for_runtime

    core = ov.Core()

    def graph(vocab):
        drafter = core.read_model(str(model_dir / "drafter" / "openvino_model.xml"))
        return selector_for_runtime(drafter, core.read_model(str(model_dir / "target" / "openvino_model.xml")), vocab)

    vocab = np.arange(100, 160)
    request = core.compile_model(graph(vocab), "CPU").create_infer_request()
    request.infer({"input_ids": np.array([[5] + [511] * (BLOCK - 1)]),
                   "hidden_states": np.random.default_rng(0).standard_normal((1, 6, 128)).astype(np.float32),
                   "position_ids": np.arange(6 + BLOCK)[None], "attention_mask": np.ones((1, 6 + BLOCK), np.int64),
                   "beam_idx": np.zeros(1, np.int32)})
    candidates = request.get_tensor("draft_candidates").data
    assert candidates.shape == (1, BLOCK - 1, 4) and np.isin(candidates, vocab).all()
    with pytest.raises(ValueError, match="selector_top_k 4 exceeds the draft vocabulary's 3 ids"):
        graph(np.arange(3))
    with pytest.raises(ValueError, match="not 'dflash2'"):
        drafter = core.read_model(str(model_dir / "drafter" / "openvino_model.xml"))
        drafter.set_rt_info("dflash", ["dflash", "kind"])
        selector_for_runtime(drafter, core.read_model(str(model_dir / "target" / "openvino_model.xml")))


def test_a_pass_shorter_than_the_convolution_equals_the_reference(pipe, reference):
    """An exact pass (draft_pass "exact") of 2 tokens: the convolutions pad the block's start."""
    ref, hf = reference
    drafter = pipe.drafter
    feat = drafter.compiled.input("hidden_states").get_partial_shape()[2].get_length()
    feats = np.random.default_rng(5).standard_normal((9, feat)).astype(np.float32)
    drafter.draft_block = 0
    try:
        drafter.reset()
        got = drafter.propose(23, feats, len(feats), 1)
    finally:
        drafter.draft_block = drafter.block_size
    assert got.tolist() == reference_proposal(ref, hf, 23, feats, 2)[0].tolist()


@pytest.mark.parametrize("block", [4, 8])
def test_greedy_dflash2_equals_autoregressive(pipe, block):
    assert_greedy_equals_ar(pipe, block)


def test_a_seeded_sampled_reply_equals_autoregressive(pipe):
    """The walk's choice is a deterministic proposal (q one-hot): the rejection sampler stays exact,
    so a seeded reply is the AR one token for token."""
    assert_seeded_equals_ar(pipe)


@pytest.mark.parametrize("case,config,drop,message", [
    ("missing codebook", None, ("candidate_selector.successor_codebook",),
     "has no candidate_selector.successor_codebook"),
    ("wrong rank", {"selector_rank": 6}, (), "candidate_selector.predecessor_codebook has shape [512, 8]"),
    ("missing setting", {"selector_top_k": None}, (), "lacks dflash_config.selector_top_k"),
    ("group size", {"conv_group_size": 24}, (), "conv_group_size 24 does not divide hidden_size 64"),
])
def test_a_bad_dflash2_config_is_a_one_line_error(sources, tmp_path, case, config, drop, message):
    target, drafter = sources
    assert_export_fails(target, edited_checkpoint(drafter, tmp_path / "bad", config, drop, section="dflash_config"), tmp_path / "out", message)


def test_the_kind_is_read_from_architectures_or_fields(sources):
    from ovdflash_export.drafter import DrafterConfig

    d = json.loads((sources[1] / "config.json").read_text())
    cfg = DrafterConfig.from_dict(d)
    assert cfg.kind == "dflash2" and cfg.dflash2.selector_rank == 8 and cfg.dflash2.final_logit_softcapping == 3.0
    assert DrafterConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
    assert DrafterConfig.from_dict({k: v for k, v in d.items() if k != "architectures"}).kind == "dflash2"
    with pytest.raises(ValueError, match="not a DFlash drafter config"):
        DrafterConfig.from_dict({**d, "architectures": ["LlamaForCausalLM"]})


def test_sampled_dflash2_follows_the_ar_distribution(pipe):
    assert_sampled_follows_ar(pipe)
