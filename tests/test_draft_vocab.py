"""Draft vocabulary: the drafter's head restricted to a subset of target ids (graphs.drafter_for_runtime).

- `draft_tokens` with a draft vocabulary equal a numpy reference: the saved drafter's hidden
  state times the target lm_head weight, argmax over the vocabulary's columns only, mapped
  back to target ids.
- `_slice_rows` on an int8-style decompression pattern (u8 constant, zero point, scale) slices
  the constants, so the head stays compressed, and equals the decompressed weight's rows.
- A model directory with `drafter/draft_vocab.json` still decodes greedily identical to AR
  (the target verifies every draft), every draft lies in the vocabulary, and
  `use_draft_vocab=False` brings the full head back.
- Without a draft vocabulary, a whole fp16 head is applied in int8 (`graphs.with_int8_head`): the drafts
  equal a numpy reference (the hidden state times the per-row quantized weight), the plugin runs that
  head on int8 weights, the fp32 target or a draft vocabulary keeps its head as it was, and greedy DFlash
  still equals AR.
- `export_pair` copies a checkpoint's `draft_vocab.json` (sorted, deduplicated), records
  `draft_vocab_size`, and refuses ids outside the target's vocabulary before converting.
"""
import json
import shutil

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from ovdflash import STRICT_F32, DFlashPipeline
from ovdflash.ov.graphs import (_slice_rows, drafter_for_runtime, find_embedding_gather, find_lm_head, read_draft_vocab,
                                with_int8_head)


def drafter_feed(manifest, num_ctx, rng):
    bs = manifest["block_size"]
    feat = len(manifest["target_layer_ids"]) * manifest["target"]["hidden_size"]
    return {"hidden_states": rng.standard_normal((1, num_ctx, feat)).astype(np.float32),
            "position_ids": np.arange(num_ctx + bs)[None], "attention_mask": np.ones((1, num_ctx + bs), np.int64),
            "beam_idx": np.zeros(1, np.int32)}


def test_draft_tokens_are_the_argmax_restricted_to_the_draft_vocab(tiny_pair):
    core = ov.Core()
    manifest = json.loads((tiny_pair / "manifest.json").read_text())
    target = core.read_model(tiny_pair / "target/openvino_model.xml")
    lm_head = find_lm_head(target)
    head = lm_head.input_value(1).get_node().get_data()  # fp32 tiny pair: a plain [V, H] constant
    assert lm_head.get_attributes()["transpose_b"]
    rng = np.random.default_rng(0)
    vocab_ids = np.sort(rng.choice(head.shape[0], size=97, replace=False))
    bs, mask = manifest["block_size"], manifest["mask_token_id"]
    block = np.array([[5] + [mask] * (bs - 1)], np.int64)

    plain = core.compile_model(core.read_model(tiny_pair / "drafter/openvino_model.xml"), "CPU", STRICT_F32)
    restricted = core.compile_model(drafter_for_runtime(core.read_model(tiny_pair / "drafter/openvino_model.xml"),
                                                        target, vocab_ids), "CPU", STRICT_F32)
    embed = find_embedding_gather(target).input_value(0).get_node().get_data()
    for trial in range(3):
        feed = drafter_feed(manifest, 3 + trial, rng)
        hidden = plain.create_infer_request().infer({**feed, "inputs_embeds": embed[block]})["last_hidden_state"]
        logits = hidden[0] @ head.T                                  # [B-1, V]
        expected = vocab_ids[np.argmax(logits[:, vocab_ids], axis=-1)]
        got = restricted.create_infer_request().infer({**feed, "input_ids": block})["draft_tokens"][0]
        np.testing.assert_array_equal(got, expected)
        assert set(got.tolist()) <= set(vocab_ids.tolist())
        # the restriction must matter for this check to mean anything: the full argmax differs somewhere
        if trial == 0:
            assert not np.array_equal(np.argmax(logits, axis=-1), expected)


def test_a_whole_fp16_head_is_applied_in_int8_rows(export_tiny_pair, tiny_pair):
    fp16_pair = export_tiny_pair(target_weight_format="fp16")
    core = ov.Core()
    manifest = json.loads((fp16_pair / "manifest.json").read_text())
    target = core.read_model(fp16_pair / "target/openvino_model.xml")
    head = find_lm_head(target).input_value(1).get_node().input_value(0).get_node().get_data().astype(np.float32)
    scale = np.abs(head).max(axis=1, keepdims=True) / 127
    int8_head = np.clip(np.rint(head / scale), -127, 127) * scale
    embed = find_embedding_gather(target).input_value(0).get_node().input_value(0).get_node().get_data()
    drafter = drafter_for_runtime(core.read_model(fp16_pair / "drafter/openvino_model.xml"), target)
    assert with_int8_head(drafter, target)
    compiled = core.compile_model(drafter, "CPU", STRICT_F32)
    head_precisions = {op.get_rt_info()["runtimePrecision"].astype(str) for op in compiled.get_runtime_model().get_ops()
                       if op.get_rt_info()["layerType"].astype(str) == "FullyConnected"
                       and op.get_output_partial_shape(0)[-1].get_length() == head.shape[0]}
    assert head_precisions == {"i8"}
    plain = core.compile_model(core.read_model(fp16_pair / "drafter/openvino_model.xml"), "CPU", STRICT_F32)
    bs, mask = manifest["block_size"], manifest["mask_token_id"]
    block = np.array([[5] + [mask] * (bs - 1)], np.int64)
    rng = np.random.default_rng(2)
    for trial in range(4):
        feed = drafter_feed(manifest, 3 + trial, rng)
        hidden = plain.create_infer_request().infer({**feed, "inputs_embeds": embed[block].astype(np.float32)})
        logits = hidden["last_hidden_state"][0] @ int8_head.T
        got = compiled.create_infer_request().infer({**feed, "input_ids": block})["draft_tokens"][0]
        np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    # the fp32 target's head, and a draft vocabulary's rows, stay as they were
    fp32_target = core.read_model(tiny_pair / "target/openvino_model.xml")
    assert not with_int8_head(drafter_for_runtime(core.read_model(tiny_pair / "drafter/openvino_model.xml"),
                                                  fp32_target), fp32_target)
    assert not with_int8_head(drafter_for_runtime(core.read_model(fp16_pair / "drafter/openvino_model.xml"), target,
                                                  np.arange(50)), target)
    # lossless: the target verifies every draft
    pipe = DFlashPipeline.from_pretrained(fp16_pair, **STRICT_F32)
    prompt = [3, 17, 42, 9, 100, 7]
    for block_size in (2, 4):
        assert pipe.generate(prompt, max_new_tokens=24, block_size=block_size).token_ids == \
            pipe.generate(prompt, max_new_tokens=24, draft=False).token_ids
    assert {op.get_rt_info()["runtimePrecision"].astype(str) for op in pipe.drafter.compiled.get_runtime_model().get_ops()
            if op.get_rt_info()["layerType"].astype(str) == "FullyConnected"
            and op.get_output_partial_shape(0)[-1].get_length() == head.shape[0]} == {"i8"}


def test_slice_rows_keeps_a_compressed_weight_compressed():
    rng = np.random.default_rng(1)
    q = rng.integers(0, 255, size=(40, 8)).astype(np.uint8)
    zp = rng.integers(100, 150, size=(40, 1)).astype(np.uint8)
    scale = rng.random((40, 1)).astype(np.float16)
    weight = ops.convert(ops.multiply(ops.subtract(ops.convert(ops.constant(q), ov.Type.f16),
                                                   ops.convert(ops.constant(zp), ov.Type.f16)),
                                      ops.constant(scale)), ov.Type.f32)
    rows = np.array([0, 3, 7, 39], np.int64)
    sliced = _slice_rows(weight.output(0), rows, 0)
    # no runtime Gather: every constant in the new subgraph has 4 rows (or broadcasts)
    consts = []
    frontier = [sliced.get_node()]
    while frontier:
        node = frontier.pop()
        assert node.get_type_name() != "Gather"
        if node.get_type_name() == "Constant":
            consts.append(node)
        frontier.extend(node.input_value(i).get_node() for i in range(node.get_input_size()))
    assert {c.get_output_element_type(0) for c in consts} == {ov.Type.u8, ov.Type.f16}
    assert all(c.get_output_shape(0)[0] == 4 for c in consts)
    full = ((q.astype(np.float32) - zp) * scale.astype(np.float32))
    model = ov.Model([ops.result(sliced)], [])
    got = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}).create_infer_request().infer({})
    np.testing.assert_allclose(next(iter(got.values())), full[rows], rtol=1e-3, atol=1e-3)


def test_read_draft_vocab_sorts_dedups_and_rejects_garbage(tmp_path):
    path = tmp_path / "v.json"
    path.write_text("[7, 3, 3, 9]")
    assert read_draft_vocab(path).tolist() == [3, 7, 9]
    for bad in ("[]", "[-1, 2]", "[[1, 2]]"):
        path.write_text(bad)
        with pytest.raises(ValueError):
            read_draft_vocab(path)


@pytest.fixture(scope="module")
def vocab_pair(tiny_pair, tmp_path_factory):
    """The tiny pair with a shipped draft vocabulary: every id the tiny tokenizer can produce below 300."""
    out = tmp_path_factory.mktemp("vocab_pair") / "pair"
    shutil.copytree(tiny_pair, out)
    ids = list(range(0, 300, 2))
    (out / "drafter/draft_vocab.json").write_text(json.dumps(ids))
    return out, set(ids)


def test_greedy_with_draft_vocab_equals_autoregressive(vocab_pair, tmp_path):
    model_dir, ids = vocab_pair
    pipe = DFlashPipeline.from_pretrained(model_dir, cache_dir=tmp_path, INFERENCE_NUM_THREADS=1, **STRICT_F32)
    full = DFlashPipeline.from_pretrained(model_dir, cache_dir=tmp_path, use_draft_vocab=False,
                                          INFERENCE_NUM_THREADS=1, **STRICT_F32)
    manifest = json.loads((model_dir / "manifest.json").read_text())
    feat = len(manifest["target_layer_ids"]) * manifest["target"]["hidden_size"]
    rng = np.random.default_rng(3)
    outside = 0
    for n in (1, 5, 17, 40):
        prompt = rng.integers(0, 300, size=n).tolist()
        ar = [e.token for e in pipe.generate_tokens(prompt, 40, draft=False, eos_token_ids=[])]
        spec = [e.token for e in pipe.generate_tokens(prompt, 40, draft=True, block_size=pipe.block_size,
                                                      eos_token_ids=[])]
        assert spec == ar
        # drafts straight from the drafter runner: restricted with the file, not without it
        feats = rng.standard_normal((n, feat)).astype(np.float32)
        pipe.drafter.reset()
        full.drafter.reset()
        drafts = pipe.drafter.propose(ar[0], feats, n, pipe.block_size - 1)
        assert set(drafts.tolist()) <= ids
        outside += len(set(full.drafter.propose(ar[0], feats, n, full.block_size - 1).tolist()) - ids)
    assert outside > 0  # the full head does propose ids outside the vocabulary


def test_export_copies_the_draft_vocab_and_rejects_out_of_range_ids(tiny_sources, tmp_path):
    from ovdflash_export.exporter import PairMismatchError, export_pair, validate_pair

    target, drafter = tiny_sources()
    ckpt = tmp_path / "drafter"
    shutil.copytree(drafter, ckpt)
    (ckpt / "draft_vocab.json").write_text(json.dumps([511, 3, 3, 40]))
    out = export_pair(target, ckpt, tmp_path / "out")
    assert json.loads((out / "drafter/draft_vocab.json").read_text()) == [3, 40, 511]
    assert json.loads((out / "manifest.json").read_text())["draft_vocab_size"] == 3
    # the runtime picks it up: every draft is one of the three ids
    pipe = DFlashPipeline.from_pretrained(out, cache_dir=tmp_path / "c", **STRICT_F32)
    manifest = json.loads((out / "manifest.json").read_text())
    feats = np.zeros((4, len(manifest["target_layer_ids"]) * manifest["target"]["hidden_size"]), np.float32)
    assert set(pipe.drafter.propose(7, feats, 4, 3).tolist()) <= {3, 40, 511}

    (ckpt / "draft_vocab.json").write_text(json.dumps([3, 512]))   # the tiny vocab is 512
    with pytest.raises(PairMismatchError, match="512"):
        validate_pair(target, ckpt)
