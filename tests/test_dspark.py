"""DSpark drafters: export, proposals equal to a torch reference, lossless decoding, config errors.

A tiny random DSpark checkpoint in DeepSpec's layout (`ovdflash_export.tiny.make_tiny_drafter(kind=
"dspark")`: config fields and safetensors names as its `save_pretrained` writes them; every head random,
none zero) is exported with the default tiny qwen3 target and run under STRICT_F32. The reference below
applies DeepSpec's math in torch: the DFlash backbone (ovdflash_export.drafter, checked against z-lab's
model elsewhere) on `[anchor, mask*(n-1)]`, slot i predicting the token i + 1 after the anchor, the
target head plus the Markov bias `W2 @ W1[previous]`, greedy slot by slot, and the confidence head on
`[h_i; W1[previous]]`.
"""
import json

import numpy as np
import pytest
import torch
from drafter_checks import (assert_export_fails, assert_greedy_equals_ar, assert_sampled_follows_ar, assert_seeded_equals_ar,
                            edited_checkpoint, random_prompts, strict_pipe)

from ovdflash.manifest import load_manifest

TRAINED_BLOCK = 7  # DSpark's block: drafts per pass
RANK = 8
TOL = 1e-4


@pytest.fixture(scope="module")
def sources(tiny_sources, tmp_path_factory):
    from ovdflash_export.tiny import make_tiny_drafter

    target, _ = tiny_sources()
    # DeepSpec's config carries fields the export ignores (num_anchors) or checks (layer_types)
    drafter = make_tiny_drafter(target, tmp_path_factory.mktemp("dspark") / "drafter", block_size=TRAINED_BLOCK + 1,
                                target_layer_ids=[1, 2], seed=5, kind="dspark", dspark=dict(markov_rank=RANK),
                                extra=dict(num_anchors=512, layer_types=["full_attention"]))
    return target, drafter


@pytest.fixture(scope="module")
def model_dir(sources, tmp_path_factory):
    from ovdflash_export.exporter import export_pair

    return export_pair(*sources, tmp_path_factory.mktemp("dspark_pair") / "out")


@pytest.fixture(scope="module")
def pipe(model_dir, tmp_path_factory):
    return strict_pipe(model_dir, tmp_path_factory.mktemp("ov_cache_dspark"))


@pytest.fixture(scope="module")
def reference(sources):
    from safetensors.torch import load_file

    from ovdflash_export.drafter import DFlashDrafter, DrafterConfig

    _, drafter = sources
    state = load_file(str(drafter / "model.safetensors"))
    backbone = DFlashDrafter(DrafterConfig.from_dict(json.loads((drafter / "config.json").read_text())))
    backbone.load_state_dict({k: v for k, v in state.items() if not k.startswith(("embed", "lm_head", "markov",
                                                                                  "confidence"))})
    backbone.eval()
    return backbone, state, json.loads((drafter / "config.json").read_text())


@torch.no_grad()
def reference_proposal(reference, last, feats, num_drafts):
    """DeepSpec's greedy block: (drafts, biased logits [n,V], predicted acceptance [n])."""
    backbone, state, config = reference
    ids = torch.full((1, num_drafts), config["mask_token_id"], dtype=torch.long)
    ids[0, 0] = last
    noise = state["embed_tokens.weight"][ids]
    positions = torch.arange(len(feats) + num_drafts)[None]
    hidden, _ = backbone(noise, torch.from_numpy(feats)[None], positions)
    base = hidden[0] @ state["lm_head.weight"].T
    w1, w2 = state["markov_head.markov_w1.weight"], state["markov_head.markov_w2.weight"]
    previous, drafts, rows, confidence = last, [], [], []
    for slot in range(num_drafts):
        row = base[slot] + w2 @ w1[previous]
        features = torch.cat([hidden[0, slot], w1[previous]])
        confidence.append(torch.sigmoid(features @ state["confidence_head.proj.weight"][0]
                                        + state["confidence_head.proj.bias"][0]))
        previous = int(torch.argmax(row))
        drafts.append(previous)
        rows.append(row)
    return np.array(drafts), torch.stack(rows).numpy(), torch.stack(confidence).numpy()


def test_the_manifest_and_the_ir_record_the_kind(model_dir):
    import openvino as ov

    manifest = load_manifest(model_dir)
    assert manifest["drafter"]["kind"] == "dspark"
    assert manifest["block_size"] == TRAINED_BLOCK + 1  # the anchor plus 7 drafts
    assert "drafter/dspark_heads.npz" in manifest["files"]
    ir = ov.Core().read_model(str(model_dir / "drafter" / "openvino_model.xml"))
    assert ir.get_rt_info(["dflash", "kind"]).astype(str) == "dspark"
    assert ir.get_rt_info(["dflash", "markov_rank"]).astype(str) == str(RANK)
    assert [p.get_any_name() for p in ir.outputs][0] == "last_hidden_state"


def test_proposals_equal_the_reference_on_random_contexts(pipe, reference):
    from ovdflash.ov.dspark import slot_logits

    drafter = pipe.drafter
    walk = drafter.proposals
    feat = drafter.compiled.input("hidden_states").get_partial_shape()[2].get_length()
    rng = np.random.default_rng(3)
    markov_changed = 0
    for trial in range(6):
        first, more = int(rng.integers(1, 40)), int(rng.integers(1, 6))
        feats = rng.standard_normal((first + more, feat)).astype(np.float32)
        drafter.reset()
        lasts = [int(rng.integers(0, 400)) for _ in range(2)]
        drafter.propose(lasts[0], feats[:first], first, TRAINED_BLOCK)
        got = drafter.propose(lasts[1], feats[first:], first + more, TRAINED_BLOCK)
        want, logits, confidence = reference_proposal(reference, lasts[1], feats, TRAINED_BLOCK)
        assert got.tolist() == want.tolist(), trial
        base = drafter.request.get_tensor(walk.logits_out).data[0]
        previous = np.r_[lasts[1], got[:-1]]
        assert np.abs(slot_logits(base, previous, walk.heads) - logits).max() < TOL
        assert np.abs(walk.confidence - confidence).max() < TOL
        markov_changed += int((np.argmax(base, axis=-1) != got).sum())
    assert markov_changed > 0  # the Markov bias changed some choices: the walk is exercised


def test_every_drafter_on_the_compiled_graph_walks(pipe):
    """The batch engine's drafter pool builds OVDrafters from the compiled graph alone: they walk too."""
    from ovdflash.ov.dspark import DSparkWalk
    from ovdflash.ov.runners import OVDrafter

    d = pipe.drafter
    again = OVDrafter(d.compiled, d.block_size, d.mask_token_id, len(d.ones[0]) - 1, seq_axes=d.seq_axes)
    assert isinstance(again.proposals, DSparkWalk)
    feats = np.random.default_rng(6).standard_normal((5, 128)).astype(np.float32)
    d.reset()
    assert again.propose(3, feats, 5, 4).tolist() == d.propose(3, feats, 5, 4).tolist()


@pytest.mark.parametrize("block", [4, 8])
def test_greedy_dspark_equals_autoregressive(pipe, block):
    assert_greedy_equals_ar(pipe, block)


def test_a_seeded_sampled_reply_equals_autoregressive(pipe):
    """The walk's choice is a deterministic proposal (q one-hot): seeded replies are AR's token for token."""
    assert_seeded_equals_ar(pipe)


def test_sampled_dspark_follows_the_ar_distribution(pipe):
    """Chi-square against AR: exact for the walk's proposals and the confidence cut."""
    # this random pair agrees rarely: a longer reply at a low temperature gives enough accepted drafts
    prompt = random_prompts(20, pipe.tokenizer.vocab_size, seed=4)[4]
    assert_sampled_follows_ar(pipe, prompt, tokens=16, temperature=0.1)


@pytest.mark.parametrize("case,config,drop,message", [
    ("missing markov", None, ("markov_head.markov_w2.weight",), "has no markov_head.markov_w2.weight"),
    ("wrong rank", {"markov_rank": 6}, (), "markov_head.markov_w1.weight has shape [512, 8]"),
    ("head type", {"markov_head_type": "rnn"}, (), "markov_head_type 'rnn' is not supported"),
    ("missing rank", {"markov_rank": None}, (), "lacks markov_rank"),
    ("vocab", {"vocab_size": 600}, (), "vocab size mismatch"),
])
def test_a_bad_dspark_config_is_a_one_line_error(sources, tmp_path, case, config, drop, message):
    target, drafter = sources
    assert_export_fails(target, edited_checkpoint(drafter, tmp_path / "bad", config, drop), tmp_path / "out", message)


def test_the_kind_is_read_from_architectures_or_fields(sources):
    from ovdflash_export.drafter import DrafterConfig

    d = json.loads((sources[1] / "config.json").read_text())
    cfg = DrafterConfig.from_dict(d)
    assert cfg.kind == "dspark" and cfg.dspark.markov_rank == RANK and cfg.block_size == TRAINED_BLOCK + 1
    assert DrafterConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
    assert cfg.to_dict()["block_size"] == TRAINED_BLOCK
    assert DrafterConfig.from_dict({k: v for k, v in d.items() if k != "architectures"}).kind == "dspark"


def test_a_batch_equals_single_runs(pipe):
    """The batch engine (its drafter pool walks with the heads) gives each prompt its single-run reply."""
    prompts = random_prompts(4, pipe.tokenizer.vocab_size, seed=21)
    for kwargs in ({}, {"temperature": 0.8, "seed": 3}):
        batch = pipe.generate_batch(prompts, max_new_tokens=16, max_batch_size=3, prompt_lookup=False, **kwargs)
        single = [pipe.generate(p, max_new_tokens=16, prompt_lookup=False, **kwargs) for p in prompts]
        assert [r.token_ids for r in batch] == [r.token_ids for r in single], kwargs


# -- the confidence head cuts the block (decode.block_policy: `BlockPolicy.cut`, `ConfidenceCut`) -----------
@pytest.fixture
def confidence_to(pipe, monkeypatch):
    """Sets every slot's predicted acceptance to c: the head's weight zero, its bias logit(c) (restored after)."""
    heads = pipe.drafter.proposals.heads  # shared by every drafter on the compiled graph, the batch's too

    def set_to(c):
        monkeypatch.setattr(heads, "confidence_weight", np.zeros_like(heads.confidence_weight))
        monkeypatch.setattr(heads, "confidence_bias", float(np.log(c / (1 - c))))
    return set_to


def cut_greedy_run(pipe, prompts, **kwargs):
    """Greedy replies equal AR's; returns the stats of the drafted runs."""
    from ovdflash.decode.stats import GenerationStats

    stats = GenerationStats()
    for i, prompt in enumerate(prompts):
        ar = [e.token for e in pipe.generate_tokens(prompt, 24, draft=False, eos_token_ids=[])]
        spec = [e.token for e in pipe.generate_tokens(prompt, 24, prompt_lookup=False, eos_token_ids=[], stats=stats,
                                                      **kwargs)]
        assert spec == ar, i
    return stats


@pytest.mark.parametrize("confidence, threshold, longest", [(0.5, None, 2), (0.95, None, 7), (0.5, 0.0, 7)])
def test_a_fixed_block_is_cut_where_the_predicted_reach_falls(pipe, confidence_to, monkeypatch, confidence,
                                                              threshold, longest):
    """Slots at 0.5 are reached with 0.5, 0.25, ...: below the default 0.2 from draft 3, so rounds verify 2."""
    confidence_to(confidence)
    if threshold is not None:
        monkeypatch.setattr(pipe, "confidence_threshold", threshold)
    stats = cut_greedy_run(pipe, random_prompts(4, pipe.tokenizer.vocab_size, seed=31), block_size=TRAINED_BLOCK + 1)
    assert len(stats.drafted_per_position) == longest and stats.num_drafts > 0


@pytest.mark.parametrize("confidence, longest", [(0.5, 2), (0.95, 7)])
def test_auto_cuts_the_block_its_policy_chose(pipe, confidence_to, monkeypatch, confidence, longest):
    """A policy sure of long blocks (acceptance 0.95) drafts 7; slots at 0.5 make 2 the best rate on its costs."""
    from ovdflash.decode.block_policy import BlockPolicy

    step_ms, draft_ms = [25.0 + 3 * k for k in range(TRAINED_BLOCK + 1)], [0.0] + [4.0] * TRAINED_BLOCK
    policy = BlockPolicy([m / 1e3 for m in step_ms], [m / 1e3 for m in draft_ms], prior_acceptance=0.95,
                         prior_strength=1e6, cost_update_rate=0.0, drift_rate=0.0)  # wall times teach it nothing
    monkeypatch.setattr(pipe, "block_policy", policy)
    confidence_to(confidence)
    stats = cut_greedy_run(pipe, random_prompts(3, pipe.tokenizer.vocab_size, seed=32), block_size="auto")
    assert len(stats.drafted_per_position) == longest


def test_a_batch_cuts_the_block_and_equals_single_runs(pipe, confidence_to):
    confidence_to(0.5)
    prompts = random_prompts(3, pipe.tokenizer.vocab_size, seed=33)
    batch = pipe.generate_batch(prompts, max_new_tokens=16, max_batch_size=3, prompt_lookup=False,
                                block_size=TRAINED_BLOCK + 1)
    ar = [pipe.generate(p, max_new_tokens=16, draft=False) for p in prompts]
    assert [r.token_ids for r in batch] == [r.token_ids for r in ar]
    assert all(0 < len(r.stats.drafted_per_position) <= 2 for r in batch)
