"""Interop with optimum-intel and openvino.genai, both ways, on the tiny random pair.

* A target and DFlash drafter exported by optimum-intel's own exporter (the two directories
  openvino.genai's DFlash pipeline reads) become an ovdflash directory through `ovdflash export`,
  and that directory decodes exactly as our own export of the same checkpoints: the same tokens
  and the same drafts accepted at every position (so the drafter IR is used as we use ours).
  The target comes from `optimum.exporters.openvino.main_export`, as `optimum-cli export
  openvino` runs it. The drafter comes from optimum-intel's DFlash model class and
  `export_from_model`, called in-process. `optimum-cli` reaches that same class through
  transformers' remote-code loader (`--trust-remote-code`), and that loader requires every package
  optimum's model_patcher.py imports (diffusers, einops), which the export stage does not install.
* openvino.genai's LLMPipeline, alone and with its DFlash draft_model, runs our exports and
  gives our greedy tokens under f32 numerics, accepting as many drafts as ours (qwen3 here;
  llama and qwen2, and the default SmolLM2 model with its trained drafter, in the slow set).
"""
import json
import shutil

import numpy as np
import pytest
from test_hub_ids import _export, _one_error_line

from ovdflash import STRICT_F32, DFlashPipeline

# f32 compute, f32 KV cache, no dynamic quantization: genai's deterministic numerics
GENAI_F32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
PROMPT = [5, 9, 13, 5, 9, 13, 5, 9, 13, 21, 34, 55, 89, 5, 9, 13, 5, 9]


def optimum_export_target(src, out):
    from optimum.exporters.openvino import main_export

    main_export(str(src), output=str(out), task="text-generation-with-past", trust_remote_code=False)
    return out


def optimum_export_dflash_drafter(src, out):
    """optimum-intel's DFlash drafter export, as optimum-cli runs it but without the remote-code loader."""
    from optimum.exporters.openvino.__main__ import _CUSTOM_DRAFT_MODEL_MAP, update_config_for_custom_draft_model
    from optimum.exporters.openvino.convert import export_from_model
    from optimum.exporters.openvino.model_patcher import Qwen3DFlashForCausalLM
    from transformers import AutoConfig

    class DFlashDraftForExport(Qwen3DFlashForCausalLM):
        """optimum's class under a module name outside `optimum`, which export_from_model would take
        for one of optimum's own wrappers."""

    config = AutoConfig.from_pretrained(str(src))
    config = update_config_for_custom_draft_model(config, *_CUSTOM_DRAFT_MODEL_MAP[config.architectures[0]])
    model = DFlashDraftForExport.from_pretrained(str(src), config=config, dtype="float32")
    export_from_model(model, str(out), task="text-generation-with-past", stateful=True)
    return out


@pytest.fixture(scope="module")
def optimum_pairs(tiny_sources, tmp_path_factory):
    """Factory: arch -> (target IR dir, drafter IR dir) exported by optimum-intel from the checkpoints
    that `export_tiny_pair(arch=arch)` exports; cached."""
    cache = {}

    def build(arch="qwen3"):
        if arch not in cache:
            target, drafter = tiny_sources(arch)
            root = tmp_path_factory.mktemp(f"optimum_{arch}")
            cache[arch] = (optimum_export_target(target, root / "target"),
                           optimum_export_dflash_drafter(drafter, root / "drafter"))
        return cache[arch]

    return build


@pytest.fixture(scope="module")
def optimum_pair(optimum_pairs):
    return optimum_pairs()


def _greedy(model_dir, cache_dir, block_size):
    """Greedy DFlash tokens, stats and every block the drafter proposed (a random drafter's drafts
    are rejected, so the proposals themselves are what shows the drafter runs alike)."""
    pipe = DFlashPipeline.from_pretrained(model_dir, cache_dir=cache_dir, **STRICT_F32)
    proposals, propose = [], pipe.drafter.propose

    def recording_propose(*args):
        drafts = propose(*args)
        proposals.append(drafts.tolist())
        return drafts

    pipe.drafter.propose = recording_propose
    tokens = [e.token for e in pipe.generate_tokens(PROMPT, 40, block_size=block_size, eos_token_ids=[],
                                                    prompt_lookup=False)]
    return tokens, pipe.last_stats, proposals


@pytest.mark.parametrize("arch", ["qwen3", pytest.param("llama", marks=pytest.mark.slow)])
def test_an_optimum_intel_pair_decodes_as_our_export_of_the_same_checkpoints(optimum_pairs, export_tiny_pair,
                                                                             tmp_path, arch):
    """qwen3: optimum writes the layer locators; llama: the import locates the layers."""
    import openvino as ov

    oi_target, oi_drafter = optimum_pairs(arch)
    tiny_pair = export_tiny_pair(arch=arch)
    assert ov.Core().read_model(str(oi_target / "openvino_model.xml")).has_rt_info(
        "hidden_states_decoder_layers") == (arch == "qwen3")
    drafter_ir = ov.Core().read_model(str(oi_drafter / "openvino_model.xml"))
    assert drafter_ir.get_rt_info(["dflash_mode"]).astype(str) == "True"  # optimum's DFlash layout indeed
    assert not drafter_ir.has_rt_info(["dflash", "block_size"])
    out = tmp_path / "imported"
    result = _export("--target", oi_target, "--drafter", oi_drafter, "--out", out)
    assert result.exit_code == 0, result.output

    ours = json.loads((tiny_pair / "manifest.json").read_text())
    theirs = json.loads((out / "manifest.json").read_text())
    for key in ("block_size", "target_layer_ids", "mask_token_id", "eos_token_ids", "bos_token_id", "vocab_size",
                "max_position_embeddings", "draft_pass", "default_block_size"):
        assert theirs[key] == ours[key], key
    for key in ("arch", "num_layers", "hidden_size", "weight_format"):
        assert theirs["target"][key] == ours["target"][key], key
    assert theirs["target"]["exported_by"] == theirs["drafter"]["exported_by"] == "optimum-intel"
    assert ov.Core().read_model(str(out / "drafter/openvino_model.xml")).get_rt_info(
        ["dflash", "block_size"]).astype(str) == str(ours["block_size"])

    proposed = set()
    for block_size in (2, 4):
        tokens_ours, stats_ours, drafts_ours = _greedy(tiny_pair, tmp_path / "c", block_size)
        tokens_theirs, stats_theirs, drafts_theirs = _greedy(out, tmp_path / "c", block_size)
        assert tokens_theirs == tokens_ours and len(tokens_ours) == 40
        assert stats_theirs.num_drafts == stats_ours.num_drafts > 0
        assert stats_theirs.accepted_per_position == stats_ours.accepted_per_position
        assert drafts_theirs == drafts_ours
        proposed |= {tuple(d) for d in drafts_ours}
    assert len(proposed) > 2, proposed  # the drafts depend on the context: not one constant block


def test_a_half_openvino_pair_and_a_drafter_ir_without_dflash_metadata_are_one_line(optimum_pair, tiny_sources,
                                                                                     tmp_path):
    oi_target, oi_drafter = optimum_pair
    _, drafter = tiny_sources()
    line = _one_error_line(_export("--target", oi_target, "--drafter", drafter, "--out", tmp_path / "o"))
    assert "the target is an OpenVINO IR directory but the drafter is not" in line
    plain = tmp_path / "plain_drafter"
    shutil.copytree(oi_drafter, plain)
    xml = plain / "openvino_model.xml"
    xml.write_text("\n".join(line for line in xml.read_text().splitlines() if "<dflash_mode" not in line))
    line = _one_error_line(_export("--target", oi_target, "--drafter", plain, "--out", tmp_path / "o"))
    assert "no rt_info dflash_mode=True" in line
    line = _one_error_line(_export("--target", oi_target, "--drafter", oi_drafter, "--out", tmp_path / "o",
                                   "--target-weight-format", "int8"))
    assert "keep the weights they were exported with" in line
    assert not (tmp_path / "o").exists()


def test_an_optimum_intel_hybrid_target_is_refused_in_one_line(optimum_pair, tmp_path):
    """optimum-intel keeps Qwen3.5's linear-attention state inside the IR; our hybrid runner holds it
    on the host, so such a target must come from its checkpoint."""
    oi_target, oi_drafter = optimum_pair
    hybrid = tmp_path / "hybrid_target"
    shutil.copytree(oi_target, hybrid)
    config = json.loads((hybrid / "config.json").read_text())
    (hybrid / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_5_text"}))
    line = _one_error_line(_export("--target", hybrid, "--drafter", oi_drafter, "--out", tmp_path / "o"))
    assert "keeps its linear-attention state inside the IR" in line and "HF checkpoint" in line


def _genai_greedy(model_dir, drafted: bool, max_new_tokens: int, prompt=PROMPT, block_size=4):
    import openvino as ov
    import openvino_genai as og

    sc = og.SchedulerConfig()
    sc.enable_prefix_caching = False  # genai's DFlash asserts it off
    sc.max_num_batched_tokens = 4096
    sc.cache_size = 1
    kwargs = dict(scheduler_config=sc, **GENAI_F32)
    if drafted:
        kwargs["draft_model"] = og.draft_model(str(model_dir / "drafter"), "CPU", **GENAI_F32)
    pipe = og.LLMPipeline(str(model_dir / "target"), "CPU", **kwargs)
    cfg = og.GenerationConfig()
    cfg.max_new_tokens = max_new_tokens
    cfg.ignore_eos = True
    if drafted:
        cfg.num_assistant_tokens = block_size - 1  # genai's block = num_assistant_tokens + 1
    ids = np.asarray([prompt], dtype=np.int64)
    res = pipe.generate(og.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids))), cfg)
    accepted = int(res.extended_perf_metrics.get_num_accepted_tokens()) if drafted else None
    return list(res.tokens[0]), accepted


def _genai_runs_our_export(model_dir, tmp_path, prompt=PROMPT, block_size=4):
    """genai AR and DFlash give our greedy tokens; returns (genai's accepted drafts, ours) at block_size."""
    pytest.importorskip("openvino_genai")
    pipe = DFlashPipeline.from_pretrained(model_dir, cache_dir=tmp_path / "c", **STRICT_F32)
    ar = [e.token for e in pipe.generate_tokens(prompt, 24, draft=False, eos_token_ids=[])]
    dflash = [e.token for e in pipe.generate_tokens(prompt, 24, block_size=block_size, eos_token_ids=[],
                                                    prompt_lookup=False)]
    assert dflash == ar
    accepted = None
    for drafted in (False, True):
        tokens, accepted = _genai_greedy(model_dir, drafted, 24, prompt, block_size)
        assert tokens == ar, f"genai {'DFlash' if drafted else 'AR'} differs from our greedy AR"
    return accepted, pipe.last_stats.num_accepted_tokens


def test_openvino_genai_runs_our_qwen3_export(tiny_pair, tmp_path):
    genai_accepted, ours = _genai_runs_our_export(tiny_pair, tmp_path)
    assert genai_accepted == ours  # a random drafter: both 0, see the default model's test for more


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_openvino_genai_runs_our_llama_and_qwen2_exports(export_tiny_pair, tmp_path, arch):
    genai_accepted, ours = _genai_runs_our_export(export_tiny_pair(arch=arch), tmp_path)
    assert genai_accepted == ours


@pytest.mark.slow
def test_openvino_genai_dflash_accepts_the_drafts_ours_accepts_on_the_default_model(tmp_path):
    """A trained drafter (the shipped SmolLM2 one), so drafts are accepted: genai's DFlash on our IRs
    accepts exactly as many as ours, with the same tokens."""
    from ovdflash.pipeline import default_model_dir
    from ovdflash.tokenizer import Tokenizer

    model = default_model_dir()
    prompt = Tokenizer.from_dir(model).encode(
        "<|im_start|>user\nWrite a Python function that adds two numbers.<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False)
    genai_accepted, ours = _genai_runs_our_export(model, tmp_path, list(prompt), block_size=4)
    assert genai_accepted == ours > 0
