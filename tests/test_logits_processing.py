"""Penalties, logit bias and logprobs (decode.logits_processors, decode.sampling) keep DFlash lossless.

On the tiny random pair under STRICT_F32 (as tests/test_lossless.py): with each of presence, frequency,
repetition penalty and logit bias on, greedy DFlash equals greedy AR token for token, at blocks 4 and 8
with an oracle drafter that gets partial accepts (so rows inside a verified block must see the drafts
before them); seeded sampling too; the logprobs of DFlash equal AR's; AR's logprobs equal a plain-python
computation on the target's own logits; logit_bias moves the greedy choice; the batch scheduler
(generate_batch) gives the same tokens and logprobs; a request without logprobs carries none.
"""
import math
from collections import Counter

import numpy as np
import pytest

from ovdflash import STRICT_F32, DFlashPipeline
from ovdflash.decode.logits_processors import ProcessedRows, process_row
from ovdflash.decode.sampling import SamplingParams, token_logprob
from ovdflash.decode.stats import GenerationStats

from test_lossless import OracleDrafter, random_prompts  # tests/ is on sys.path under pytest

PROCESSINGS = {
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 0.7},
    "repetition": {"repetition_penalty": 1.8},
    "logit_bias": {"logit_bias": {i: (-4.0 if i % 2 else 3.0) for i in range(0, 512, 7)}},
}
SAMPLED = {"temperature": 0.9, "top_k": 40, "top_p": 0.95}


@pytest.fixture(scope="module")
def pipe(tiny_pair, tmp_path_factory):
    pipe = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("ov_cache_lp"),
                                          INFERENCE_NUM_THREADS=1, target_runner="paged", **STRICT_F32)
    pipe.default_block_size = pipe.block_size
    pipe.prefix_cache = False  # the oracle pipelines below share this target: nothing is kept between calls
    return pipe


def run(pipe, prompt, max_new, **kwargs):
    return list(pipe.generate_tokens(prompt, max_new, eos_token_ids=[], **kwargs))


def oracle_run(pipe, prompt, ar_tokens, block, oracle_seed, stats, max_new, **kwargs):
    oracle = OracleDrafter(prompt + ar_tokens, block_size=block, vocab=pipe.tokenizer.vocab_size, seed=oracle_seed)
    spec_pipe = DFlashPipeline(pipe.target, oracle, pipe.tokenizer, [], block, prompt_lookup=False, prefix_cache=False)
    spec_pipe.vocab_size = pipe.vocab_size
    return list(spec_pipe.generate_tokens(prompt, max_new, eos_token_ids=[], stats=stats, **kwargs))


# -- the processing itself --------------------------------------------------------------------------------
def reference_row(row, prompt, output, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """Token by token in plain python: bias, then repetition over prompt + output, then frequency / presence."""
    x = [float(v) for v in row]
    for t, b in (bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t, n in Counter(output).items():
        x[t] -= frequency * n + presence
    return np.array(x)


def reference_logprobs(x, temperature=0.0, top_k=0, top_p=1.0):
    """log p of every token: log-softmax (greedy), else temperature, top-k, top-p by a full sort."""
    x = np.asarray(x, dtype=np.float64) / (temperature or 1.0)
    if temperature and top_k:
        x[np.argsort(-x, kind="stable")[top_k:]] = -np.inf
    p = np.exp(x - x.max())
    p /= p.sum()
    if temperature and top_p < 1:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        cut = np.zeros_like(p)
        cut[order[before < top_p]] = p[order[before < top_p]]
        p = cut / cut.sum()
    with np.errstate(divide="ignore"):
        return np.log(p)


def test_process_row_equals_the_plain_python_rules():
    rng = np.random.default_rng(0)
    row = rng.standard_normal(50) * 3
    prompt, output = [1, 2, 3, 3], [3, 4, 4, 4, 9]
    bias = {7: 100.0, 8: -2.5}
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.7, logit_bias=bias)
    expected = reference_row(row, prompt, output, 0.5, 0.3, 1.7, bias)
    np.testing.assert_allclose(process_row(row, params, prompt, output), expected, rtol=1e-12)
    # row i of a block sees the drafts before it
    rows = ProcessedRows(np.stack([row, row, row]), params, prompt, output, [11, 11])
    np.testing.assert_allclose(rows[2], reference_row(row, prompt, output + [11, 11], 0.5, 0.3, 1.7, bias))
    assert not np.allclose(rows[0], rows[2])


@pytest.mark.parametrize("kwargs,words", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {3: 101}}, "logit_bias[3]"),
    ({"logit_bias": {-1: 1}}, "logit_bias keys"), ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
])
def test_bad_settings_are_one_line_errors_naming_them(kwargs, words):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_logit_bias_beyond_the_vocabulary_is_refused_before_generating(pipe):
    with pytest.raises(ValueError, match="logit_bias names token id 99999"):
        run(pipe, [1, 2, 3], 4, logit_bias={99999: 1.0})
    with pytest.raises(ValueError, match="logit_bias names token id 99999"):
        pipe.generate_batch([[1, 2, 3]], 4, logit_bias={99999: 1.0})


# -- DFlash equals AR with each processing on ------------------------------------------------------------
@pytest.mark.parametrize("name", list(PROCESSINGS))
def test_greedy_dflash_equals_ar_with_each_penalty_and_bias(pipe, name):
    processing = PROCESSINGS[name]
    stats, changed = GenerationStats(), 0
    for i, prompt in enumerate(random_prompts(6, pipe.tokenizer.vocab_size, seed=3)):
        ar = [e.token for e in run(pipe, prompt, 40, draft=False, **processing)]
        changed += ar != [e.token for e in run(pipe, prompt, 40, draft=False)]
        for block in (4, 8):
            spec = oracle_run(pipe, prompt, ar, block, i, stats, 40, **processing)
            assert [e.token for e in spec] == ar, (name, i, block)
        assert [e.token for e in run(pipe, prompt, 40, draft=True, **processing)] == ar  # the real drafter
    assert changed >= 3, f"{name} changed too few greedy outputs to test anything"
    assert set(stats.acceptance_length_histogram) >= {1, 2, 3, 4}  # partial accepts, long ones too
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0


def test_seeded_sampling_and_logprobs_equal_ar_with_everything_on(pipe):
    processing = {**PROCESSINGS["presence"], **PROCESSINGS["frequency"], **PROCESSINGS["repetition"],
                  **PROCESSINGS["logit_bias"]}
    stats = GenerationStats()
    for i, prompt in enumerate(random_prompts(4, pipe.tokenizer.vocab_size, seed=4)):
        for sampling in ({"temperature": 0.0}, {**SAMPLED, "seed": 100 + i}):
            ar = run(pipe, prompt, 32, draft=False, logprobs=5, **sampling, **processing)
            for block in (4, 8):
                spec = oracle_run(pipe, prompt, [e.token for e in ar], block, i, stats, 32, logprobs=5,
                                  **sampling, **processing)
                assert [e.token for e in spec] == [e.token for e in ar]
                assert_same_logprobs(spec, ar)
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0


def assert_same_logprobs(events_a, events_b):
    for a, b in zip(events_a, events_b, strict=True):
        assert a.logprob.token == b.logprob.token == a.token
        assert math.isclose(a.logprob.logprob, b.logprob.logprob, rel_tol=1e-5, abs_tol=1e-5)
        assert [t for t, _ in a.logprob.top] == [t for t, _ in b.logprob.top]
        np.testing.assert_allclose([v for _, v in a.logprob.top], [v for _, v in b.logprob.top], atol=1e-5)


# -- logprobs against the target's own logits ----------------------------------------------------------
def target_rows(pipe, prompt, output):
    """The target's logits for each output position, from one forward over prompt + output."""
    pipe.target.reset()
    pipe.prefix_store.invalidate()
    logits, _ = pipe.target.forward(np.array(prompt + output[:-1], dtype=np.int64), all_logits=True)
    rows = np.array(logits[len(prompt) - 1:])
    pipe.target.reset()
    pipe.prefix_store.invalidate()
    return rows


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {**SAMPLED, "seed": 7}], ids=["greedy", "sampled"])
def test_logprobs_equal_an_independent_computation_on_the_target_logits(pipe, sampling):
    processing = {"presence_penalty": 0.8, "frequency_penalty": 0.4, "repetition_penalty": 1.3,
                  "logit_bias": {5: 2.0, 6: -3.0}}
    prompt = [3, 14, 15, 92, 65, 35]
    events = run(pipe, prompt, 24, draft=True, logprobs=4, **sampling, **processing)
    output = [e.token for e in events]
    rows = target_rows(pipe, prompt, output)
    for t, (event, row) in enumerate(zip(events, rows, strict=True)):
        x = reference_row(row, prompt, output[:t], processing["presence_penalty"], processing["frequency_penalty"],
                          processing["repetition_penalty"], processing["logit_bias"])
        logp = reference_logprobs(x, sampling["temperature"], sampling.get("top_k", 0), sampling.get("top_p", 1.0))
        assert math.isclose(event.logprob.logprob, logp[event.token], abs_tol=1e-4), t
        top = np.argsort(-logp, kind="stable")[:4]
        assert [tok for tok, _ in event.logprob.top] == top.tolist(), t
        np.testing.assert_allclose([v for _, v in event.logprob.top], logp[top], atol=1e-4)
    if not sampling["temperature"]:
        assert output == [int(np.argmax(r)) for r in [
            reference_row(row, prompt, output[:t], 0.8, 0.4, 1.3, {5: 2.0, 6: -3.0}) for t, row in enumerate(rows)]]


def test_token_logprob_greedy_is_the_log_softmax_and_sampled_cuts_to_the_nucleus():
    row = np.array([2.0, 1.0, 0.0, -1.0])
    greedy = token_logprob(row, 0, SamplingParams(logprobs=2))
    np.testing.assert_allclose(greedy.logprob, 2.0 - np.log(np.exp(row).sum()))
    assert [t for t, _ in greedy.top] == [0, 1]
    sampled = token_logprob(row, 3, SamplingParams(temperature=1.0, top_k=2, logprobs=0))
    assert sampled.logprob == -np.inf and sampled.top == ()


# -- logit bias moves the choice ------------------------------------------------------------------------
def test_logit_bias_minus_100_changes_the_first_token_and_plus_100_forces_one(pipe):
    prompt = [10, 20, 30, 40]
    first = run(pipe, prompt, 1, draft=False)[0].token
    banned = run(pipe, prompt, 1, draft=False, logit_bias={first: -100})[0].token
    assert banned != first
    forced = (first + 1) % pipe.tokenizer.vocab_size
    for draft in (False, True):
        assert [e.token for e in run(pipe, prompt, 12, draft=draft, logit_bias={forced: 100})] == [forced] * 12


# -- the batch scheduler and the text API ---------------------------------------------------------------
def test_generate_batch_equals_generate_with_penalties_and_logprobs(pipe):
    processing = {"frequency_penalty": 0.7, "repetition_penalty": 1.4, "logit_bias": {9: 2.0}, "logprobs": 3}
    prompts = random_prompts(5, pipe.tokenizer.vocab_size, seed=6)
    for sampling in ({"temperature": 0.0}, {**SAMPLED, "seed": 11}):
        batch = pipe.generate_batch(prompts, 20, block_size=4, **sampling, **processing)
        for prompt, result in zip(prompts, batch):
            alone = pipe.generate(prompt, 20, block_size=4, **sampling, **processing)
            assert result.token_ids == alone.token_ids and result.text == alone.text
            assert len(result.logprobs) == len(result.token_ids)
            assert [lp.token for lp in result.logprobs] == result.token_ids
            np.testing.assert_allclose([lp.logprob for lp in result.logprobs],
                                       [lp.logprob for lp in alone.logprobs], atol=1e-5)


def test_without_logprobs_no_event_carries_any(pipe):
    events = run(pipe, [1, 2, 3], 8, draft=True, presence_penalty=0.5)
    assert all(e.logprob is None for e in events)
    assert pipe.generate([1, 2, 3], 4).logprobs is None
