"""Our PyTorch DFlash drafter equals the z-lab reference (`dflash==0.1.0`, model forward only).

Same weights, same inputs, f32: max abs diff < 1e-4, for a single call, for several
rounds with the cache carried (reference: DynamicCache cropped to the committed context),
and for a training-style explicit mask.
"""
import json

import pytest
import torch

from ovdflash_export.drafter import DFlashDrafter, DrafterConfig, build_target_layer_ids
from ovdflash_export.tiny import make_tiny_drafter, make_tiny_target

dflash_model = pytest.importorskip("dflash.model")
TOL = 1e-4


def test_build_target_layer_ids_matches_zlab_formula():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert build_target_layer_ids(30, 1) == [15]
    for L, n in [(36, 5), (32, 5), (30, 3), (4, 2), (28, 4)]:
        assert build_target_layer_ids(L, n) == dflash_model.build_target_layer_ids(L, n)


@pytest.fixture(scope="module")
def drafter_pair(tmp_path_factory):
    """(ours, reference) on the same random weights: 2 layers, GQA 4/2, 3 target features."""
    from transformers import Qwen3Config

    root = tmp_path_factory.mktemp("drafter_ref")
    make_tiny_target("qwen3", root / "target")
    make_tiny_drafter(root / "target", root / "drafter", num_layers=2, target_layer_ids=[0, 2, 3], seed=3)
    ours = DFlashDrafter.from_pretrained(root / "drafter")
    ref_cfg = Qwen3Config(**json.loads((root / "drafter" / "config.json").read_text()))
    ref_cfg._attn_implementation = "sdpa"
    ref = dflash_model.DFlashDraftModel(ref_cfg).eval()
    missing, unexpected = ref.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return ours, ref


def test_config_roundtrip(drafter_pair, tmp_path):
    ours, _ = drafter_pair
    d = ours.config.to_dict()
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    assert d["dflash_config"] == {"target_layer_ids": [0, 2, 3], "mask_token_id": 511}
    again = DrafterConfig.from_dict(json.loads(json.dumps(d)))
    assert again.to_dict() == d
    ours.save_pretrained(tmp_path / "re")
    reloaded = DFlashDrafter.from_pretrained(tmp_path / "re")
    for k, v in ours.state_dict().items():
        assert torch.equal(v, reloaded.state_dict()[k]), k


def _inputs(cfg, gen, ctx_len, q_len, start):
    embeds = torch.randn(1, q_len, cfg.hidden_size, generator=gen)
    feats = torch.randn(1, ctx_len, cfg.fc_in_features, generator=gen)
    pos = torch.arange(start - ctx_len, start + q_len)[None]
    return embeds, feats, pos


@torch.no_grad()
def test_single_call_equals_reference(drafter_pair):
    ours, ref = drafter_pair
    gen = torch.Generator().manual_seed(0)
    embeds, feats, pos = _inputs(ours.config, gen, ctx_len=7, q_len=4, start=7)
    got, presents = ours(embeds, feats, pos)
    want = ref(position_ids=pos, noise_embedding=embeds, target_hidden=feats)
    assert got.shape == (1, 4, ours.config.hidden_size)
    assert (got - want).abs().max().item() < TOL
    assert len(presents) == 2 and presents[0][0].shape == (1, 2, 7, 16)


@torch.no_grad()
def test_rounds_with_cache_equal_reference(drafter_pair):
    from transformers import DynamicCache

    ours, ref = drafter_pair
    gen = torch.Generator().manual_seed(1)
    cache = DynamicCache(config=ref.config)
    past = None
    start = 0
    for ctx_len in (6, 3, 1, 4):  # prompt, then a+1 committed tokens per round
        start += ctx_len
        embeds, feats, pos = _inputs(ours.config, gen, ctx_len, q_len=4, start=start)
        got, past = ours(embeds, feats, pos, past_key_values=past)
        want = ref(position_ids=pos, noise_embedding=embeds, target_hidden=feats,
                   past_key_values=cache, use_cache=True)
        cache.crop(start)  # the reference drops the block K/V after each step
        assert (got - want).abs().max().item() < TOL, ctx_len
        assert past[0][0].shape[2] == start  # only committed context is kept
        ref_k = cache.layers[1].keys
        assert (past[1][0] - ref_k).abs().max().item() < TOL


@torch.no_grad()
def test_explicit_mask_equals_reference(drafter_pair):
    """Training layout: P=0, C=sequence, Q=two blocks, each block sees a context prefix and itself."""
    ours, ref = drafter_pair
    gen = torch.Generator().manual_seed(2)
    seq, bs = 10, 4
    feats = torch.randn(1, seq, ours.config.fc_in_features, generator=gen)
    embeds = torch.randn(1, 2 * bs, ours.config.hidden_size, generator=gen)
    anchors = [3, 7]
    pos = torch.cat([torch.arange(seq), torch.arange(3, 3 + bs), torch.arange(7, 7 + bs)])[None]
    mask = torch.zeros(1, 1, 2 * bs, seq + 2 * bs, dtype=torch.bool)
    for b, p in enumerate(anchors):
        rows = slice(b * bs, (b + 1) * bs)
        mask[0, 0, rows, :p] = True
        mask[0, 0, rows, seq + b * bs: seq + (b + 1) * bs] = True
    got, _ = ours(embeds, feats, pos, attention_mask=mask)
    want = ref(position_ids=pos, noise_embedding=embeds, target_hidden=feats, attention_mask=mask)
    assert (got - want).abs().max().item() < TOL
    # the mask matters: without it the answer differs
    unmasked, _ = ours(embeds, feats, pos)
    assert (unmasked - got).abs().max().item() > 1e-3
