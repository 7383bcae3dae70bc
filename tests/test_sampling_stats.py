"""Statistical test: DFlash sampling draws from the same distribution as plain AR sampling.

On a mock target with an 8-token vocab we enumerate the exact distribution of the first five
generated tokens (8^5 sequences) and test samples from both modes against it with Pearson's
chi-square (cells with expected count < 5 pooled). Threshold: p > 1e-3 per test; seeds are fixed,
so the test is deterministic. A negative control shows the test has the power to catch the
classic bug (on rejection, resampling from p without removing the rejected draft).
The same comparison then runs once through the real tiny OpenVINO target (two-sample contingency,
DFlash vs AR), with the target as its own drafter so that both acceptance and residual paths run.
"""

import numpy as np
import pytest
from mock_models import MockDrafter, MockTarget
from scipy import stats as sps

from ovdflash.decode import round as decode_round
from ovdflash.decode import sequence
from ovdflash.decode.sampling import SamplingParams, sample_from, warp_probs

P_THRESHOLD = 1e-3
VOCAB = 8
PROMPT = [1, 2]
NUM_TOKENS = 5          # prefill token + one full block of 4 (3 drafts + bonus)
NUM_SAMPLES = 3000
SETTINGS = {
    "temperature": SamplingParams(temperature=1.0),
    "top_k": SamplingParams(temperature=0.8, top_k=3),
    "top_p": SamplingParams(temperature=1.3, top_p=0.8),
}


def exact_joint(target, params, prompt=PROMPT):
    """{sequence of NUM_TOKENS tokens: probability} by enumerating the plain AR process."""
    joint = {(): 1.0}
    for _ in range(NUM_TOKENS):
        nxt = {}
        for seq, p in joint.items():
            probs = warp_probs(target.logits_fn(prompt + list(seq)), params)
            for t in np.flatnonzero(probs):
                nxt[seq + (int(t),)] = p * probs[t]
        joint = nxt
    return joint


def marginal(dist_or_samples, positions, weights=None):
    out = {}
    for seq, w in dist_or_samples.items():
        key = tuple(seq[i] for i in positions)
        out[key] = out.get(key, 0.0) + w
    return out


def chisquare_p(sample_counts, expected_probs, n):
    keys = sorted(expected_probs)
    expected = np.array([expected_probs[k] * n for k in keys])
    observed = np.array([sample_counts.get(k, 0) for k in keys], dtype=float)
    assert sum(sample_counts.values()) == n and set(sample_counts) <= set(keys), "impossible token sampled"
    small = expected < 5
    if small.any():  # pool rare cells into one
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    return sps.chisquare(observed, expected).pvalue


def sample_counts(target, drafter, params, n, prompt=PROMPT, lookup=None, stats=None):
    counts = {}
    for i in range(n):
        p = SamplingParams(params.temperature, params.top_p, params.top_k, seed=i)
        seq = tuple(e.token for e in sequence.generate(target, drafter, prompt, NUM_TOKENS, p, stats=stats,
                                                     lookup=lookup))
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def p_values(target, drafter, params, prompt=PROMPT, lookup=None, stats=None):
    joint = exact_joint(target, params, prompt)
    counts = sample_counts(target, drafter, params, NUM_SAMPLES, prompt, lookup, stats)
    checks = [(0,), (1,), (2,), (3,), (4,), (1, 2), (3, 4)]
    return {pos: chisquare_p(marginal(counts, pos), marginal(joint, pos), NUM_SAMPLES) for pos in checks}


@pytest.fixture(scope="module")
def mock_pair():
    target = MockTarget(vocab_size=VOCAB, seed=11, sharpness=1.2)
    drafter = MockDrafter(target, block_size=4, error_rate=0.3, seed=5)
    return target, drafter


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_dflash_sampling_matches_exact_ar_distribution(mock_pair, setting):
    target, drafter = mock_pair
    params = SETTINGS[setting]
    spec = p_values(target, drafter, params)
    ar = p_values(target, None, params)
    print(setting, "dflash", {k: round(v, 4) for k, v in spec.items()}, "ar", {k: round(v, 4) for k, v in ar.items()})
    assert min(spec.values()) > P_THRESHOLD, spec
    assert min(ar.values()) > P_THRESHOLD, ar


LOOKUP_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats itself: n-gram lookup drafts from the first round


@pytest.mark.parametrize("setting", ["temperature", "top_p"])
def test_sampling_with_lookup_drafts_matches_exact_ar_distribution(mock_pair, setting):
    """Lookup drafts are one-hot proposals too: the emitted tokens keep the AR distribution."""
    from ovdflash.decode.lookup import NgramLookup
    from ovdflash.decode.stats import GenerationStats
    target, drafter = mock_pair
    stats = GenerationStats()
    spec = p_values(target, drafter, SETTINGS[setting], LOOKUP_PROMPT, NgramLookup(), stats)
    print(setting, "dflash+lookup", {k: round(v, 4) for k, v in spec.items()})
    assert min(spec.values()) > P_THRESHOLD, spec
    # both kinds of round ran, and lookup drafts were both accepted and rejected
    assert 0 < stats.num_lookup_drafts < stats.num_drafts
    assert 0 < stats.num_lookup_accepted_tokens < stats.num_lookup_draft_tokens


def test_negative_control_biased_residual_is_detected(mock_pair, monkeypatch):
    def biased_accept(drafts, logits, params, randomness, first_position):
        for i in range(len(drafts) + 1):
            rng = randomness.at(first_position + i)
            token = sample_from(warp_probs(logits[i], params), rng)
            if i == len(drafts) or token != drafts[i]:  # bug: a second draw on a miss may be the rejected draft
                return i, sample_from(warp_probs(logits[i], params), rng) if i < len(drafts) else token
        raise AssertionError

    monkeypatch.setattr(decode_round, "accept_at_positions", biased_accept)
    target, drafter = mock_pair
    assert min(p_values(target, drafter, SETTINGS["temperature"]).values()) < P_THRESHOLD


def test_mock_round_used_both_accept_and_reject_paths(mock_pair):
    from ovdflash.decode.stats import GenerationStats
    target, drafter = mock_pair
    stats = GenerationStats()
    for seed in range(200):
        list(sequence.generate(target, drafter, PROMPT, NUM_TOKENS, SamplingParams(temperature=1.0, seed=seed),
                             stats=stats))
    assert set(stats.acceptance_length_histogram) == {1, 2, 3, 4}


OV_SAMPLES = 1200


class SelfDrafter:
    """The target as its own drafter (mlx-lm's trick): greedy continuation from a second request on
    the same compiled target, so drafts are often accepted under sampling, and often not."""

    block_size = 4

    def __init__(self, target_runner_cls, compiled, max_length, prompt):
        self.runner = target_runner_cls(compiled, max_length)
        self.prompt = list(prompt)

    def reset(self):
        self.tokens, self.prev = list(self.prompt), None
        self.context_len = 0

    def rewind(self, num_kept):
        raise NotImplementedError("it rebuilds its context from its prompt, not from features: no prefix reuse")

    def propose(self, last, ctx_feats, start, num_drafts):
        self.context_len = start
        if self.prev is not None:  # the committed tokens since the last round: prev last + accepted drafts
            prev_last, prev_drafts, prev_start = self.prev
            self.tokens += [prev_last] + prev_drafts[: start - prev_start - 1]
        assert len(self.tokens) == start
        self.runner.reset()
        logits, _ = self.runner.forward(np.array(self.tokens + [last]), all_logits=False)
        drafts = [int(np.argmax(logits[-1]))]
        self.runner.commit(start + 1)
        while len(drafts) < num_drafts:
            logits, _ = self.runner.forward(np.array(drafts[-1:]), all_logits=True)
            self.runner.commit(1)
            drafts.append(int(np.argmax(logits[-1])))
        self.prev = (last, drafts, start)
        return np.array(drafts, dtype=np.int64)


def test_dflash_sampling_matches_ar_on_the_real_tiny_model(tiny_pair, tmp_path):
    """Two-sample chi-square (contingency) of tokens 1..3 under DFlash vs AR on the OpenVINO pair."""
    from ovdflash import STRICT_F32, DFlashPipeline

    # one thread: these calls are tiny, and thread hand-offs would dominate on a shared 2-core box
    pipe = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path, INFERENCE_NUM_THREADS=1, **STRICT_F32)
    pipe.default_block_size = SelfDrafter.block_size  # fixed blocks: every round drafts
    params = dict(temperature=0.8, top_k=6)
    prompt = [5, 17, 33]
    pipe.drafter = SelfDrafter(type(pipe.target), pipe.target.compiled, pipe.target.max_length, prompt)
    pipe.prefix_cache = False  # SelfDrafter cannot rewind: every call starts afresh

    def draw(draft):
        out = []
        for seed in range(OV_SAMPLES):
            seed = seed + (10 ** 6 if draft else 0)  # independent samples in the two modes
            out.append([e.token for e in pipe.generate_tokens(prompt, 4, draft=draft, seed=seed,
                                                              eos_token_ids=[], **params)])
        return np.array(out)

    ar, spec = draw(False), draw(True)
    accepted = pipe.stats.num_accepted_tokens
    assert accepted > 200 and pipe.stats.num_draft_tokens - accepted > 200  # both paths ran, often
    p_values = {}
    for pos in (1, 2, 3):
        values = sorted(set(ar[:, pos]) | set(spec[:, pos]))
        table = np.array([[np.sum(ar[:, pos] == v) for v in values], [np.sum(spec[:, pos] == v) for v in values]])
        keep = table.sum(0) >= 10  # pool rare tokens
        table = np.c_[table[:, keep], table[:, ~keep].sum(1, keepdims=True)]
        table = table[:, table.sum(0) > 0]
        p_values[pos] = sps.chi2_contingency(table).pvalue
    print("OV two-sample p-values", p_values, "acceptance rate", pipe.stats.acceptance_rate)
    assert min(p_values.values()) > P_THRESHOLD, p_values


def test_sample_from_is_exact_and_a_near_copy_of_the_row_draws_the_same_token():
    """The draw follows `probs` (chi-square), and rows that differ by float32-level noise (another
    kernel path's logits) give the same token for the same randomness in almost every draw."""
    rng = np.random.default_rng(0)
    vocab = 49_152
    logits = rng.standard_normal(vocab) * 3.0  # a long tail of small probabilities
    params = SamplingParams(temperature=1.0)
    probs = warp_probs(logits, params)
    near = warp_probs(logits + 1e-4 * rng.standard_normal(vocab), params)  # 1e-4: f32 accumulation-order noise
    same = sum(sample_from(probs, np.random.default_rng([7, i])) == sample_from(near, np.random.default_rng([7, i]))
               for i in range(400))
    assert same >= 398, f"only {same} of 400 draws agreed across a 1e-4 perturbation of the logits"

    few = np.array([0.5, 0.3, 0.15, 0.05, 0.0])
    draws = np.bincount([sample_from(few, np.random.default_rng([3, i])) for i in range(4000)], minlength=5)
    assert draws[4] == 0  # a zero-probability token is never drawn
    assert sps.chisquare(draws[:4], 4000 * few[:4]).pvalue > 1e-3
