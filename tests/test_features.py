"""Precomputed OpenVINO target features: equal to the torch target's, resumable, used by training."""
import json

import numpy as np
import pytest
import torch

from ovdflash import STRICT_F32
from ovdflash_export.training.data import ShardWriter, load_sequences
from ovdflash_export.training.features import FEATS, INDEX, TOPK_IDS, TOPK_LOGP, FeatureFile, fill_topk, precompute_features
from ovdflash_export.training.config import TrainConfig
from ovdflash_export.training.target_features import FeatureStore, FrozenTarget, PrecomputedStore
from ovdflash_export.training.train import train


def _write(data_dir, n, seed, vocab=512):
    rng = np.random.default_rng(seed)
    w = ShardWriter(data_dir)
    for i in range(n):
        prompt = rng.integers(3, vocab - 1, size=int(rng.integers(3, 8))).tolist()
        resp = rng.integers(3, vocab - 1, size=int(rng.integers(10, 30))).tolist()
        w.append(prompt + resp, len(prompt), ["code", "math", "chat"][i % 3], "greedy", f"s{seed}_{i}", 0, True)


@pytest.fixture(scope="module")
def pair_and_data(export_tiny_pair, tmp_path_factory):
    model_dir = export_tiny_pair()
    root = tmp_path_factory.mktemp("features")
    _write(root / "data", 6, seed=0)
    return model_dir, root


def test_features_and_predictions_equal_the_torch_target(pair_and_data):
    model_dir, root = pair_and_data
    out = root / "feat_eq"
    summary = precompute_features(model_dir, root / "data", out, max_len=20, config=STRICT_F32, log=lambda s: None)
    assert summary["sequences"] == 6
    manifest = json.loads((model_dir / "manifest.json").read_text())
    torch_target = FrozenTarget(manifest["target"]["source"], manifest["target_layer_ids"], "cpu", predictions=True)
    ff = FeatureFile(out)
    for seq in load_sequences(root / "data"):
        ids = torch.from_numpy(seq.tokens[:20])  # max_len truncation, as training truncates
        feats, preds = ff.lookup(seq.offset, ids.numel())
        want_f, want_p = torch_target.features(ids)
        np.testing.assert_allclose(np.asarray(feats, dtype=np.float32), want_f.numpy(), atol=2e-2, rtol=1e-2)
        first = seq.prompt_len - 1  # predictions are stored from the last prompt position on
        assert np.array_equal(np.asarray(preds[first:], dtype=np.int64), want_p[first:].numpy())
        assert not np.asarray(preds[:first]).any()
        assert ff.lookup(seq.offset, ids.numel() + 1) is None  # a different truncation is not a hit


def test_resume_appends_only_new_sequences_and_cuts_a_torn_tail(pair_and_data, tmp_path):
    model_dir, root = pair_and_data
    data = tmp_path / "data"
    _write(data, 3, seed=1)
    out = tmp_path / "feat"
    assert precompute_features(model_dir, data, out, config=STRICT_F32, log=lambda s: None)["new_tokens"] > 0
    first_rows = FeatureFile(out).rows
    assert precompute_features(model_dir, data, out, config=STRICT_F32, log=lambda s: None)["new_tokens"] == 0
    with open(out / FEATS, "ab") as f:  # a writer killed after its arrays, before its index row
        f.write(b"\x01" * 1000)
    _write(data, 2, seed=2)  # the data directory grew
    summary = precompute_features(model_dir, data, out, config=STRICT_F32, log=lambda s: None)
    ff = FeatureFile(out)
    assert summary["sequences"] == 5 and len(ff.rows) == 5
    assert all(ff.rows[k] == v for k, v in first_rows.items())
    assert (out / FEATS).stat().st_size == ff.feats.shape[0] * ff.width * 2
    rows = [json.loads(l) for l in open(out / INDEX)]
    assert [r["row"] for r in rows] == sorted(r["row"] for r in rows)
    with pytest.raises(ValueError, match="max_len"):
        precompute_features(model_dir, data, out, max_len=32, config=STRICT_F32, log=lambda s: None)
    meta = json.loads((out / "meta.json").read_text())  # as if made under bf16 (not offered by every CPU)
    meta["compile"]["INFERENCE_PRECISION_HINT"] = "bf16"
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="inference precision"):  # one directory, one precision
        precompute_features(model_dir, data, out, config=STRICT_F32, log=lambda s: None)


def test_precomputed_store_falls_back_for_unknown_sequences(pair_and_data, tmp_path):
    model_dir, root = pair_and_data
    out = tmp_path / "data"
    precompute_features(model_dir, root / "data", out, config=STRICT_F32, log=lambda s: None)
    manifest = json.loads((model_dir / "manifest.json").read_text())
    target = FrozenTarget(manifest["target"]["source"], manifest["target_layer_ids"], "cpu", predictions=True)
    _write(tmp_path / "other", 2, seed=5)
    seqs = load_sequences(root / "data") + load_sequences(tmp_path / "other")
    store = PrecomputedStore({str(root / "data"): str(out)}, FeatureStore(target, 1.0, topk=4))
    store.bind(seqs)
    for i, s in enumerate(seqs):
        f, p = store.get(i, torch.from_numpy(s.tokens))
        assert f.dtype == torch.float32 and f.shape[0] == len(s.tokens) and p is not None
        # stored without top-k: no soft labels; unknown: the torch target's
        assert (store.soft(i, len(s.tokens)) is None) == (i < 6)
    assert store.hits == 6
    assert store.computed_tokens == sum(len(s.tokens) for s in seqs[6:])  # only the unknown ones ran torch


def test_training_on_precomputed_features_matches_torch_features(pair_and_data, tmp_path):
    """Same run twice: torch features vs OpenVINO ones (strict f32): the losses agree closely, and
    the precomputed run never runs the torch target."""
    model_dir, root = pair_and_data
    precompute_features(model_dir, root / "data", tmp_path / "feats" / "data", max_len=64, config=STRICT_F32,
                        log=lambda s: None)
    manifest = json.loads((model_dir / "manifest.json").read_text())
    logs = {}
    for name, feats in (("torch", None), ("ov", str(tmp_path / "feats"))):
        out = tmp_path / name
        cfg = TrainConfig(target=manifest["target"]["source"], data_dirs=[str(root / "data")], out_dir=str(out),
                          num_layers=1, block_size=4, target_layer_ids=manifest["target_layer_ids"],
                          mask_token_id=511, anchors_per_seq=4, batch_seqs=2, max_len=64, lr=1e-3, warmup_steps=2,
                          max_steps=6, val_every=1000, save_every_s=1e9, seed=0, num_negatives=8, device="cpu",
                          val_fraction=0.0, features_root=feats)
        lines = []
        train(cfg, log=lines.append)
        logs[name] = [json.loads(l) for l in open(out / "train_log.jsonl") if '"loss"' in l]
    a = [r["loss"] for r in logs["torch"]]
    b = [r["loss"] for r in logs["ov"]]
    assert len(a) == len(b) == 6
    np.testing.assert_allclose(a, b, rtol=2e-3)
    assert logs["ov"][-1]["target_tokens"] == 0 and logs["torch"][-1]["target_tokens"] > 0


def test_top_k_log_probs_are_the_targets_most_likely_tokens(pair_and_data, tmp_path):
    """A directory made without top-k and resumed with it: the old sequences are flagged as having
    none, the new ones carry the torch target's K most likely next tokens and log-probabilities."""
    model_dir, root = pair_and_data
    data = tmp_path / "data"
    _write(data, 2, seed=3)
    out = tmp_path / "feat"
    precompute_features(model_dir, data, out, config=STRICT_F32, log=lambda s: None)
    _write(data, 2, seed=4)
    precompute_features(model_dir, data, out, config=STRICT_F32, log=lambda s: None, topk=8)
    with pytest.raises(ValueError, match="topk"):
        precompute_features(model_dir, data, out, config=STRICT_F32, log=lambda s: None, topk=4)
    manifest = json.loads((model_dir / "manifest.json").read_text())
    target = FrozenTarget(manifest["target"]["source"], manifest["target_layer_ids"], "cpu", predictions=True)
    ff = FeatureFile(out)
    seqs = load_sequences(data)
    assert [ff.lookup_topk(s.offset, len(s.tokens)) is None for s in seqs] == [True, True, False, False]
    for s in seqs[2:]:
        ids, logp = ff.lookup_topk(s.offset, len(s.tokens))
        with torch.no_grad():
            final = target.base(input_ids=torch.from_numpy(s.tokens)[None], use_cache=False).last_hidden_state[0]
            want = torch.log_softmax(final @ target.lm_head_weight.T, -1)
        first = s.prompt_len - 1
        top = torch.topk(want[first:], 8)
        assert np.array_equal(np.asarray(ids[first:], dtype=np.int64)[:, 0], top.indices[:, 0].numpy())
        np.testing.assert_allclose(np.asarray(logp[first:], dtype=np.float32), top.values.numpy(), atol=2e-2)
        got = np.take_along_axis(want[first:].numpy(), np.asarray(ids[first:], dtype=np.int64), -1)
        np.testing.assert_allclose(got, top.values.numpy(), atol=1e-3)  # the same set (ties aside)
        assert not np.asarray(ids[:first]).any() and not np.asarray(logp[:first]).any()


@pytest.mark.parametrize("precomputed", [True, False])
def test_distillation_on_top1_equals_the_greedy_loss(pair_and_data, tmp_path, precomputed):
    """With K = 1 the target's distribution is one-hot on its greedy pick, which is the label: the
    distillation term must equal the hard CE, step for step; with K = 8 it must differ. Soft
    labels from precomputed features, or (precomputed False) from the torch target's forward."""
    model_dir, root = pair_and_data
    manifest = json.loads((model_dir / "manifest.json").read_text())
    logs = {}
    for k in (1, 8):
        if precomputed:
            precompute_features(model_dir, root / "data", tmp_path / f"f{k}" / "data", max_len=64,
                                config=STRICT_F32, log=lambda s: None, topk=k)
        out = tmp_path / f"kd{k}"
        cfg = TrainConfig(target=manifest["target"]["source"], data_dirs=[str(root / "data")], out_dir=str(out),
                          num_layers=1, block_size=4, target_layer_ids=manifest["target_layer_ids"],
                          mask_token_id=511, anchors_per_seq=4, batch_seqs=2, max_len=64, lr=1e-3, warmup_steps=2,
                          max_steps=4, val_every=1000, save_every_s=1e9, seed=0, num_negatives=8, device="cpu",
                          val_fraction=0.0, features_root=str(tmp_path / f"f{k}") if precomputed else None,
                          kd_weight=1.0, kd_topk=k)
        train(cfg, log=lambda s: None)
        logs[k] = [json.loads(l) for l in open(out / "train_log.jsonl") if '"loss"' in l]
    # (a step whose labels all fall outside the scored ids has neither loss)
    used = [r for r in logs[1] if r["kd_slots"]]
    assert len(used) >= 3 and all(r["kd_slots"] for r in logs[8] if r["hard_loss"])
    np.testing.assert_allclose([r["loss"] for r in logs[1]], [r["hard_loss"] for r in logs[1]], rtol=1e-4)
    assert max(abs(r["loss"] - r["hard_loss"]) for r in logs[8]) > 1e-3


def test_the_torch_targets_soft_labels_equal_the_precomputed_ones(pair_and_data, tmp_path):
    """FeatureStore(topk=K): the soft labels a training step without precomputed features gets
    are the OpenVINO feature pass's (same top-1, same log-probabilities within f16 rounding), for a
    sequence kept in the cache and for one over the cap (the latest forward's)."""
    model_dir, root = pair_and_data
    precompute_features(model_dir, root / "data", tmp_path / "f", config=STRICT_F32, log=lambda s: None, topk=8)
    manifest = json.loads((model_dir / "manifest.json").read_text())
    target = FrozenTarget(manifest["target"]["source"], manifest["target_layer_ids"], "cpu", predictions=True)
    ff = FeatureFile(tmp_path / "f")
    for cap_gb in (1.0, 0.0):
        store = FeatureStore(target, cap_gb, topk=8)
        for i, s in enumerate(load_sequences(root / "data")):
            ids = torch.from_numpy(s.tokens)
            store.get(i, ids)
            got_ids, got_logp = store.soft(i, ids.numel())
            want_ids, want_logp = ff.lookup_topk(s.offset, ids.numel())
            first = s.prompt_len - 1  # stored from the last prompt position on
            assert got_ids.shape == (ids.numel(), 8) and got_ids.dtype == torch.int64
            assert np.array_equal(got_ids[first:, 0].numpy(), np.asarray(want_ids[first:, 0], dtype=np.int64))
            np.testing.assert_allclose(got_logp[first:].numpy(), np.asarray(want_logp[first:], np.float32), atol=2e-2)
            assert store.soft(i, ids.numel() + 1) is None  # another truncation is not a hit
        assert (len(store.cache) > 0) == (cap_gb > 0)
    with pytest.raises(ValueError, match="predictions=True"):
        FrozenTarget(manifest["target"]["source"], manifest["target_layer_ids"], "cpu").features(ids, topk=4)


def test_next_token_scores_in_the_graph_equal_numpy_with_ties_in_id_order():
    """The feature graph's `next_ids`/`next_logp`, ties put in id order on the host, are numpy's
    ranking of the logits (ties towards the lower id, as the runtime's greedy argmax) and their
    log-softmax values."""
    import openvino as ov
    import openvino.opset13 as ops

    from ovdflash_export.training.features import add_next_token_scores, ties_in_id_order, top_k_log_probs

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(1, 5, 40)).astype(np.float32)
    logits[0, 1, [7, 3, 30]] = logits[0, 1].max() + 1.0      # a three-way tie at the top
    logits[0, 2, [12, 25]] = logits[0, 2].max() + 0.5        # a two-way tie
    logits[0, 3, :4] = logits[0, 3].max() + 2.0              # a four-way tie, as wide as K
    x = ops.parameter([1, 5, 40], ov.Type.f32, name="x")
    y = ops.multiply(x, ops.constant(np.float32(1.0)))
    res = ops.result(y)
    res.output(0).get_tensor().set_names({"logits"})
    model = ov.Model([res], [x])
    add_next_token_scores(model, 4)
    assert sorted(n for o in model.outputs for n in o.get_names()) == ["next_ids", "next_logp"]
    out = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}).create_infer_request().infer(
        {"x": logits})
    want_ids, want_logp = top_k_log_probs(logits[0], 4)
    got_ids, got_logp = ties_in_id_order(out["next_ids"][0], out["next_logp"][0])
    assert np.array_equal(got_ids, want_ids.astype(np.int64))
    assert list(got_ids[1, :3]) == [3, 7, 30] and list(got_ids[3]) == [0, 1, 2, 3]
    assert np.array_equal(got_ids[:, 0], logits[0].argmax(-1))
    np.testing.assert_allclose(got_logp, want_logp.astype(np.float32), atol=2e-3)


def test_fill_topk_completes_old_sequences_in_place_as_a_fresh_pass_would(pair_and_data, tmp_path):
    """Two sequences stored without top-k, two with: fill_topk writes the first two's rows (and
    flags them) exactly as a pass with top-k from the start, leaves every other byte alone, and
    a second call has nothing to do."""
    model_dir, _ = pair_and_data
    data = tmp_path / "data"
    _write(data, 2, seed=6)
    mixed, fresh = tmp_path / "mixed", tmp_path / "fresh"
    # one prefill per sequence, in file order (share_prefixes=False), so the bytes can be compared
    once = dict(config=STRICT_F32, log=lambda s: None, share_prefixes=False)
    precompute_features(model_dir, data, mixed, **once)
    _write(data, 2, seed=7)
    precompute_features(model_dir, data, mixed, topk=8, **once)
    precompute_features(model_dir, data, fresh, topk=8, **once)
    before = {name: (mixed / name).read_bytes() for name in (FEATS, "preds.u16", TOPK_IDS)}
    plain = tmp_path / "plain"   # a directory that never had top-k cannot be filled
    precompute_features(model_dir, data, plain, config=STRICT_F32, log=lambda s: None)
    with pytest.raises(ValueError, match="top-k"):
        fill_topk(model_dir, data, plain, config=STRICT_F32, log=lambda s: None)
    meta_path = mixed / "meta.json"  # nor filled in another precision (marked, as bf16 is not on every CPU)
    meta_text = meta_path.read_text()
    meta = json.loads(meta_text)
    meta["compile"]["INFERENCE_PRECISION_HINT"] = "bf16"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="inference precision"):
        fill_topk(model_dir, data, mixed, config=STRICT_F32, log=lambda s: None)
    meta_path.write_text(meta_text)
    assert (mixed / TOPK_IDS).read_bytes() == before[TOPK_IDS]
    summary = fill_topk(model_dir, data, mixed, config=STRICT_F32, log=lambda s: None, checkpoint_every=1)
    assert summary["filled"] == 2
    assert (mixed / FEATS).read_bytes() == before[FEATS] and (mixed / "preds.u16").read_bytes() == before["preds.u16"]
    assert (mixed / TOPK_IDS).read_bytes() != before[TOPK_IDS]
    for name in (TOPK_IDS, TOPK_LOGP):
        assert (mixed / name).read_bytes() == (fresh / name).read_bytes()
    assert all(r["topk"] for r in (json.loads(line) for line in open(mixed / INDEX)))
    assert fill_topk(model_dir, data, mixed, config=STRICT_F32, log=lambda s: None)["filled"] == 0
    ff = FeatureFile(mixed)
    assert all(ff.lookup_topk(s.offset, len(s.tokens)) is not None for s in load_sequences(data))



def test_shared_prefixes_give_the_features_of_separate_prefills(pair_and_data, tmp_path):
    """Follow-ups (in another directory) that begin with a stored conversation, and two replies to
    one prompt: run in token order with their shared prefixes run once, the stored rows equal
    those of one prefill per sequence."""
    from ovdflash_export.training.features import precompute_features_many

    model_dir, _ = pair_and_data
    rng = np.random.default_rng(7)
    first_turns, followups = ShardWriter(tmp_path / "data"), ShardWriter(tmp_path / "data_fu")
    stored = []
    for i in range(3):
        prompt = rng.integers(3, 500, size=6).tolist()
        for rep in range(2):  # two replies to one prompt
            seq = prompt + rng.integers(3, 500, size=12).tolist()
            first_turns.append(seq, len(prompt), "chat", "sample", f"p{i}", rep, True)
            stored.append(seq)
    for i, seq in enumerate(stored[:4]):
        fu_prompt = seq + rng.integers(3, 500, size=5).tolist()
        followups.append(fu_prompt + rng.integers(3, 500, size=int(rng.integers(8, 30))).tolist(),
                         len(fu_prompt), "chat", "greedy", f"fu-{i}", 0, True)
    pairs = lambda root: [(tmp_path / "data", root / "data"), (tmp_path / "data_fu", root / "data_fu")]
    shared = precompute_features_many(model_dir, pairs(tmp_path / "shared"), config=STRICT_F32, log=lambda s: None,
                                      topk=4)
    alone = precompute_features_many(model_dir, pairs(tmp_path / "alone"), config=STRICT_F32, log=lambda s: None,
                                     topk=4, share_prefixes=False)
    total = sum(s["new_tokens"] for s in alone)
    assert alone[0]["run_tokens"] == total and alone[0]["reused_tokens"] == 0
    assert shared[0]["run_tokens"] + shared[0]["reused_tokens"] == total
    # each follow-up reuses its whole conversation, each second reply its prompt
    assert shared[0]["reused_tokens"] >= sum(len(s) for s in stored[:4]) + 3 * 5
    for name in ("data", "data_fu"):
        a, b = FeatureFile(tmp_path / "shared" / name), FeatureFile(tmp_path / "alone" / name)
        for seq in load_sequences(tmp_path / name):
            fa, pa = a.lookup(seq.offset, len(seq.tokens))
            fb, pb = b.lookup(seq.offset, len(seq.tokens))
            np.testing.assert_allclose(np.asarray(fa, np.float32), np.asarray(fb, np.float32), atol=2e-3, rtol=1e-3)
            assert np.array_equal(pa, pb)
            (ia, la), (ib, lb) = a.lookup_topk(seq.offset, len(seq.tokens)), b.lookup_topk(seq.offset, len(seq.tokens))
            assert np.array_equal(ia[:, 0], ib[:, 0])
            np.testing.assert_allclose(np.asarray(la, np.float32), np.asarray(lb, np.float32), atol=2e-3)
