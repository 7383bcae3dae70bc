"""Qwen3.5 hybrid targets (Gated DeltaNet + full attention): export, exact rollback, lossless decoding.

A tiny random `qwen3_5_text` target (layers 0-2 Gated DeltaNet, 3 full attention; A_log, dt_bias
and the norms randomized so every path matters) is exported with `export_pair` beside a random
drafter reading layers 1 (linear attention) and 3 (full attention, after the final norm).

Oracles: HF transformers' full-sequence forward (its chunked delta rule) for logits and features,
and HF's plain greedy `generate` (token-by-token recurrent state). HF's `Cache.crop` is NOT a valid
oracle for a hybrid model: it trims the attention K/V but leaves the conv and recurrent states with
the rejected tokens folded in, so z-lab's `dflash_generate` on such a target is not lossless; every
rollback here is checked against a fresh run over exactly the committed tokens instead.
"""
import json

import numpy as np
import openvino as ov
import pytest
import torch
from test_lossless import OracleDrafter, random_prompts, tokens

from ovdflash import STRICT_F32, DFlashPipeline
from ovdflash.decode.stats import GenerationStats
from ovdflash.ov.hybrid import CONV_STATE, RECURRENT_STATE, compile_hybrid_target
from ovdflash.ov.runners import kv_seq_axes

ARCH = "qwen3_5_text"
LAYER_IDS = (1, 3)
TOL = 1e-4


@pytest.fixture(scope="module")
def pair(export_tiny_pair):
    return export_tiny_pair(arch=ARCH, target_layer_ids=LAYER_IDS)


def _manifest(pair):
    return json.loads((pair / "manifest.json").read_text())


@pytest.fixture(scope="module")
def hf(pair):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_manifest(pair)["target"]["source"], dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return model


@pytest.fixture(scope="module")
def pipe(pair, tmp_path_factory):
    pipe = DFlashPipeline.from_pretrained(pair, cache_dir=tmp_path_factory.mktemp("ov_cache"), target_runner="hybrid",
                                          INFERENCE_NUM_THREADS=1, **STRICT_F32)
    pipe.default_block_size = pipe.block_size
    return pipe


def _target(pair, layer_ids):
    core = ov.Core()
    model = core.read_model(str(pair / "target" / "openvino_model.xml"))
    manifest = {**_manifest(pair), "target_layer_ids": list(layer_ids)}
    return compile_hybrid_target(core, model, manifest, "CPU", dict(STRICT_F32), kv_seq_axes(model))


@torch.no_grad()
def _hf_reference(hf, tokens, layer_ids):
    out = hf(torch.tensor(tokens)[None], output_hidden_states=True)
    feats = torch.cat([out.hidden_states[k + 1] for k in layer_ids], dim=-1)
    return out.logits[0].numpy(), feats[0].numpy()


def test_manifest_and_ir_layout(pair):
    manifest = _manifest(pair)
    assert manifest["target_runner"] == "paged" and manifest["target"]["arch"] == ARCH
    assert manifest["hybrid"]["linear_attention_layers"] == [0, 1, 2]
    assert manifest["hybrid"]["full_attention_layers"] == [3]
    model = ov.Core().read_model(str(pair / "target" / "openvino_model.xml"))
    names = [p.get_any_name() for p in model.inputs]
    assert names[:3] == ["input_ids", "attention_mask", "position_ids"] and names[-1] == "beam_idx"
    assert {f"{CONV_STATE}{i}" for i in range(3)} | {f"{RECURRENT_STATE}{i}" for i in range(3)} <= set(names)
    ops = [op.get_type_name() for op in model.get_ops()]
    assert ops.count("ReadValue") == ops.count("Assign") == 2  # K and V of the one full-attention layer
    assert ops.count("Loop") == 3  # one recurrence per Gated DeltaNet layer


def layer_types(compiled) -> list[str]:
    return [op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ops()]


def test_linear_attention_runs_as_the_fused_gated_delta_net_kernel(pipe):
    """Each linear-attention layer of the target, and of the rollback's replay graph, compiles to the
    CPU plugin's GatedDeltaNet: no per-token TensorIterator or Loop is left."""
    num_linear = len(_manifest(pipe.model_dir)["hybrid"]["linear_attention_layers"])
    for compiled in (pipe.target.compiled, pipe.target.replay):
        types = layer_types(compiled)
        assert types.count("GatedDeltaNet") == num_linear, sorted(set(types))
        assert not {"TensorIterator", "Loop"} & set(types)


def test_logits_and_features_equal_hf_over_prefill_and_steps(pair, hf):
    layer_ids = [3, 0, 2, 1]  # every layer, linear and full attention, shuffled
    tokens = np.random.RandomState(1).randint(0, 400, size=20)
    want_logits, want_feats = _hf_reference(hf, tokens, layer_ids)
    target = _target(pair, layer_ids)
    target.reset()
    pos = 0
    for n in (9, 1, 4, 2, 1, 3):
        logits, feats = target.forward(tokens[pos:pos + n], all_logits=True)
        assert logits.shape == (n, hf.config.vocab_size) and feats.shape == (n, 4 * hf.config.hidden_size)
        assert np.abs(logits - want_logits[pos:pos + n]).max() < TOL
        assert np.abs(feats - want_feats[pos:pos + n]).max() < TOL
        target.commit(n)
        pos += n
    # the random init makes the recurrence matter: zeroing the states changes the answer
    for name, state in target.states.items():
        state[...] = 0.0
    logits, _ = target.forward(tokens[pos - 1:pos], all_logits=True)
    assert np.abs(logits[0] - want_logits[pos - 1]).max() > 1e-2


def _states(target):
    return {k: v.copy() for k, v in target.states.items()}


@pytest.mark.parametrize("block", [5])
def test_rollback_at_every_position_of_a_block(pipe, block):
    """Verify `block` tokens, keep n (1..block), continue: logits, features and every Gated DeltaNet
    state equal a fresh run over exactly the committed tokens."""
    target = pipe.target
    rng = np.random.default_rng(0)
    prompt, truth, cont = rng.integers(0, 400, 7), rng.integers(0, 400, block), rng.integers(0, 400, 3)
    for kept in range(1, block + 1):
        verify = np.r_[truth[:kept], rng.integers(0, 400, block - kept)]
        replays = target.num_replays
        target.reset()
        target.forward(prompt, all_logits=False)
        target.commit(len(prompt))
        target.forward(verify, all_logits=True)
        target.commit(kept)
        assert target.num_replays - replays == (kept < block)  # a partial commit replays, a full one not
        rolled_states = _states(target)
        logits, feats = target.forward(cont, all_logits=True)
        rolled = np.array(logits), np.array(feats)
        target.commit(len(cont))

        target.reset()
        target.forward(np.r_[prompt, truth[:kept]], all_logits=True)
        target.commit(len(prompt) + kept)
        fresh_states = _states(target)
        logits, feats = target.forward(cont, all_logits=True)
        target.commit(len(cont))
        for name, value in fresh_states.items():
            assert np.abs(rolled_states[name] - value).max() < 1e-5, (kept, name)
        np.testing.assert_allclose(rolled[0], logits, atol=TOL)
        np.testing.assert_allclose(rolled[1], feats, atol=TOL)


@torch.no_grad()
def _hf_greedy_full_forward(hf, prompt, max_new):
    """HF greedy decoding by a full-sequence forward per token (no cache)."""
    seq = list(prompt)
    for _ in range(max_new):
        seq.append(int(hf(torch.tensor([seq]), logits_to_keep=1).logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_greedy_dflash_equals_ar_and_hf_generate(pipe, hf):
    """On 30 prompts: our AR == HF greedy by full forwards == HF's `generate` (which, on this model,
    parts from HF's own full forward at rare near-ties: then the top-2 margin there is checked),
    and greedy DFlash (the random drafter with lookup drafts; an oracle drafter with partial
    accepts) == our AR."""
    vocab = 400
    stats_drafter, stats_oracle = GenerationStats(), GenerationStats()
    replays = pipe.target.num_replays
    generate_ties = []
    for i, prompt in enumerate(random_prompts(30, vocab)):
        max_new = 48 if i % 10 == 0 else 24
        ar = tokens(pipe.generate_tokens(prompt, max_new, draft=False, eos_token_ids=[]))
        assert ar == _hf_greedy_full_forward(hf, prompt, max_new), i
        with torch.no_grad():
            generated = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)
        generated = generated[0, len(prompt):].tolist()
        if generated != ar:
            j = next(j for j, (a, b) in enumerate(zip(ar, generated)) if a != b)
            with torch.no_grad():
                top2 = torch.topk(hf(torch.tensor([prompt + ar[:j]])).logits[0, -1], 2).values
            generate_ties.append((i, j, float(top2[0] - top2[1])))
        block = (2, 3, 4)[i % 3] if i % 4 == 3 else None
        spec = tokens(pipe.generate_tokens(prompt, max_new, block_size=block, eos_token_ids=[], stats=stats_drafter))
        assert spec == ar, i
        drafter = OracleDrafter(prompt + ar, block_size=5, error_rate=0.3, vocab=vocab, seed=i)
        oracle = DFlashPipeline(pipe.target, drafter, pipe.tokenizer, [], 5, prompt_lookup=False)
        assert tokens(oracle.generate_tokens(prompt, max_new, eos_token_ids=[], stats=stats_oracle)) == ar, i
        if i % 5 == 0:  # a prompt that repeats itself: the n-gram lookup drafts (and is accepted)
            echo = prompt + ar + prompt
            echo_ar = tokens(pipe.generate_tokens(echo, max_new, draft=False, eos_token_ids=[]))
            assert tokens(pipe.generate_tokens(echo, max_new, eos_token_ids=[], stats=stats_drafter)) == echo_ar, i
    hist = stats_oracle.acceptance_length_histogram
    print("drafter rounds", stats_drafter.num_drafts, "lookup", stats_drafter.num_lookup_drafts,
          "oracle acceptance histogram", dict(hist), "replays", pipe.target.num_replays - replays)
    assert {1, 2, 3, 4, 5} <= set(hist) and sum(hist[k] for k in (2, 3, 4)) > 50  # many partial accepts
    print("HF generate parted from HF's full forward at (prompt, token, top-2 margin)", generate_ties)
    assert len(generate_ties) <= 3 and all(margin < 0.05 for _, _, margin in generate_ties), generate_ties
    assert stats_drafter.num_lookup_drafts > 0 and stats_drafter.num_lookup_accepted_tokens > 0


def test_auto_block_sizes_and_ar_steps_stay_lossless(pipe):
    """block_size="auto" mixes verify widths and AR steps (0 drafts) on one state: still AR's tokens."""
    for prompt in random_prompts(6, 400, seed=4):
        ar = tokens(pipe.generate_tokens(prompt, 32, draft=False, eos_token_ids=[]))
        assert tokens(pipe.generate_tokens(prompt, 32, block_size="auto", eos_token_ids=[])) == ar


def test_wrong_runner_for_a_hybrid_target_is_refused(pair, tmp_path):
    with pytest.raises(ValueError, match="does not fit this target"):
        DFlashPipeline.from_pretrained(pair, cache_dir=tmp_path, target_runner="stateful")


@pytest.mark.parametrize("runner", ["hybrid", "paged"])
def test_dflash_sampling_matches_ar_on_the_hybrid_target(pair, tmp_path, runner):
    """Two-sample chi-square (contingency) of tokens 1..3, DFlash vs AR, the target as its own drafter
    (often accepted, often not: both the acceptance and the residual path, with replays)."""
    from scipy import stats as sps
    from test_sampling_stats import P_THRESHOLD, SelfDrafter

    pipe = DFlashPipeline.from_pretrained(pair, cache_dir=tmp_path, target_runner=runner, INFERENCE_NUM_THREADS=1,
                                          **STRICT_F32)
    pipe.default_block_size = SelfDrafter.block_size
    prompt = [5, 17, 33]
    pipe.drafter = SelfDrafter(type(pipe.target), pipe.target.compiled, pipe.target.max_length, prompt)
    params = dict(temperature=0.8, top_k=6)
    samples = 600

    def draw(draft):
        return np.array([tokens(pipe.generate_tokens(prompt, 4, draft=draft, seed=s + (10 ** 6 if draft else 0),
                                                     eos_token_ids=[], **params)) for s in range(samples)])

    ar, spec = draw(False), draw(True)
    accepted = pipe.stats.num_accepted_tokens
    assert accepted > 100 and pipe.stats.num_draft_tokens - accepted > 100
    assert runner == "paged" or pipe.target.num_replays > 100
    p_values = {}
    for pos in (1, 2, 3):
        values = sorted(set(ar[:, pos]) | set(spec[:, pos]))
        table = np.array([[np.sum(ar[:, pos] == v) for v in values], [np.sum(spec[:, pos] == v) for v in values]])
        keep = table.sum(0) >= 10
        table = np.c_[table[:, keep], table[:, ~keep].sum(1, keepdims=True)]
        p_values[pos] = sps.chi2_contingency(table[:, table.sum(0) > 0]).pvalue
    print("hybrid two-sample p-values", p_values, "acceptance rate", pipe.stats.acceptance_rate)
    assert min(p_values.values()) > P_THRESHOLD, p_values


def test_the_qwen3_5_wrapper_layout_loads_its_text_model(pair, hf, tmp_path):
    """A `qwen3_5` checkpoint (text model under `model.language_model`, config under `text_config`)
    gives the same text model, and the pair validation reads its text geometry."""
    from ovdflash_export.exporter import validate_pair
    from ovdflash_export.qwen3_5 import load_text_model
    from safetensors.torch import save_file

    source = json.loads((pair / "target" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": source}))
    weights = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v.contiguous()
               for k, v in hf.state_dict().items()}
    weights["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)  # vision weights are ignored
    save_file(weights, str(tmp_path / "model.safetensors"))
    model, config = load_text_model(tmp_path)
    assert config.model_type == "qwen3_5_text" and config.layer_types == hf.config.layer_types
    ids = torch.tensor([[5, 17, 33, 2, 9]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, hf(ids).logits)
    drafter = _manifest(pair)["drafter"]["source"]
    assert validate_pair(tmp_path, drafter).num_layers == hf.config.num_hidden_layers


# --- the paged hybrid runner: the plugin's paged Gated DeltaNet and conv ops, a state slot per token ---


@pytest.fixture(scope="module")
def paged_pipe(pair, tmp_path_factory):
    pipe = DFlashPipeline.from_pretrained(pair, cache_dir=tmp_path_factory.mktemp("ov_cache_paged"),
                                          target_runner="paged", INFERENCE_NUM_THREADS=1, **STRICT_F32)
    pipe.default_block_size = pipe.block_size
    return pipe


def test_paged_hybrid_runs_the_paged_linear_attention_kernels(paged_pipe):
    """Every linear-attention layer compiles to PagedGatedDeltaNet and PagedCausalConv1D over state
    tables the runtime holds; no per-token loop is left and the target cannot rewind."""
    num_linear = len(_manifest(paged_pipe.model_dir)["hybrid"]["linear_attention_layers"])
    target = paged_pipe.target
    types = layer_types(target.compiled)
    assert types.count("PagedGatedDeltaNet") == types.count("PagedCausalConv1D") == num_linear, sorted(set(types))
    assert not {"TensorIterator", "Loop"} & set(types)
    assert len(target.linear.tables) == 2 * num_linear and target.rewinds_exactly is False


def _committed_state(target):
    slot = target.linear.committed[0]
    return {name: np.array(t.data[slot]) for name, t in target.linear.tables.items()}


def test_paged_hybrid_rollback_at_every_position_of_a_block(paged_pipe, pipe):
    """Verify a block, keep n (1..block): the kept state is the checkpoint after token n (no replay),
    equal to a fresh prefill of exactly the committed tokens, and so are the next call's logits and
    features; a kept state is not changed by the next forward until that forward is committed."""
    target, block = paged_pipe.target, 6
    rng = np.random.default_rng(2)
    prompt, truth, cont = rng.integers(0, 400, 9), rng.integers(0, 400, block), rng.integers(0, 400, 3)
    for kept in range(1, block + 1):
        verify = np.r_[truth[:kept], rng.integers(0, 400, block - kept)]
        target.reset()
        target.forward(prompt, all_logits=False)
        target.commit(len(prompt))
        target.forward(verify, all_logits=True)
        target.commit(kept)
        rolled_state = _committed_state(target)
        logits, feats = target.forward(cont, all_logits=True)
        assert all(np.array_equal(v, _committed_state(target)[k]) for k, v in rolled_state.items())
        rolled = np.array(logits), np.array(feats)
        target.commit(len(cont))

        target.reset()
        target.forward(np.r_[prompt, truth[:kept]], all_logits=False)
        target.commit(len(prompt) + kept)
        for name, value in _committed_state(target).items():
            assert np.abs(rolled_state[name] - value).max() < 1e-5, (kept, name)
        logits, feats = target.forward(cont, all_logits=True)
        np.testing.assert_allclose(rolled[0], logits, atol=TOL)
        np.testing.assert_allclose(rolled[1], feats, atol=TOL)
        target.commit(len(cont))
        # the stateful hybrid runner agrees (it is checked against HF above)
        other = pipe.target
        other.reset()
        other.forward(np.r_[prompt, truth[:kept]], all_logits=False)
        other.commit(len(prompt) + kept)
        np.testing.assert_allclose(other.forward(cont, all_logits=True)[0], rolled[0], atol=TOL)
        other.commit(len(cont))
    with pytest.raises(ValueError, match="cannot rewind"):
        target.rewind(target.committed - 1)


def test_paged_hybrid_long_call_keeps_its_final_state_only(paged_pipe):
    target = paged_pipe.target
    num = target.linear.max_checkpoints + 1
    target.reset()
    target.forward(np.arange(num) % 400, all_logits=False)
    with pytest.raises(ValueError, match="keeps only its final linear-attention state"):
        target.commit(num - 1)
    target.reset()
    assert len(target.linear.free) == target.linear.num_slots  # nothing leaked


def test_paged_hybrid_greedy_dflash_equals_ar(paged_pipe, pipe):
    """On 30 prompts: the paged runner's AR == the stateful hybrid runner's AR (== HF, above), and its
    greedy DFlash (random drafter with lookup, oracle drafter with partial accepts, auto block sizes
    with AR steps) == its AR."""
    vocab = 400
    stats_oracle = GenerationStats()
    for i, prompt in enumerate(random_prompts(30, vocab, seed=7)):
        max_new = 40 if i % 10 == 0 else 20
        ar = tokens(paged_pipe.generate_tokens(prompt, max_new, draft=False, eos_token_ids=[]))
        assert ar == tokens(pipe.generate_tokens(prompt, max_new, draft=False, eos_token_ids=[])), i
        block = ((2, 3, 4)[i % 3] if i % 4 == 3 else "auto" if i % 4 == 1 else None)
        assert tokens(paged_pipe.generate_tokens(prompt, max_new, block_size=block, eos_token_ids=[])) == ar, i
        drafter = OracleDrafter(prompt + ar, block_size=5, error_rate=0.3, vocab=vocab, seed=i)
        oracle = DFlashPipeline(paged_pipe.target, drafter, paged_pipe.tokenizer, [], 5, prompt_lookup=False)
        assert tokens(oracle.generate_tokens(prompt, max_new, eos_token_ids=[], stats=stats_oracle)) == ar, i
    hist = stats_oracle.acceptance_length_histogram
    assert {1, 2, 3, 4, 5} <= set(hist) and sum(hist[k] for k in (2, 3, 4)) > 40  # many partial accepts


def test_batched_hybrid_equals_single_runs(paged_pipe):
    """generate_batch on the hybrid (the batched paged runner: per-sequence state slots beside the KV
    blocks, several sequences per inference): greedy AR and DFlash, and seeded sampling, equal each
    prompt's single run; every slot is free afterwards."""
    prompts = random_prompts(7, 400, seed=11)
    for kwargs in (dict(draft=False), dict(block_size=4), dict(block_size="auto"),
                   dict(block_size=4, temperature=0.9, seed=5)):
        single = [tokens(paged_pipe.generate_tokens(p, 16, **kwargs)) for p in prompts]
        batch = paged_pipe.generate_batch(prompts, max_new_tokens=16, max_batch_size=3, stop=None, **kwargs)
        assert [list(r.token_ids) for r in batch] == single, kwargs
    linear = paged_pipe._batch.target.linear  # finished requests leave their last states shared, no other slot held
    assert not linear.committed and not linear.written and len(linear.free) + len(linear.shared) == linear.num_slots


def test_paged_hybrid_prefix_reuse_cuts_back_to_kept_states(paged_pipe, pair, tmp_path):
    """The paged hybrid runner keeps the linear-attention state at every multiple of
    `checkpoint_every` tokens (prefill and decode rounds alike), so a prompt that parts from the
    cached tokens reuses the longest kept prefix, and the reply equals a run without reuse."""
    ref = DFlashPipeline.from_pretrained(pair, cache_dir=tmp_path, target_runner="paged", prefix_cache=False,
                                         INFERENCE_NUM_THREADS=1, **STRICT_F32)
    ref.default_block_size = paged_pipe.default_block_size
    every = paged_pipe.target.linear.checkpoint_every
    assert every % paged_pipe.target.block_tokens == 0

    def run(pipe, prompt):
        stats = GenerationStats()
        out = tokens(pipe.generate_tokens(prompt, 3 * every // 4, eos_token_ids=[], stats=stats))
        return out, stats.num_cached_prompt_tokens

    rng = np.random.default_rng(9)
    prompt = rng.integers(0, 400, 2 * every - 10).tolist()
    out, _ = run(paged_pipe, prompt)
    assert out == run(ref, prompt)[0]
    assert sorted(paged_pipe.target.linear.kept_at[0]) == [every, 2 * every]  # prefill, then a decode round
    for cut, expected in ((every + 5, every), (2 * every + 3, 2 * every), (every - 1, 0)):
        follow = (prompt + out)[:cut] + rng.integers(0, 400, 4).tolist()
        got, cached = run(paged_pipe, follow)
        assert cached == expected and got == run(ref, follow)[0], cut
        run(paged_pipe, prompt)  # back to the long cached sequence
    linear = paged_pipe.target.linear
    held = len(linear.kept_at[0]) + 1 - (linear.committed[0] in linear.kept_at[0].values())
    assert len(linear.free) == linear.num_slots - held  # nothing leaked


def test_batched_hybrid_prefix_cache_shares_kept_states(paged_pipe):
    """The batched runner's prefix cache on the hybrid: a finished request leaves its KV blocks and the
    linear-attention states kept every `checkpoint_every` tokens; later requests (three at once, all
    reading one shared state) reuse the prefix up to the last kept state before they part, and reply
    as runs without any cache. The least recently used states go first; no slot leaks."""
    batch = paged_pipe.batch_target()
    linear, every = batch.linear, batch.linear.checkpoint_every
    assert batch.caches_prefixes and every % batch.block_tokens == 0 and linear.max_shared >= 2
    rng = np.random.default_rng(21)
    new = 6

    def run(prompts):
        results = paged_pipe.generate_batch(prompts, max_new_tokens=new, max_batch_size=3, stop=None, block_size=4)
        for prompt, result in zip(prompts, results):
            alone = tokens(paged_pipe.generate_tokens(prompt, new, block_size=4, prefix_cache=False))
            assert list(result.token_ids) == alone, len(prompt)
        return [r.stats.num_cached_prompt_tokens for r in results]

    def follow_ups(prompt, cuts):
        return [prompt[:cut] + rng.integers(0, 400, 4).tolist() for cut in cuts]

    prompt = rng.integers(0, 400, 2 * every + 5).tolist()
    assert run([prompt]) == [0]  # its prefill starts on a multiple: states at every and 2 * every
    assert run(follow_ups(prompt, (every + 5, 2 * every + 3, every - 1))) == [every, 2 * every, 0]
    assert run([prompt]) == [2 * every]

    kept = linear.max_shared
    try:
        linear.max_shared = 1  # the next share evicts every older state of its kind
        other = rng.integers(0, 400, 2 * every + 5).tolist()
        assert run([other]) == [0]
        assert len(linear.shared) - len(linear.turns) == 1 and len(linear.turns) == 1
        assert run(follow_ups(other, (every + 5, 2 * every + 3)) + [prompt]) == [0, 2 * every, 0]
    finally:
        linear.max_shared = kept
    assert not linear.committed and not linear.written and not linear.kept_at
    assert len(linear.free) + len(linear.shared) == linear.num_slots  # nothing leaked


def test_a_batched_hybrid_conversation_turn_reuses_every_committed_token(paged_pipe):
    """Turn 2's prompt extends every token turn 1 committed: turn 1 left its last linear-attention state
    shared under its partly filled last block, which turn 2 copies (KV and features) and starts from,
    so it prefills only its new tokens, and replies as a run without any cache, greedy and sampled. A
    prompt that parts inside turn 1's reply (as templates that drop a reply's reasoning do) starts from
    the state turn 1 shared where its prompt ended; one that parts inside turn 1's prompt, from a state
    kept every `checkpoint_every` tokens."""
    batch = paged_pipe.batch_target()
    every, b = batch.linear.checkpoint_every, batch.block_tokens
    rng = np.random.default_rng(5)
    new = 9
    for kwargs in (dict(block_size=4), dict(draft=False), dict(block_size=4, temperature=0.9, seed=3)):
        first = rng.integers(0, 400, every + 7).tolist()
        turn1 = paged_pipe.generate_batch([first], max_new_tokens=new, stop=None, **kwargs)[0]
        committed = len(first) + new - 1  # the last token sampled never had KV
        assert committed % b and committed % every, (committed, b, every)  # it ends mid-block, mid-interval
        second = first + list(turn1.token_ids) + rng.integers(0, 400, 5).tolist()
        in_reply = (first + list(turn1.token_ids))[:committed - 2] + rng.integers(0, 400, 3).tolist()
        in_prompt = first[:-3] + rng.integers(0, 400, 3).tolist()
        results = paged_pipe.generate_batch([second, in_reply, in_prompt], max_new_tokens=new, stop=None, **kwargs)
        assert [r.stats.num_cached_prompt_tokens for r in results] == [committed, len(first), every], kwargs
        for prompt, result in zip((second, in_reply, in_prompt), results):
            alone = tokens(paged_pipe.generate_tokens(prompt, new, prefix_cache=False, **kwargs))
            assert list(result.token_ids) == alone, kwargs
    linear = batch.linear
    assert not linear.committed and not linear.written and len(linear.free) + len(linear.shared) == linear.num_slots


def test_the_batched_server_reuses_a_hybrid_prefix(paged_pipe):
    """`ovdflash serve --max-num-seqs 4` on the hybrid: requests after a finished one that share its long
    system prompt report the reused tokens (a multiple of `checkpoint_every`) and reply as without a cache."""
    pytest.importorskip("fastapi")
    import openai
    from test_serve import serving_app

    from ovdflash.server.wiring import build_server_app

    system = "You are a careful assistant. Answer briefly and never make things up. " * 7
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": u}]
             for u in ("Name a colour.", "Say hello.", "Count to three.")]
    app = build_server_app(paged_pipe, ["tiny"], block_size=4, max_num_seqs=4)
    with serving_app(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        replies = [client.chat.completions.create(model="tiny", messages=m, max_tokens=6, temperature=0)
                   for m in chats]
    every = paged_pipe.batch_target().linear.checkpoint_every
    num_system = len(paged_pipe.tokenizer.encode_chat(chats[0][:1], add_generation_prompt=False))
    cached = [r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0 for r in replies]
    assert num_system >= 2 * every and cached[0] == 0, (num_system, every)
    assert all(c >= num_system // every * every and c % every == 0 for c in cached[1:]), cached
    texts = [paged_pipe.generate(m, max_new_tokens=6, block_size=4, prefix_cache=False).text for m in chats]
    assert [r.choices[0].message.content for r in replies] == texts


def test_the_batched_server_reuses_a_hybrid_conversation_turn(paged_pipe):
    """A conversation's second turn through `ovdflash serve --max-num-seqs 4` on the hybrid (token-id
    prompts: a random model's reply need not survive a detokenize-retokenize trip) reuses every token the
    first turn committed (its prompt and reply but the last token sampled), and replies as without a cache."""
    pytest.importorskip("fastapi")
    import openai
    from test_serve import serving_app

    from ovdflash.server.wiring import build_server_app

    new = 7
    prompt1 = paged_pipe.tokenizer.encode_chat([{"role": "user", "content": "Tell me about the sea. " * 6}])
    generated = tokens(paged_pipe.generate_tokens(prompt1, new, block_size=4, prefix_cache=False))
    prompt2 = prompt1 + generated + paged_pipe.tokenizer.encode("And the moon?", add_special_tokens=False)
    app = build_server_app(paged_pipe, ["tiny"], block_size=4, max_num_seqs=4)
    with serving_app(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        reply = client.completions.create(model="tiny", prompt=prompt1, max_tokens=new, temperature=0)
        turn2 = client.completions.create(model="tiny", prompt=prompt2, max_tokens=new, temperature=0)
    assert reply.choices[0].text == paged_pipe.tokenizer.decode(generated)
    committed = len(prompt1) + len(generated) - 1
    assert committed % paged_pipe.batch_target().block_tokens  # it ends inside a block
    assert turn2.usage.prompt_tokens_details.cached_tokens == committed
    alone = tokens(paged_pipe.generate_tokens(prompt2, new, block_size=4, prefix_cache=False))
    assert turn2.choices[0].text == paged_pipe.tokenizer.decode(alone)
