"""Drafter training on a tiny random target: loss falls, resume is exact, checkpoint loads."""
import json

import numpy as np
import pytest
import torch

from ovdflash_export.drafter import VAL_SEED_KEY, DFlashDrafter
from ovdflash_export.tiny import make_tiny_target
from ovdflash_export.training.batch import chain_labels, split_train_val
from ovdflash_export.training.config import TrainConfig
from ovdflash_export.training.data import ShardWriter, load_sequences
from ovdflash_export.training.loss import slot_weights, soft_ce
from ovdflash_export.training.target_features import FrozenTarget
from ovdflash_export.training.train import STATE_NAME, most_used_ids, train

VOCAB = 512


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = make_tiny_target("llama", root / "target", vocab_size=VOCAB, num_hidden_layers=4)
    # learnable "responses": a fixed successor map over 24 tokens (x_{i+1} = succ[x_i]), so slot k of a
    # block is a function of the anchor token alone; prompts are random tokens
    rng = np.random.default_rng(0)
    alphabet = rng.permutation(np.arange(3, 400))[:24]
    succ = {int(a): int(b) for a, b in zip(alphabet, np.roll(alphabet, -1))}
    w = ShardWriter(root / "data")
    for i in range(48):
        prompt = rng.integers(3, 400, size=int(rng.integers(4, 9))).tolist()
        resp = [int(rng.choice(alphabet))]
        while len(resp) < int(rng.integers(24, 40)):
            resp.append(succ[resp[-1]])
        w.append(prompt + resp, len(prompt), ["code", "math", "chat"][i % 3], "greedy", f"p{i}", 0, True)
    return target, root / "data", root


def _cfg(target, data, out, **kw):
    base = dict(target=str(target), data_dirs=[str(data)], out_dir=str(out), num_layers=1, block_size=4,
                target_layer_ids=[0, 2], mask_token_id=VOCAB - 1, anchors_per_seq=8, batch_seqs=4, max_len=64,
                lr=3e-3, warmup_steps=5, max_steps=60, val_every=1000, save_every_s=1e9, seed=3,
                num_negatives=16, device="cpu", val_fraction=0.15, relabel=False)
    base.update(kw)
    return TrainConfig(**base)


def _losses(out):
    return [json.loads(l)["loss"] for l in open(out / "train_log.jsonl") if '"loss"' in l]


def test_features_are_hidden_states_of_the_layers(tiny_setup):
    from transformers import AutoModelForCausalLM

    target, data, _ = tiny_setup
    seq = load_sequences(data)[0]
    ids = torch.from_numpy(seq.tokens)
    ft = FrozenTarget(target, [0, 2], "cpu")
    full = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    with torch.no_grad():
        hs = full(ids[None], output_hidden_states=True).hidden_states
    want = torch.cat([hs[1][0], hs[3][0]], dim=-1)  # id k = hidden_states[k+1]
    feats, pred = ft.features(ids)
    assert pred is None
    torch.testing.assert_close(feats, want, atol=1e-5, rtol=1e-5)
    # with predictions: the same features plus the full model's argmax at every position
    feats2, pred2 = FrozenTarget(target, [0, 2], "cpu", predictions=True).features(ids)
    torch.testing.assert_close(feats2, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        assert torch.equal(pred2, full(ids[None]).logits[0].argmax(-1))


def test_batched_target_features_equal_one_sequence_forwards(tiny_setup):
    target, data, _ = tiny_setup
    seqs = [torch.from_numpy(s.tokens) for s in load_sequences(data)[:5]]
    assert len({t.numel() for t in seqs}) > 1   # padding is exercised
    ft = FrozenTarget(target, [0, 2], "cpu", predictions=True)
    for (feats, pred, (ids, logp)), t in zip(ft.features_batch(seqs, topk=6), seqs):
        want_feats, want_pred, (want_ids, want_logp) = ft.features(t, topk=6)
        torch.testing.assert_close(feats, want_feats, atol=1e-5, rtol=1e-5)
        assert torch.equal(pred, want_pred) and torch.equal(ids, want_ids)
        torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=1e-5)
    no_preds = FrozenTarget(target, [0, 2], "cpu").features_batch(seqs[:2])
    assert [p for _, p in no_preds] == [None, None]
    torch.testing.assert_close(no_preds[1][0], ft.features(seqs[1])[0], atol=1e-5, rtol=1e-5)


def test_training_with_batched_target_forwards_matches_one_at_a_time(tiny_setup):
    target, data, root = tiny_setup
    losses = {}
    for tb in (1, 3):
        out = root / f"tb{tb}"
        train(_cfg(target, data, out, max_steps=12, relabel=True, kd_weight=0.5, kd_topk=4, target_batch=tb),
              log=lambda s: None)
        losses[tb] = _losses(out)
    assert len(losses[1]) >= 1
    np.testing.assert_allclose(losses[3], losses[1], rtol=1e-4)


def test_chain_labels_against_brute_force():
    rng = np.random.default_rng(1)
    for trial in range(50):
        L, B = int(rng.integers(6, 30)), int(rng.integers(2, 9))
        pred = torch.from_numpy(rng.integers(0, 4, size=L))
        tokens = torch.from_numpy(rng.integers(0, 4, size=L))  # small alphabet: many agreements
        anchors = torch.arange(0, L - 1)
        got = chain_labels(tokens, pred, anchors, B)
        for n, p in enumerate(anchors.tolist()):
            for k in range(1, B):
                ok = p + k < L and all(tokens[p + j] == pred[p + j - 1] for j in range(1, k))
                assert got[n, k - 1] == (pred[p + k - 1] if ok else -100), (trial, p, k)


def test_relabelled_greedy_response_keeps_its_tokens(tiny_setup):
    """On the target's own greedy continuation the chain labels are the stored tokens; one foreign
    token cuts every block that spans it right after that token."""
    from transformers import AutoModelForCausalLM

    target, _, _ = tiny_setup
    full = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    prompt = torch.tensor([[5, 17, 99, 4]])
    with torch.no_grad():
        seq = full.generate(prompt, max_new_tokens=20, do_sample=False)[0]
    _, pred = FrozenTarget(target, [0, 2], "cpu", predictions=True).features(seq)
    anchors = torch.arange(4, len(seq) - 1)
    lab = chain_labels(seq, pred, anchors, 4)
    for n, p in enumerate(anchors.tolist()):
        for k in range(1, 4):
            assert lab[n, k - 1] == (seq[p + k] if p + k < len(seq) else -100)
    bad = seq.clone()
    bad[10] = (bad[10] + 1) % VOCAB
    _, pred_bad = FrozenTarget(target, [0, 2], "cpu", predictions=True).features(bad)
    lab = chain_labels(bad, pred_bad, torch.tensor([8]), 4)  # slots predict 9, 10, 11
    assert lab[0, 0] == seq[9] and lab[0, 1] == seq[10]      # the greedy tokens, not the foreign one
    assert lab[0, 2] == -100                                   # its prefix left the greedy chain


def test_warm_start_loads_the_checkpoint_and_checks_geometry(tiny_setup):
    target, data, root = tiny_setup
    src = root / "run_src"
    train(_cfg(target, data, src, max_steps=30), log=lambda s: None)
    warm = root / "run_warm"
    train(_cfg(target, data, warm, max_steps=0, init_from=str(src)), log=lambda s: None)
    a, b = DFlashDrafter.from_pretrained(src).state_dict(), DFlashDrafter.from_pretrained(warm).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)
    fresh = root / "run_fresh"
    train(_cfg(target, data, fresh, max_steps=1), log=lambda s: None)
    warm1 = root / "run_warm1"
    train(_cfg(target, data, warm1, max_steps=1, init_from=str(src)), log=lambda s: None)
    assert _losses(warm1)[0] < 0.9 * _losses(fresh)[0]  # starts where the source run ended, not from scratch
    with pytest.raises(ValueError, match="geometry"):
        train(_cfg(target, data, root / "run_bad", max_steps=1, block_size=3, init_from=str(src)), log=lambda s: None)


def test_a_warm_start_with_another_seed_validates_on_its_parents_prompts(tiny_setup, monkeypatch):
    import ovdflash_export.training.train as train_mod

    target, data, root = tiny_setup
    split_seeds = []
    real_split = train_mod.split_train_val
    monkeypatch.setattr(train_mod, "split_train_val",
                        lambda seqs, fraction, seed: split_seeds.append(seed) or real_split(seqs, fraction, seed))
    parent = root / "run_val_parent"
    train(_cfg(target, data, parent, max_steps=1, seed=3), log=lambda s: None)
    assert json.loads((parent / "config.json").read_text())[VAL_SEED_KEY] == 3
    seqs = load_sequences(data)
    # the two seeds hold back different prompts here, so inheriting the split is what the test sees
    assert real_split(seqs, 0.15, 3)[1] != real_split(seqs, 0.15, 4)[1]
    split_seeds.clear()
    child = root / "run_val_child"
    train(_cfg(target, data, child, max_steps=1, seed=4, init_from=str(parent)), log=lambda s: None)
    assert split_seeds and set(split_seeds) == {3}
    assert json.loads((child / "config.json").read_text())[VAL_SEED_KEY] == 3
    split_seeds.clear()
    train(_cfg(target, data, root / "run_val_own", max_steps=1, seed=4, val_seed=5, init_from=str(parent)),
          log=lambda s: None)
    assert set(split_seeds) == {5}
    # a parent that recorded no split: the run says so and falls back to its own seed
    legacy = root / "run_val_legacy"
    legacy.mkdir()
    for name in ("model.safetensors",):
        (legacy / name).write_bytes((parent / name).read_bytes())
    cfg = json.loads((parent / "config.json").read_text())
    del cfg[VAL_SEED_KEY]
    (legacy / "config.json").write_text(json.dumps(cfg))
    lines = []
    split_seeds.clear()
    train(_cfg(target, data, root / "run_val_from_legacy", max_steps=1, seed=4, init_from=str(legacy)),
          log=lines.append)
    assert set(split_seeds) == {4}
    assert any("records no validation split" in l for l in lines)


def test_a_warm_start_may_grow_the_layer_count_without_changing_the_drafts(tiny_setup):
    target, data, root = tiny_setup
    src = root / "run_src1"
    train(_cfg(target, data, src, max_steps=20), log=lambda s: None)
    grown = root / "run_grown"
    lines = []
    train(_cfg(target, data, grown, max_steps=0, num_layers=3, init_from=str(src)), log=lines.append)
    assert any("grown from 1 to 3 layers" in l for l in lines)
    small, big = DFlashDrafter.from_pretrained(src).eval(), DFlashDrafter.from_pretrained(grown).eval()
    assert len(big.layers) == 3
    gen = torch.Generator().manual_seed(0)
    h = small.config.hidden_size
    block = torch.randn(1, 4, h, generator=gen)
    ctx = torch.randn(1, 6, small.config.fc_in_features, generator=gen)
    pos = torch.arange(10)[None]
    with torch.no_grad():
        out_small, _ = small(block, ctx, pos)
        out_big, _ = big(block, ctx, pos)
    torch.testing.assert_close(out_big, out_small, atol=1e-5, rtol=1e-5)  # added layers start as no-ops
    warm = root / "run_grown_trained"
    train(_cfg(target, data, warm, max_steps=5, num_layers=2, init_from=str(src)), log=lambda s: None)
    moved = DFlashDrafter.from_pretrained(warm).state_dict()["layers.1.mlp.down_proj.weight"]
    assert moved.abs().max() > 0  # and training does move them
    with pytest.raises(ValueError, match="only the layer count may grow"):
        train(_cfg(target, data, root / "run_shrink", max_steps=0, num_layers=1, init_from=str(grown)),
              log=lambda s: None)


def test_loss_falls_and_checkpoint_loads(tiny_setup):
    target, data, root = tiny_setup
    out = root / "run_full"
    train(_cfg(target, data, out), log=lambda s: None)
    losses = _losses(out)
    assert len(losses) == 60
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:5])
    model = DFlashDrafter.from_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dflash_config"] == {"target_layer_ids": [0, 2], "mask_token_id": VOCAB - 1}
    assert cfg["block_size"] == 4
    names = set(model.state_dict())
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)
    # the CE's vocabulary ships as draft_vocab.json and covers every trained response token
    vocab = set(json.loads((out / "draft_vocab.json").read_text()))
    state = torch.load(out / STATE_NAME, weights_only=False)
    assert vocab == set(state["vocab_ids"].tolist())
    assert vocab == {int(t) for s in load_sequences(data) for t in s.tokens[s.prompt_len:]}  # the 24-token alphabet
    final = json.loads(open(out / "train_log.jsonl").read().strip().splitlines()[-1])["final"]
    assert final["val_tau"] > 1.0  # at least some drafted tokens would be accepted


def test_folded_checkpoint_takes_raw_features(tiny_setup):
    """The saved drafter on raw features equals the trained one on scaled features."""
    from ovdflash_export.training.batch import build_batch
    from ovdflash_export.training.target_features import FeatureStore

    target, data, root = tiny_setup
    out = root / "run_fold"
    train(_cfg(target, data, out, max_steps=8), log=lambda s: None)
    state = torch.load(out / STATE_NAME, weights_only=False)
    saved = DFlashDrafter.from_pretrained(out)
    trained = DFlashDrafter.from_pretrained(out)
    trained.load_state_dict(state["model"])
    ft = FrozenTarget(target, [0, 2], "cpu")
    seqs = load_sequences(data)
    kw = dict(block_size=4, n_anchors=4, max_len=64, mask_token_id=VOCAB - 1, device="cpu")
    raw = build_batch(seqs, [0, 1], FeatureStore(ft, 0), ft.embed, np.random.default_rng(0), feat_scale=None, **kw)
    scaled = build_batch(seqs, [0, 1], FeatureStore(ft, 0), ft.embed, np.random.default_rng(0),
                         feat_scale=state["inv_scale"], **kw)
    assert not torch.allclose(state["inv_scale"], torch.ones_like(state["inv_scale"]))
    with torch.no_grad():
        a, _ = saved(raw["block_embeds"], raw["target_hidden"], raw["position_ids"], attention_mask=raw["mask"])
        b, _ = trained(scaled["block_embeds"], scaled["target_hidden"], scaled["position_ids"],
                       attention_mask=scaled["mask"])
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_resume_reproduces_uninterrupted_run(tiny_setup):
    target, data, root = tiny_setup
    full = root / "run_ref"
    train(_cfg(target, data, full, max_steps=20), log=lambda s: None)
    part = root / "run_resume"
    train(_cfg(target, data, part, max_steps=20, stop_after_steps=12), log=lambda s: None)  # "killed"
    # resume: same out dir; the state file carries step 12, optimizer and schedule
    train(_cfg(target, data, part, max_steps=20), log=lambda s: None)
    ref, got = _losses(full), _losses(part)
    assert len(got) == 20
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_a_short_training_block_is_what_a_short_drafting_pass_computes(tiny_setup):
    """block_len / short_blocks cut blocks as the runtime does when it verifies fewer drafts."""
    from ovdflash_export.training.batch import build_batch
    from ovdflash_export.training.loss import blocks_forward
    from ovdflash_export.training.target_features import FeatureStore

    target, data, root = tiny_setup
    ft = FrozenTarget(target, [0, 2], "cpu")
    seqs = load_sequences(data)
    src = root / "run_short_src"
    train(_cfg(target, data, src, max_steps=10), log=lambda s: None)
    drafter = DFlashDrafter.from_pretrained(src).eval()
    kw = dict(block_size=4, n_anchors=3, max_len=64, mask_token_id=VOCAB - 1, device="cpu", feat_scale=None)
    full = build_batch(seqs, [0, 1], FeatureStore(ft, 0), ft.embed, np.random.default_rng(0), **kw)
    cut = build_batch(seqs, [0, 1], FeatureStore(ft, 0), ft.embed, np.random.default_rng(0), block_len=2, **kw)
    assert (cut["labels"][..., 1:] == -100).all() and (cut["labels"][..., 0] == full["labels"][..., 0]).all()
    with torch.no_grad():
        h_full, h_cut = blocks_forward(drafter, full), blocks_forward(drafter, cut)
        # one block by hand: context strictly before the anchor, then [anchor, mask] alone
        seq = torch.from_numpy(seqs[0].tokens[:64])
        p = int(full["position_ids"][0, full["target_hidden"].shape[1]])  # first block's anchor position
        feats, _ = FrozenTarget(target, [0, 2], "cpu").features(seq)
        block = ft.embed(torch.tensor([[int(seq[p]), VOCAB - 1]])).float()
        alone, _ = drafter(block, feats[None, :p], torch.arange(p + 2)[None])
    torch.testing.assert_close(h_cut[0, 0, 0], alone[0, 1], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(h_full[0, 0, 0], alone[0, 1], atol=1e-3)  # the full block drafts slot 1 otherwise
    mixed = build_batch(seqs, list(range(8)), FeatureStore(ft, 0), ft.embed, np.random.default_rng(1),
                        short_blocks=0.5, **kw)
    labelled = (mixed["labels"] >= 0).sum(-1)
    assert {1, 2} <= set(labelled[labelled > 0].tolist())  # some blocks cut to 2 or 3 tokens


def test_pick_batch_walks_new_sequences_in_order():
    from ovdflash_export.training.batch import pick_batch

    train_idx = list(range(100, 140))
    seen = set()
    for step in range(12):
        got = pick_batch(np.random.default_rng([0, step]), train_idx, step, 8, 2)
        assert len(got) == len(set(got)) == 8
        fresh = got[:8] if step == 0 else got[:2]
        assert fresh == [train_idx[i] for i in range(0 if step == 0 else 8 + 2 * (step - 1), 8 + 2 * step)][:len(fresh)]
        assert all(g in seen for g in got[len(fresh):])  # the rest only re-reads cached sequences
        seen.update(got)
        assert got == pick_batch(np.random.default_rng([0, step]), train_idx, step, 8, 2)


def test_interleave_sources_deals_round_robin():
    from ovdflash_export.training.batch import interleave_sources

    source = [0] * 10 + [1] * 3 + [2] * 5
    idxs = list(range(18))
    got = interleave_sources(idxs, source, seed=0)
    assert sorted(got) == idxs
    assert [source[i] for i in got[:9]] == [0, 1, 2] * 3            # equal rates while all last
    assert [source[i] for i in got[9:13]] == [0, 2, 0, 2]
    assert got == interleave_sources(idxs, source, seed=0) != interleave_sources(idxs, source, seed=1)


def test_soft_ce_against_a_hand_computed_cross_entropy():
    """Renormalised over the scored ids, slot-weighted, slots without a distribution ignored."""
    torch.manual_seed(0)
    V, K = 6, 3
    logits = torch.randn(1, 2, 3, V)                     # [b, N, B-1, V] over scored ids 0..5
    vocab = torch.tensor([10, 11, 12, 13, 14, 15])       # full-vocab id of each scored column
    remap = torch.full((20,), -100, dtype=torch.long)
    remap[vocab] = torch.arange(V)
    ids = torch.tensor([12, 17, 10])                     # 17 is not scored: dropped, the rest renormalised
    soft_ids = torch.full((1, 2, 3, K), -100, dtype=torch.long)
    soft_logp = torch.zeros(1, 2, 3, K)
    soft_ids[0, 0, 0], soft_logp[0, 0, 0] = ids, torch.log(torch.tensor([0.5, 0.3, 0.1]))
    soft_ids[0, 1, 2], soft_logp[0, 1, 2] = ids, torch.log(torch.tensor([0.2, 0.2, 0.2]))
    w = slot_weights(4, 2.0, "cpu")
    loss, n = soft_ce(logits, soft_ids, soft_logp, w, remap)
    assert n == 2
    lp = torch.log_softmax(logits, -1)
    ce_a = -(0.5 / 0.6 * lp[0, 0, 0, 2] + 0.1 / 0.6 * lp[0, 0, 0, 0])
    ce_b = -(0.5 * lp[0, 1, 2, 2] + 0.5 * lp[0, 1, 2, 0])
    want = (w[0] * ce_a + w[2] * ce_b) / (w[0] + w[2])
    assert torch.allclose(loss, want, atol=1e-6)
    soft_ids[:] = -100
    assert soft_ce(logits, soft_ids, soft_logp, w, remap)[1] == 0


def test_most_used_ids_ranks_by_count_then_id():
    responses = [np.array([5, 5, 5, 9, 2]), np.array([9, 9, 2, 7]), np.array([7, 40])]
    # counts: 5:3, 9:3, 2:2, 7:2, 40:1
    assert most_used_ids(responses, 2).tolist() == [5, 9]
    assert most_used_ids(responses, 3).tolist() == [2, 5, 9]           # 2 beats 7 on the tie
    assert most_used_ids(responses, 10).tolist() == [2, 5, 7, 9, 40]   # fewer ids than asked
    assert most_used_ids(responses, 3, allowed=torch.tensor([2, 7, 40])).tolist() == [2, 7, 40]


def test_draft_vocab_size_keeps_the_most_used_ids_and_the_full_ce(tiny_setup):
    target, data, root = tiny_setup
    out = root / "run_small_vocab"
    cfg = _cfg(target, data, out, max_steps=2, draft_vocab_size=10)
    train(cfg, log=lambda s: None)
    vocab = json.loads((out / "draft_vocab.json").read_text())
    state = torch.load(out / STATE_NAME, weights_only=False)
    assert len(state["vocab_ids"]) == 24  # the CE still trains over the whole alphabet
    seqs = load_sequences(data)
    train_idx, _ = split_train_val(seqs, cfg.val_fraction, cfg.seed)
    counts = np.zeros(VOCAB, dtype=np.int64)
    for i in train_idx:
        np.add.at(counts, seqs[i].tokens[seqs[i].prompt_len:], 1)
    ranked = sorted(state["vocab_ids"].tolist(), key=lambda t: (-counts[t], t))
    assert vocab == sorted(ranked[:10])


def test_ce_vocab_size_scores_only_the_most_used_ids_and_ships_them(tiny_setup, monkeypatch):
    import ovdflash_export.training.train as train_mod

    target, data, root = tiny_setup
    out = root / "run_ce_vocab"
    scored = []
    real_ce = train_mod.weighted_ce
    monkeypatch.setattr(train_mod, "weighted_ce",
                        lambda h, labels, w, weights, ids=None, remap=None: scored.append(len(ids)) or
                        real_ce(h, labels, w, weights, ids, remap))
    cfg = _cfg(target, data, out, max_steps=3, ce_vocab_size=10)
    train(cfg, log=lambda s: None)
    seqs = load_sequences(data)
    train_idx, _ = split_train_val(seqs, cfg.val_fraction, cfg.seed)
    counts = np.zeros(VOCAB, dtype=np.int64)
    for i in train_idx:
        np.add.at(counts, seqs[i].tokens[seqs[i].prompt_len:], 1)
    top10 = sorted(sorted(np.nonzero(counts)[0].tolist(), key=lambda t: (-counts[t], t))[:10])
    state = torch.load(out / STATE_NAME, weights_only=False)
    assert state["vocab_ids"].tolist() == top10 == json.loads((out / "draft_vocab.json").read_text())
    assert scored[:3] == [10, 10, 10]          # no negatives on top of the subset
    assert all(np.isfinite(_losses(out)))      # labels outside the subset are skipped, not NaN
    with pytest.raises(ValueError, match="vocab_subset"):
        train(_cfg(target, data, root / "run_ce_bad", max_steps=1, ce_vocab_size=10, vocab_subset=False),
              log=lambda s: None)


def test_distillation_with_no_top_k_is_refused(tiny_setup, tmp_path):
    target, data, _ = tiny_setup
    with pytest.raises(ValueError, match="kd_topk 0"):
        train(_cfg(target, data, tmp_path / "kd", max_steps=1, kd_weight=0.5, kd_topk=0), log=lambda s: None)
    assert not (tmp_path / "kd").exists()  # refused before anything is written


def test_a_followup_is_validated_or_trained_with_its_root_prompt():
    from ovdflash_export.training.data import Sequence
    from ovdflash_export.training.prompts import followup_id, root_prompt_id

    assert root_prompt_id("fu-fu-HumanEval-134-sample1284770-greedy529362") == "HumanEval-134"
    assert root_prompt_id(followup_id(followup_id("HumanEval-134", "sample", 7), "greedy", 9)) == "HumanEval-134"
    assert root_prompt_id("selfchat-topic-87") == "selfchat-topic-87"
    assert root_prompt_id(followup_id(followup_id("code-3", "greedy", 1, variant=2), "greedy", 4)) == "code-3"
    roots = [f"selfcode-func-{i}" for i in range(40)]
    ids = roots + [f"fu-{r}-greedy{10 * i}" for i, r in enumerate(roots)] + [f"fu-fu-{r}-sample7-greedy{i}" for i, r in enumerate(roots)]
    seqs = [Sequence(np.arange(4), 2, "code", "greedy", p) for p in ids]
    train_idx, val_idx = split_train_val(seqs, 0.25, seed=0)
    assert val_idx and train_idx
    held = {root_prompt_id(seqs[i].prompt_id) for i in val_idx}
    assert not held & {root_prompt_id(seqs[i].prompt_id) for i in train_idx}
    assert len(val_idx) == 3 * len(held)  # every held-back root takes its two follow-ups along
    # adding follow-ups moves no first-turn prompt to the other side
    assert split_train_val(seqs[:40], 0.25, seed=0)[1] == [i for i in val_idx if i < 40]


def test_bf16_autocast_training_learns_and_keeps_f32_weights(tiny_setup):
    target, data, root = tiny_setup
    out = root / "run_bf16"
    train(_cfg(target, data, out, autocast="bf16"), log=lambda s: None)
    losses = _losses(out)
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:5])
    assert {v.dtype for v in DFlashDrafter.from_pretrained(out).state_dict().values()} == {torch.float32}
    with pytest.raises(ValueError, match="autocast 'fp8'"):
        train(_cfg(target, data, root / "run_fp8", autocast="fp8", max_steps=1), log=lambda s: None)
