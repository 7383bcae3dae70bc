"""Weight-compressed exports (fp16, int8, int4 per model) load, keep their locators and run.

The compressed pairs are made from the fp32 `tiny_pair` IRs with the exporter's own
`compress_model` (the optimum conversion is the slow part and is format independent);
test_export_cli.py runs one compressed export end to end. The int8 target must still agree
with fp32 on clear argmax rows; int4 only has to run and be finite (random tiny weights make
int4 numerics meaningless).
"""
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from ovdflash import STRICT_F32
from ovdflash.ov.graphs import drafter_for_runtime, read_layer_locators, target_for_runtime

_CACHE = {}


def _compressed_pair(tiny_pair, tmp_path_factory, target_fmt, drafter_fmt):
    from ovdflash_export.compress import compress_model

    key = (target_fmt, drafter_fmt)
    if key not in _CACHE:
        out = tmp_path_factory.mktemp(f"pair_{target_fmt}_{drafter_fmt}")
        shutil.copytree(tiny_pair, out, dirs_exist_ok=True)
        core = ov.Core()
        for which, fmt in (("target", target_fmt), ("drafter", drafter_fmt)):
            xml = out / which / "openvino_model.xml"
            model = compress_model(core.read_model(str(tiny_pair / which / "openvino_model.xml")), fmt)
            xml.unlink()
            (out / which / "openvino_model.bin").unlink()
            ov.save_model(model, str(xml), compress_to_fp16=fmt == "fp16")
        m = json.loads((out / "manifest.json").read_text())
        m["target"]["weight_format"], m["drafter"]["weight_format"] = target_fmt, drafter_fmt
        (out / "manifest.json").write_text(json.dumps(m))
        _CACHE[key] = out
    return _CACHE[key]


@pytest.fixture
def compressed(tiny_pair, tmp_path_factory):
    return lambda t, d: _compressed_pair(tiny_pair, tmp_path_factory, t, d)


def _manifest(d):
    return json.loads((Path(d) / "manifest.json").read_text())


def _weight_types(model):
    """Element type of the stored constant behind every MatMul weight (through decompression ops)."""
    types = Counter()
    for op in model.get_ops():
        if op.get_type_name() != "MatMul":
            continue
        node = op.input_value(1).get_node()
        while node.get_type_name() in ("Convert", "Multiply", "Subtract", "Reshape"):
            node = node.input_value(0).get_node()
        if node.get_type_name() == "Constant":
            types[node.get_output_element_type(0).get_type_name()] += 1
    return types


def _run_pair(model_dir):
    core = ov.Core()
    m = _manifest(model_dir)
    target = target_for_runtime(core.read_model(str(model_dir / "target" / "openvino_model.xml")),
                                m["target_layer_ids"])
    drafter = drafter_for_runtime(core.read_model(str(model_dir / "drafter" / "openvino_model.xml")), target)
    t_req = core.compile_model(target, "CPU", STRICT_F32).create_infer_request()
    d_req = core.compile_model(drafter, "CPU", STRICT_F32).create_infer_request()
    tokens = np.random.RandomState(0).randint(0, 400, size=10)
    res = t_req.infer({"input_ids": tokens[None], "attention_mask": np.ones((1, 10), np.int64),
                       "position_ids": np.arange(10)[None], "beam_idx": np.zeros(1, np.int32),
                       "logits_indices": np.arange(10)})
    logits, feats = res["logits"].copy(), res["target_hidden"].copy()
    bs = m["block_size"]
    draft = d_req.infer({"input_ids": np.array([[tokens[-1]] + [m["mask_token_id"]] * (bs - 1)]),
                         "hidden_states": feats[:, :9], "position_ids": np.arange(9 + bs)[None],
                         "attention_mask": np.ones((1, 9 + bs), np.int64), "beam_idx": np.zeros(1, np.int32)})
    return tokens, logits, feats, draft["draft_tokens"].copy()


@pytest.mark.parametrize("target_fmt,drafter_fmt", [("int8", "int4"), ("int4", "int8"), ("fp16", "fp16")])
def test_compressed_pair_loads_and_runs(compressed, target_fmt, drafter_fmt):
    model_dir = compressed(target_fmt, drafter_fmt)
    m = _manifest(model_dir)
    assert m["target"]["weight_format"] == target_fmt and m["drafter"]["weight_format"] == drafter_fmt
    core = ov.Core()
    t_ir = core.read_model(str(model_dir / "target" / "openvino_model.xml"))
    d_ir = core.read_model(str(model_dir / "drafter" / "openvino_model.xml"))
    assert sorted(read_layer_locators(t_ir)) == list(range(m["target"]["num_layers"]))
    expect = {"int8": {"u8"}, "int4": {"i4"}, "fp16": {"f16"}}
    for ir, fmt in ((t_ir, target_fmt), (d_ir, drafter_fmt)):
        types = _weight_types(ir)
        compressed = sum(n for t, n in types.items() if t in expect[fmt] or t == "u8")
        assert sum(types.values()) >= 4 and compressed >= 0.9 * sum(types.values()), (fmt, types)
        assert expect[fmt] & set(types), (fmt, types)
    _, logits, feats, draft = _run_pair(model_dir)
    assert np.isfinite(logits).all() and np.isfinite(feats).all()
    assert draft.shape == (1, m["block_size"] - 1) and ((0 <= draft) & (draft < m["vocab_size"])).all()


def test_compressed_files_are_smaller(tiny_pair, compressed):
    fp32 = tiny_pair
    int8 = compressed("int8", "int4")
    size = lambda d, w: (d / w / "openvino_model.bin").stat().st_size  # noqa: E731
    assert size(int8, "target") < 0.5 * size(fp32, "target")
    assert size(int8, "drafter") < 0.5 * size(fp32, "drafter")


def test_int8_target_agrees_with_fp32(tiny_pair, compressed):
    _, ref_logits, _, _ = _run_pair(tiny_pair)
    _, logits, _, _ = _run_pair(compressed("int8", "int4"))
    scale = np.abs(ref_logits).max()
    assert np.abs(logits - ref_logits).max() < 0.1 * scale
    top2 = np.sort(ref_logits[0], axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.05 * scale
    assert clear.any()
    assert (logits[0].argmax(-1)[clear] == ref_logits[0].argmax(-1)[clear]).all()
