"""Acceptance and warping in pure numpy, with hand-made logits."""
import numpy as np
import pytest
from scipy import stats as sps

from ovdflash.decode.sampling import SamplingParams, accept, accept_greedy, accept_sampled, sample_token, warp_probs

NEG = -1e9


def rows_with_argmax(argmaxes, vocab=8):
    logits = np.zeros((len(argmaxes), vocab), dtype=np.float32)
    logits[np.arange(len(argmaxes)), argmaxes] = 5.0
    return logits


def test_greedy_all_accepted_plus_bonus():
    drafts = np.array([3, 1, 4])
    logits = rows_with_argmax([3, 1, 4, 6])
    assert accept(drafts, logits, SamplingParams(), None) == (3, 6)


def test_greedy_first_rejected():
    logits = rows_with_argmax([2, 1, 4, 6])
    assert accept(np.array([3, 1, 4]), logits, SamplingParams(), None) == (0, 2)


def test_greedy_rejected_in_the_middle():
    assert accept_greedy(np.array([3, 1, 4]), np.array([3, 1, 5, 6])) == (2, 5)


def test_greedy_later_match_after_mismatch_does_not_count():
    assert accept_greedy(np.array([3, 1, 4]), np.array([3, 0, 4, 6])) == (1, 0)


def test_sampled_certain_target_accepts_all_and_samples_bonus():
    rng = np.random.default_rng(0)
    logits = np.full((4, 8), NEG, dtype=np.float64)
    logits[[0, 1, 2], [3, 1, 4]] = 0.0
    logits[3, 6] = 0.0
    for _ in range(50):
        assert accept_sampled(np.array([3, 1, 4]), logits, SamplingParams(temperature=1.0), rng) == (3, 6)


def test_sampled_impossible_draft_is_rejected_and_never_emitted():
    rng = np.random.default_rng(0)
    logits = np.zeros((4, 8))
    logits[0, 3] = NEG  # the target never emits the first draft
    out = [accept_sampled(np.array([3, 1, 4]), logits, SamplingParams(temperature=1.0), rng) for _ in range(300)]
    assert all(a == 0 and t != 3 for a, t in out)
    assert len({t for _, t in out}) == 7  # the residual is the other 7 tokens


def test_sampled_rejected_token_removed_from_residual():
    # p = [0.5, 0.5]; draft 0 accepted half the time; on rejection the residual is exactly token 1
    rng = np.random.default_rng(1)
    logits = np.zeros((2, 2))
    out = [accept_sampled(np.array([0]), logits, SamplingParams(temperature=1.0), rng) for _ in range(4000)]
    rejected = [t for a, t in out if a == 0]
    assert set(rejected) == {1}
    assert abs(len(rejected) / 4000 - 0.5) < 0.03


def test_one_hot_acceptance_emits_target_distribution():
    # first emitted token must be distributed as p for any draft (Leviathan with q = onehot)
    rng = np.random.default_rng(2)
    logits = np.log(np.array([[0.1, 0.2, 0.3, 0.4, 1e-12], [0.25] * 4 + [1e-12]]))
    params = SamplingParams(temperature=1.0)
    p = warp_probs(logits[0], params)
    for draft in (0, 3):
        first = []
        for _ in range(20000):
            a, t = accept_sampled(np.array([draft]), logits, params, rng)
            first.append(draft if a == 1 else t)
        counts = np.bincount(first, minlength=5)[:4]
        assert sps.chisquare(counts, 20000 * p[:4] / p[:4].sum()).pvalue > 1e-3


def test_warp_temperature():
    logits = np.array([1.0, 2.0, 3.0])
    expected = np.exp(logits / 0.5) / np.exp(logits / 0.5).sum()
    np.testing.assert_allclose(warp_probs(logits, SamplingParams(temperature=0.5)), expected)


def test_warp_top_k():
    probs = warp_probs(np.array([1.0, 4.0, 3.0, 2.0]), SamplingParams(temperature=1.0, top_k=2))
    expected = np.array([0, np.e ** 4, np.e ** 3, 0]) / (np.e ** 4 + np.e ** 3)
    np.testing.assert_allclose(probs, expected)


def test_warp_top_p_keeps_smallest_set_reaching_p():
    base = np.log(np.array([0.1, 0.5, 0.3, 0.1]))
    # 0.5 < 0.7 -> keep 0.5 and 0.3 (mass 0.8 reaches 0.7)
    np.testing.assert_allclose(warp_probs(base, SamplingParams(temperature=1.0, top_p=0.7)),
                               [0, 0.625, 0.375, 0], atol=1e-12)
    # top_p exactly reached by the first token keeps only it
    np.testing.assert_allclose(warp_probs(base, SamplingParams(temperature=1.0, top_p=0.5)),
                               [0, 1, 0, 0], atol=1e-12)


def test_warp_order_is_temperature_then_top_k_then_top_p():
    logits = np.array([0.0, 1.0, 2.0, 3.0])
    params = SamplingParams(temperature=2.0, top_k=3, top_p=0.6)
    x = np.exp(np.array([1.0, 2.0, 3.0]) / 2.0)
    x /= x.sum()  # after temperature and top-k: tokens 1,2,3
    keep = x[2] < 0.6  # token 3 alone is not enough -> keep tokens 3 and 2
    assert keep
    expected = np.array([0, 0, x[1], x[2]]) / (x[1] + x[2])
    np.testing.assert_allclose(warp_probs(logits, params), expected)


def test_greedy_sample_token_is_argmax_regardless_of_top_k_top_p():
    logits = np.array([0.2, 3.0, -1.0])
    assert sample_token(logits, SamplingParams(top_k=2, top_p=0.3), None) == 1


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=float("nan")),
                                    dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                    dict(top_k=2.5), dict(seed=-3), dict(temperature="1")])
def test_parameters_that_cannot_be_honoured_are_errors(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def reference_top_p(probs, top_p):
    order = np.argsort(-probs, kind="stable")
    mass_before = np.cumsum(probs[order]) - probs[order]
    out = np.zeros_like(probs)
    kept = order[mass_before < top_p]
    out[kept] = probs[kept]
    return out / out.sum()


@pytest.mark.parametrize("vocab", [5, 300, 5000])
def test_fast_top_p_equals_a_full_sort(vocab):
    rng = np.random.default_rng(vocab)
    for trial in range(30):
        logits = rng.standard_normal(vocab) * rng.choice([0.1, 1.0, 5.0])
        if trial % 3 == 0:
            logits = np.round(logits, 1)  # many exact ties, also across the candidate boundary
        for top_p in (0.05, 0.5, 0.9, 0.999):
            for top_k in (0, 3, 100):
                params = SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k)
                full = warp_probs(logits, SamplingParams(temperature=1.0, top_k=top_k))
                np.testing.assert_array_equal(warp_probs(logits, params), reference_top_p(full, top_p))
