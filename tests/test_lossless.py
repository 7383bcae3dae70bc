"""Greedy DFlash is token-identical to the pipeline's own autoregressive output (real OpenVINO).

Tiny random qwen3 target + random drafter from the export fixtures, compiled with STRICT_F32
(f32 inference, f32 KV, no dynamic quantization) so that verify batches of B tokens and single
token steps compute the same numbers. Both target runners (paged attention, and the stateful
IR) are covered. Random drafters are mostly rejected, which exercises the rollback every round; an oracle drafter that proposes the AR continuation with random
corruptions exercises long accepted prefixes through the same real target. On the stateful runner,
compaction is forced with a low threshold, so the state trim path is covered too.
The default-precision comparison is a measurement: `-m slow -s` prints it. Why defaults can
differ: with a u8 KV cache, a verify block's tokens attend to each other's fresh (unquantized)
K/V, while autoregressive steps read them back quantized from the cache, so rows 1..B-1 of a
verify differ slightly from the AR steps (measured up to ~0.5 logits on SmolLM2 int8) and a
near-tie argmax can flip. f16 KV makes it rarer (it still flipped 2 of 6 Qwen2.5-Coder-0.5B runs),
f32 KV removes it, which is why every target gets f32 inference and an f32 KV cache by default
(`precision.compile_config`); a bf16 hint runs as f32 on a CPU without BF16.
"""
import numpy as np
import openvino as ov
import pytest

from ovdflash import STRICT_F32, DFlashPipeline
from ovdflash.decode.stats import GenerationStats

NUM_PROMPTS = 50


def random_prompts(n, vocab, seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.r_[1, 2, 3, rng.integers(1, 80, size=n - 3)]
    return [rng.integers(0, vocab, size=int(k)).tolist() for k in lengths]


def tokens(events):
    return [e.token for e in events]


@pytest.fixture(scope="module", params=["paged", "stateful"])
def strict_pipe(request, tiny_pair, tmp_path_factory):
    pipe = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("ov_cache"),
                                          INFERENCE_NUM_THREADS=1,  # tiny calls: 1 thread is faster
                                          target_runner=request.param, **STRICT_F32)
    if request.param == "stateful":
        pipe.target.compact_min_garbage = 24  # force compactions in short generations
    pipe.default_block_size = pipe.block_size  # fixed blocks here; tests/test_block_policy.py covers "auto"
    return pipe


def test_greedy_dflash_equals_autoregressive_over_many_prompts(strict_pipe):
    pipe = strict_pipe
    vocab = pipe.tokenizer.vocab_size
    stats = GenerationStats()
    compactions_before = pipe.target.num_compactions
    mismatches = []
    for i, prompt in enumerate(random_prompts(NUM_PROMPTS, vocab)):
        max_new = 120 if i % 10 == 0 else 32  # some long generations: many rollbacks
        ar = tokens(pipe.generate_tokens(prompt, max_new, draft=False, eos_token_ids=[]))
        block = (2, 3, 4, 1)[i % 4] if i % 5 == 4 else None  # mostly the trained block size (at most it)
        spec = tokens(pipe.generate_tokens(prompt, max_new, draft=True, block_size=block,
                                           eos_token_ids=[], stats=stats))
        if spec != ar:
            mismatches.append((i, len(prompt), next(j for j, (a, b) in enumerate(zip(ar, spec)) if a != b)))
    print(f"lossless: {NUM_PROMPTS - len(mismatches)}/{NUM_PROMPTS} identical; "
          f"rounds {stats.num_drafts}, drafts {stats.num_draft_tokens}, accepted {stats.num_accepted_tokens}, "
          f"compactions {pipe.target.num_compactions - compactions_before}, "
          f"lookup rounds {stats.num_lookup_drafts} ({stats.num_lookup_accepted_tokens} accepted)")
    assert not mismatches, mismatches
    assert stats.num_lookup_drafts > 0 and stats.num_lookup_drafts < stats.num_drafts  # both kinds of round
    assert stats.num_draft_tokens - stats.num_accepted_tokens > 500  # many rolled-back drafts
    if hasattr(pipe.target, "compact"):  # the stateful runner's state trim ran too
        assert pipe.target.num_compactions - compactions_before >= 1


def test_short_blocks_are_drafted_with_the_trained_block_and_cut(strict_pipe):
    """A verify of k drafts reads the first k drafts of a pass over the whole trained block."""
    drafter = strict_pipe.drafter
    feat = drafter.compiled.input("hidden_states").get_partial_shape()[2].get_length()
    rng = np.random.default_rng(5)
    differ = 0
    for n in (3, 9, 20, 33):
        feats = rng.standard_normal((n, feat)).astype(np.float32)
        last = int(rng.integers(0, 200))
        drafter.reset()
        whole = drafter.propose(last, feats, n, drafter.block_size - 1)
        for k in range(1, drafter.block_size - 1):
            drafter.reset()
            assert drafter.propose(last, feats, n, k).tolist() == whole[:k].tolist()
        drafter.draft_block = 0  # a pass of exactly k + 1 tokens
        drafter.reset()
        differ += drafter.propose(last, feats, n, 1).tolist() != whole[:1].tolist()
        drafter.draft_block = drafter.block_size
    assert len(whole) == drafter.block_size - 1
    print(f"a 2-token pass drafted another first token than the whole block in {differ} of 4 cases")


class OracleDrafter:
    """Proposes the known AR continuation, corrupted at a rate: long accepted prefixes on the real target."""

    def __init__(self, sequence, block_size=4, error_rate=0.25, vocab=256, seed=0):
        self.sequence, self.block_size, self.error_rate, self.vocab = sequence, block_size, error_rate, vocab
        self.rng = np.random.default_rng(seed)
        self.context_len = 0  # decode.round.DrafterRunner: it keeps no context, so any cut is exact

    def reset(self):
        self.context_len = 0

    def rewind(self, num_kept):
        self.context_len = num_kept

    def propose(self, last, ctx_feats, start, num_drafts):
        self.context_len = start
        drafts = np.array(self.sequence[start + 1:start + 1 + num_drafts] + [0] * num_drafts)[:num_drafts]
        corrupt = self.rng.random(num_drafts) < self.error_rate
        drafts[corrupt] = (drafts[corrupt] + 1) % self.vocab
        return drafts.astype(np.int64)


def test_long_accepted_prefixes_through_the_real_target(strict_pipe):
    pipe = strict_pipe
    vocab = pipe.tokenizer.vocab_size
    total = GenerationStats()
    for i, prompt in enumerate(random_prompts(8, vocab, seed=1)):
        ar = tokens(pipe.generate_tokens(prompt, 60, draft=False, eos_token_ids=[]))
        oracle = OracleDrafter(prompt + ar, block_size=5, vocab=vocab, seed=i)
        pipe_oracle = DFlashPipeline(pipe.target, oracle, pipe.tokenizer, [], 5, prompt_lookup=False)
        spec = tokens(pipe_oracle.generate_tokens(prompt, 60, eos_token_ids=[], stats=total))
        assert spec == ar
    assert set(total.acceptance_length_histogram) >= {1, 2, 3, 4, 5}


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["paged", "stateful"])
@pytest.mark.parametrize("config", [{}, {"KV_CACHE_PRECISION": "u8"}, {"INFERENCE_PRECISION_HINT": "bf16"}],
                         ids=["defaults", "u8-kv", "bf16"])
def test_default_precision_divergence_report(tiny_pair, tmp_path_factory, config, runner):
    """The pipeline's defaults (f32 KV, the plugin's dynamic quantization; f32 or bf16 compute by
    CPU), the plugin's u8 KV cache, and forced bf16: count prompts where DFlash and AR differ, and
    check each first divergence is a near-tie of the AR logits (a batch-shape rounding flip, not a
    logic error)."""
    pipe = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("ov_cache_def"),
                                          target_runner=runner, **config)
    props = {k: str(pipe.target.compiled.get_property(k)) for k in
             ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "DYNAMIC_QUANTIZATION_GROUP_SIZE")}
    if runner == "stateful":
        pipe.target.compact_min_garbage = 24  # compaction re-quantizes a u8 cache: cover it too
    vocab = pipe.tokenizer.vocab_size
    diverged, margins = 0, []
    for prompt in random_prompts(NUM_PROMPTS, vocab, seed=2):
        ar = tokens(pipe.generate_tokens(prompt, 48, draft=False, eos_token_ids=[]))
        spec = tokens(pipe.generate_tokens(prompt, 48, eos_token_ids=[]))
        if spec != ar:
            diverged += 1
            j = next(j for j, (a, b) in enumerate(zip(ar, spec)) if a != b)
            pipe.target.reset()
            logits, _ = pipe.target.forward(np.array(prompt + ar[:j], dtype=np.int64), all_logits=False)
            top2 = np.sort(logits[-1])[-2:]
            margins.append(round(float(top2[1] - top2[0]), 4))
            pipe.target.commit(len(prompt) + j)
    print(f"{runner} {props}: {diverged}/{NUM_PROMPTS} prompts diverge; top-2 margins at divergence {margins}; "
          f"compactions {pipe.target.num_compactions}")
    assert pipe.target.num_compactions > 0 or runner == "paged"
    assert all(m < 0.25 for m in margins), margins


def test_every_target_gets_an_f32_kv_cache_unless_told(tiny_pair, tmp_path_factory):
    """precision.compile_config: f32 KV for any model (a rounded cache lets DFlash drift
    from AR); the manifest's compile_options and the caller's settings win over it."""
    from ovdflash.ov.precision import compile_config

    assert compile_config({"target": {"source": "/x/qwen.gguf"}})[0]["KV_CACHE_PRECISION"] == "f32"
    assert compile_config({"compile_options": {"KV_CACHE_PRECISION": "u8"}})[0]["KV_CACHE_PRECISION"] == "u8"
    cache = tmp_path_factory.mktemp("ov_cache_kv")
    for runner in ("paged", "stateful"):
        pipe = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=cache, target_runner=runner)
        assert pipe.target.compiled.get_property("KV_CACHE_PRECISION") == ov.Type.f32
        if runner == "paged":
            assert {t for _, t, _ in pipe.target.cache_inputs} == {ov.Type.f32}
    told = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=cache, KV_CACHE_PRECISION="u8")
    assert told.target.compiled.get_property("KV_CACHE_PRECISION") == ov.Type.u8


def test_drafter_compiles_without_dynamic_quantization_unless_told(tiny_pair, tmp_path_factory):
    """compile.DRAFTER_DEFAULTS: the drafter alone drops dynamic quantization (cheaper for its
    few rows per call); the target keeps the plugin's choice; a user's setting wins for both."""
    cache = tmp_path_factory.mktemp("ov_cache_dq")
    key = "DYNAMIC_QUANTIZATION_GROUP_SIZE"
    pipe = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=cache)
    plugin_default = int(ov.Core().get_property("CPU", key))
    assert int(pipe.drafter.compiled.get_property(key)) == 0
    assert int(pipe.target.compiled.get_property(key)) == plugin_default != 0
    told = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=cache, **{key: "64"})
    assert int(told.drafter.compiled.get_property(key)) == int(told.target.compiled.get_property(key)) == 64


def test_fp16_target_compiles_without_the_compile_cache(export_tiny_pair, tmp_path_factory):
    """compile.FP16_UNCACHED: an fp16 target is compiled fresh (its cached import is slow on the
    CPU plugin), its drafter still goes through CACHE_DIR; an fp32 target is cached as before."""
    for fmt, expected_blobs in (("fp16", 1), ("fp32", 2)):
        cache = tmp_path_factory.mktemp(f"ov_cache_{fmt}")
        pair = export_tiny_pair(target_weight_format=fmt)
        pipe = DFlashPipeline.from_pretrained(pair, cache_dir=cache)
        blobs = list(cache.glob("*.blob"))
        assert len(blobs) == expected_blobs, (fmt, blobs)
