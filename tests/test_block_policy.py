"""Automatic block size (ovdflash.decode.block_policy): the choice maths, the acceptance estimates,
exploration, cost measurement, and losslessness of policy-driven generation (mocks and the real
tiny OpenVINO pair under STRICT_F32).

The cost-measurement tests run on a virtual clock: their mock targets advance it by a known
cost per forward instead of sleeping, so what they check does not depend on how busy the
machine is (a sleeping version failed once in CI on a noisy host)."""
import numpy as np
import pytest
from mock_models import MockDrafter, MockTarget

from ovdflash import STRICT_F32, DFlashPipeline
from ovdflash.decode import block_policy, sequence
from ovdflash.decode.block_policy import BatchDraftPolicy, BlockPolicy, extend_linearly, measure_costs, nondecreasing
from ovdflash.decode.sampling import SamplingParams
from ovdflash.decode.sequence import generate
from ovdflash.decode.stats import GenerationStats

GREEDY = SamplingParams()
# a verify curve rising 3 ms per token after a 25 ms single step (ms for 1..8 tokens), a 4 ms draft
STEP_MS = [25.0, 28.0, 31.0, 34.0, 37.0, 40.0, 43.0, 46.0]
DRAFT_MS = [0.0] + [4.0] * 7


def smollm_like_policy(**kwargs):
    return BlockPolicy([m / 1e3 for m in STEP_MS], [m / 1e3 for m in DRAFT_MS], **kwargs)


def tokens(events):
    return [e.token for e in events]


def brute_force_rates(policy, p):
    """E[accepted+1](k) / cost(k), summing over the outcomes a = 0..k of a round with k drafts."""
    rates = []
    for k in range(policy.max_drafts + 1):
        expected = 0.0
        for a in range(k + 1):
            prob = np.prod(p[:a]) * ((1 - p[a]) if a < k else 1.0)
            expected += prob * (a + 1)
        rates.append(expected / policy.round_cost_s[k])
    return rates


def test_expected_rate_matches_a_brute_force_sum_over_outcomes():
    policy = smollm_like_policy()
    rng = np.random.default_rng(0)
    for _ in range(100):
        k = int(rng.integers(1, 8))
        policy.observe_round(k, int(rng.integers(0, k + 1)))
        assert policy.expected_tokens_per_s() == pytest.approx(brute_force_rates(policy, policy.acceptance()))


def test_observe_round_counts_accepted_rejected_and_unseen_positions():
    policy = smollm_like_policy(decay=1.0, prior_strength=0.0)  # raw counts
    policy.observe_round(5, 2)     # drafts 1, 2 accepted, 3 rejected, 4 and 5 never judged
    policy.observe_round(3, 3)     # all three accepted
    assert policy.seen == [2, 2, 2, 0, 0, 0, 0]
    assert policy.accepted == [2, 2, 1, 0, 0, 0, 0]
    policy = smollm_like_policy(decay=0.5, prior_acceptance=0.3, prior_strength=2.0)
    policy.observe_round(1, 0)
    policy.observe_round(1, 0)
    # counts decay (1 * 0.5 + 1), the prior stays: (0 + 0.6) / (1.5 + 2)
    assert policy.acceptance()[0] == pytest.approx(0.6 / 3.5)
    # an unseen position takes its prior from the position before it
    assert policy.acceptance()[1:] == pytest.approx([0.6 / 3.5] * 6)
    policy.observe_round(2, 2)
    p1 = (0 + 1 + 0.6) / (0.5 * 1.5 + 1 + 2)   # accepted: 0 decayed + 1; seen: 1.5 decayed + 1
    assert policy.acceptance()[:2] == pytest.approx([p1, (1 + 2 * p1) / 3])


def test_costs_in_use_correct_the_calibration_robustly():
    policy = smollm_like_policy(cost_update_rate=0.5, drift_rate=0.0, decay=0.9)   # per-k learning only
    policy.observe_round(1, 0, seconds=1.0)            # the first round after the prefill teaches nothing
    assert policy.round_cost_s[1] == pytest.approx(0.032) and policy.switch_cost_s == 0.0
    policy.observe_round(1, 0, seconds=0.035)          # a repeated k=1 round cost 35 ms, not the 32 calibrated
    assert policy.round_cost_s[1] == pytest.approx(0.032 + 0.5 * 0.003)
    policy.observe_round(0, 0, seconds=0.033)          # an AR step right after it: 8 ms over the steady 25
    assert policy.round_cost_s[0] == pytest.approx(0.025) and policy.switch_cost_s == pytest.approx(0.5 * 0.008)
    policy.observe_round(0, 0, seconds=10.0)           # a descheduled AR step: clipped to 2x
    assert policy.round_cost_s[0] == pytest.approx(0.025 + 0.5 * 0.025)
    policy.observe_round(1, 0, seconds=10.0)           # a descheduled switch: at most one more round
    assert policy.switch_cost_s == pytest.approx(0.004 + 0.5 * (policy.round_cost_s[1] - 0.004))
    assert policy.seen[0] == pytest.approx((1 * 0.9 + 1) * 0.9 + 1)  # 3 k=1 rounds; AR steps judge no draft
    # a k=1 round that really costs 1.5 AR steps stops paying at a conditional acceptance of 0.3
    policy = smollm_like_policy(prior_strength=1e6, prior_acceptance=0.3, drift_rate=0.0)
    assert policy.choose(1) == 1                        # calibrated: 32 ms for 1.3 tokens vs 25 ms for 1
    for _ in range(40):
        for _ in range(2):
            policy.observe_round(1, 0, seconds=0.0375)
        for _ in range(2):
            policy.observe_round(0, 0, seconds=0.025)
    assert policy.choose(1) == 0


def test_a_switch_cost_keeps_the_previous_choice_unless_another_pays_for_it():
    # steady costs: AR 25 ms for 1 token, k=1 32 ms for 1 + p tokens: break-even at p = 0.28
    def policy_at(p, previous, switch_ms):
        policy = smollm_like_policy(switch_cost_s=switch_ms / 1e3, prior_strength=1e6, prior_acceptance=p)
        policy.observe_round(previous, 0)
        return policy.choose(1)
    for previous in (0, 1):   # far from break-even the rates decide, wherever the policy comes from
        assert policy_at(0.10, previous, 8.0) == 0 and policy_at(0.50, previous, 8.0) == 1
    # near it, an 8 ms switch spread over 8 rounds (1 ms a round) keeps the current k
    assert policy_at(0.30, 0, 8.0) == 0 and policy_at(0.30, 1, 8.0) == 1
    assert policy_at(0.25, 0, 8.0) == 0 and policy_at(0.25, 1, 8.0) == 1
    assert policy_at(0.30, 0, 0.0) == 1 and policy_at(0.25, 1, 0.0) == 0   # no switch cost: no memory
    policy = smollm_like_policy(switch_cost_s=0.008, prior_strength=1e6, prior_acceptance=0.30)
    policy.observe_round(0, 0)
    policy.begin_sequence()   # a new sequence: every k is a new shape, no k is favoured
    assert policy.choose(1) == 1
    with pytest.raises(ValueError):
        smollm_like_policy(switch_cost_s=-0.001)


@pytest.mark.parametrize("p, expected", [(0.0, 0), (0.99, 7)])
def test_choice_follows_acceptance(p, expected):
    policy = smollm_like_policy()
    for _ in range(200):  # acceptance at every position p (as a drafter with that rate would show)
        policy.observe_round(7, 7 if p > 0.5 else 0)
    assert policy.choose(7) == expected
    assert policy.choose(3) == min(expected, 3)   # never more than the room allows


def test_choice_is_the_best_cost_tradeoff_not_the_longest_block():
    # a conditional acceptance of 0.6: drafting pays, but not all the way to 7 drafts
    policy = smollm_like_policy(prior_strength=1e6, prior_acceptance=0.6)
    rates = policy.expected_tokens_per_s()
    k = policy.choose(7)
    assert k == int(np.argmax(rates)) and 0 < k < 7
    # a flat verify curve (memory-bound target) makes long blocks worth it at the same acceptance
    flat = BlockPolicy([0.030] * 8, [0.0] + [0.001] * 7, prior_strength=1e6, prior_acceptance=0.6)
    assert flat.choose(7) == 7


def test_exploration_drafts_again_after_falling_back_to_ar():
    policy = smollm_like_policy(explore_every=10, max_explore_every=40, probe_rounds=1, decay=0.9)
    for _ in range(100):
        policy.observe_round(3, 0)
    choices = [policy.choose(7) for _ in range(200)]
    probes = [i for i, k in enumerate(choices) if k]
    # one draft round after 10 AR steps, then after 20, 40, 40, ...: failed probes back off
    assert probes == [10, 31, 72, 113, 154, 195]
    # without exploration the estimates would freeze; with it a drafter that got good is
    # noticed within a few probes: the policy then drafts every round, with growing blocks
    choices, num_probes = [], 0
    while len(choices) < 2000 and not (len(choices) > 2 and choices[-1] and choices[-2]):
        k = policy.choose(7)
        choices.append(k)
        if k:
            num_probes += 1
            policy.observe_round(k, k)
    assert choices[-1] and choices[-2] and num_probes <= 5
    for _ in range(20):
        k = policy.choose(7)
        policy.observe_round(k, k)
    assert policy.choose(7) == 7
    assert policy.explore_wait == 10   # drafting again: the next fallback probes soon


def test_a_probe_lasts_probe_rounds_and_backs_off():
    policy = smollm_like_policy(explore_every=10, max_explore_every=40, probe_rounds=3)
    for _ in range(100):
        policy.observe_round(3, 0)
    choices = [policy.choose(7) for _ in range(120)]
    drafted = [i for i, k in enumerate(choices) if k]
    # 10 AR steps, a 3-round probe, 20 AR steps, a probe, 40 AR steps, ...
    assert drafted == [10, 11, 12, 33, 34, 35, 76, 77, 78, 119]
    assert len({choices[i] for i in drafted}) == 1   # one k for the whole probe


def simulate_rounds(policy, true_round_ms, acceptance, rounds, switch_ms=12.0, seed=0):
    """Rounds of a policy against known costs: i.i.d. acceptance per draft position, a switch
    cost on every change of k. Returns (tokens per second, fraction of rounds that drafted)."""
    rng = np.random.default_rng(seed)
    made, seconds, drafted, previous = 0, 0.0, 0, None
    policy.begin_sequence()
    for _ in range(rounds):
        k = policy.choose(len(true_round_ms) - 1)
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        ms = true_round_ms[k] + (switch_ms if previous is not None and k != previous else 0.0)
        policy.observe_round(k, accepted, ms / 1e3)
        made, seconds, drafted, previous = made + accepted + 1, seconds + ms / 1e3, drafted + (k > 0), k
    return made / seconds, drafted / rounds


def test_probes_correct_a_calibration_that_overrates_drafting_costs():
    # measured on SmolLM2 (2 cores): AR 31 ms, a 1-draft round 42 ms, 0.53 accepted; the calibration
    # had put that round at 47 ms, where AR looks better (1 / 31 > 1.53 / 47)
    true_ms, calibrated_ms = [31.0, 42.0, 49.0], [31.0, 47.0, 54.0]
    def calibrated(**kwargs):
        return BlockPolicy([m / 1e3 for m in calibrated_ms], [0.0] * 3, switch_cost_s=0.012, **kwargs)
    assert calibrated().choose(2) >= 1   # the prior (0.5) drafts first; the data must keep it drafting
    best_fixed = max((1 + 0.53 + (0.53 ** 2 if k == 2 else 0)) / true_ms[k] * 1e3 for k in (1, 2))
    rate, drafting = simulate_rounds(calibrated(), true_ms, 0.53, 3000)
    assert drafting > 0.9 and rate > 0.97 * best_fixed
    # a probe of one round is always a switch, so it never measures the steady cost: stuck in AR
    rate, drafting = simulate_rounds(calibrated(probe_rounds=1, drift_rate=0.0), true_ms, 0.53, 3000)
    assert drafting < 0.6 and rate < 0.95 * best_fixed
    # and a drafter that does not pay still ends in AR
    rate, drafting = simulate_rounds(calibrated(), true_ms, 0.15, 3000)
    assert drafting < 0.15 and rate > 0.95 * 1e3 / true_ms[0]


def test_a_machine_wide_slowdown_moves_every_cost():
    policy = smollm_like_policy(cost_update_rate=0.1, drift_rate=0.5, switch_cost_s=0.008)
    policy.observe_round(0, 0, 0.025)
    before = list(policy.round_cost_s)
    policy.observe_round(0, 0, seconds=0.025 * 1.44)   # AR steps 44 % slower: the whole VM slowed
    drift = 1.44 ** 0.5
    assert policy.round_cost_s[1:] == pytest.approx([c * drift for c in before[1:]])
    assert policy.switch_cost_s == pytest.approx(0.008 * drift)
    assert policy.round_cost_s[0] == pytest.approx(0.025 * drift + 0.1 * (0.025 * 1.44 - 0.025 * drift))
    with pytest.raises(ValueError):
        smollm_like_policy(drift_rate=1.5)
    with pytest.raises(ValueError):
        smollm_like_policy(probe_rounds=0)


def test_nondecreasing_pools_dips_and_keeps_monotone_curves():
    assert nondecreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert nondecreasing([64.0, 104.0, 82.0, 101.0]) == pytest.approx([64.0, 93.0, 93.0, 101.0])
    assert nondecreasing([5.0, 1.0, 0.0]) == pytest.approx([2.0, 2.0, 2.0])
    rng = np.random.default_rng(0)
    for _ in range(50):
        values = rng.random(8).tolist()
        fit = nondecreasing(values)
        assert all(a <= b + 1e-12 for a, b in zip(fit, fit[1:]))
        assert sum(fit) == pytest.approx(sum(values))   # pooling keeps the total


def test_rejects_inconsistent_costs():
    with pytest.raises(ValueError):
        BlockPolicy([0.01, 0.02], [0.0])
    with pytest.raises(ValueError):
        BlockPolicy([0.0, 0.02], [0.0, 0.001])


class RandomPolicy:
    """Chooses any allowed draft count at random: every mix of AR steps and block sizes."""

    def __init__(self, max_drafts, seed=0):
        self.max_drafts, self.rng, self.choices = max_drafts, np.random.default_rng(seed), []
        self.sequences = 0

    def begin_sequence(self):
        self.sequences += 1

    def choose(self, max_drafts):
        self.choices.append(int(self.rng.integers(0, max_drafts + 1)))
        return self.choices[-1]

    def observe_round(self, num_drafted, num_accepted, seconds=None):
        # a lookup round may draft fewer than chosen (its match offers fewer tokens), never more
        assert 0 <= num_accepted <= num_drafted <= self.choices[-1] and seconds > 0
        assert num_drafted > 0 or self.choices[-1] == 0


@pytest.mark.parametrize("error_rate", [0.0, 0.3, 0.9])
def test_random_policy_is_lossless_on_mocks(error_rate):
    target = MockTarget(vocab_size=32, seed=11)
    drafter = MockDrafter(target, block_size=8, error_rate=error_rate, seed=5)   # asserts its context
    rng = np.random.default_rng(1)
    stats = GenerationStats()
    for i in range(8):
        prompt = rng.integers(0, 32, size=int(rng.integers(1, 20))).tolist()
        ar = tokens(generate(target, None, prompt, 50, GREEDY))
        policy = RandomPolicy(7, seed=i)
        assert tokens(generate(target, drafter, prompt, 50, GREEDY, stats=stats, policy=policy)) == ar
        assert max(policy.choices) <= 7 and policy.sequences == 1
    assert stats.num_ar_steps > 0 and stats.num_drafts > 0
    assert len(stats.drafted_per_position) == 7


@pytest.mark.parametrize("error_rate, mostly", [(0.0, "draft"), (1.0, "ar")])
def test_block_policy_on_mocks_adapts_and_stays_lossless(error_rate, mostly):
    target = MockTarget(vocab_size=32, seed=12)
    drafter = MockDrafter(target, block_size=8, error_rate=error_rate, seed=5)
    policy = smollm_like_policy(explore_every=16, cost_update_rate=0.0)  # mock wall times are not costs
    stats = GenerationStats()
    for prompt in ([1, 2, 3], [7], [4, 4, 9, 30, 2]):
        ar = tokens(generate(target, None, prompt, 120, GREEDY))
        assert tokens(generate(target, drafter, prompt, 120, GREEDY, stats=stats, policy=policy)) == ar
    if mostly == "draft":
        assert stats.num_ar_steps == 0 and stats.num_draft_tokens / stats.num_drafts > 5
    else:   # fell back to AR, but kept probing
        assert stats.num_ar_steps > 250 and 5 <= stats.num_drafts <= 40


class VirtualClock:
    """Stands in for the `time` module of the engine and the cost measurement: time moves only
    when a mock spends it, plus 1 us per reading so that every interval is positive."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 1e-6
        return self.now

    def spend(self, seconds):
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    virtual = VirtualClock()
    monkeypatch.setattr(sequence, "time", virtual)
    monkeypatch.setattr(block_policy, "time", virtual)
    return virtual


class SlowMockTarget(MockTarget):
    """Each forward costs 1 ms per token on top of 2 ms: a known verify cost curve."""

    def __init__(self, clock, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock, self.lengths = clock, []

    def cost_s(self, num_tokens):
        return 0.002 + 0.001 * num_tokens

    def forward(self, token_ids, all_logits):
        self.clock.spend(self.cost_s(len(token_ids)))
        self.lengths.append(len(token_ids))
        return super().forward(token_ids, all_logits)


def test_measure_costs_runs_only_the_measured_shapes_and_extends_the_slope(clock):
    target = SlowMockTarget(clock, vocab_size=32, seed=13)
    drafter = MockDrafter(target, block_size=8, error_rate=0.5)
    prompt = [1, 2, 3, 4, 5, 6]
    step, draft, _ = measure_costs(target, drafter, prompt, max_drafts=7, repetitions=3, measured_drafts=2)
    assert len(step) == len(draft) == 8 and draft[0] == 0.0
    assert max(target.lengths[1:]) <= 3  # after the prompt: at most 2 drafts + the last token per verify
    slope = max(step[2] - step[1], (step[2] - step[0]) / 2)  # at least the mean over k = 0..2
    assert slope > 0
    assert step[7] == pytest.approx(step[2] + 5 * slope) and step[4] == pytest.approx(step[2] + 2 * slope)
    assert draft[7] == pytest.approx(draft[2] + 5 * (draft[2] - draft[1]))
    # one drafted point: the drafter's curve has no slope (flat), the verify curve keeps k = 0..1's
    step1, draft1, _ = measure_costs(target, drafter, prompt, max_drafts=4, repetitions=1, measured_drafts=1)
    assert draft1[2:] == [draft1[1]] * 3
    assert step1[2:] == pytest.approx([step1[1] + j * (step1[1] - step1[0]) for j in (1, 2, 3)])


def test_a_flat_measured_verify_curve_still_extends_upwards():
    # paged runner on a busy machine: k = 1..3 pooled to one value; extended flat,
    # an 8-token block looked as cheap as a 2-token one and "auto" opened with k = 7
    assert extend_linearly([0.020, 0.028, 0.028, 0.028], 5) == pytest.approx([0.020, 0.028, 0.028, 0.028] + [0.028] * 2)
    step = extend_linearly([0.020, 0.028, 0.028, 0.028], 5, min_slope=0.008 / 3)
    assert step[4:] == pytest.approx([0.028 + 0.008 / 3, 0.028 + 0.016 / 3])
    policy = BlockPolicy(step, [0.0] + [0.005] * 5)
    assert policy.choose(5) < 5  # at the prior acceptance 0.5 the long blocks no longer look free


class CliffMockTarget(SlowMockTarget):
    """Forwards of up to 4 tokens cost 3 ms, longer ones 12 ms: the shape of the Zen 4 verify
    curve (1-4 tokens at an AR step's cost, then a jump; docs/BENCHMARKS.md, Verify cost)."""

    def cost_s(self, num_tokens):
        return 0.003 if num_tokens <= 4 else 0.012


def test_auto_calibrates_far_enough_to_see_a_cliff_after_four_tokens(clock):
    from ovdflash.pipeline import CALIBRATED_DRAFTS
    target = CliffMockTarget(clock, vocab_size=32, seed=13)
    drafter = MockDrafter(target, block_size=8, error_rate=0.5)
    prompt = [1, 2, 3, 4, 5, 6]
    p = 0.6   # every draft accepted with probability 0.6: block 4 beats block 8 at these costs
    chosen = {}
    for measured in (3, CALIBRATED_DRAFTS):
        step, draft, _ = measure_costs(target, drafter, prompt, max_drafts=7, repetitions=3, measured_drafts=measured)
        policy = BlockPolicy(step, [0.0] * 8)
        policy.accepted, policy.seen = [p * 50] * 7, [50.0] * 7
        chosen[measured] = policy.choose(7)
    assert chosen[3] > 3                    # timed up to 4 tokens, longer blocks look cheap
    assert chosen[CALIBRATED_DRAFTS] == 3   # the pipeline's calibration sees the jump


def test_measure_costs_recovers_the_cost_curve_and_leaves_runners_reusable(clock):
    target = SlowMockTarget(clock, vocab_size=32, seed=13)
    drafter = MockDrafter(target, block_size=6, error_rate=0.5)
    step, draft, switch = measure_costs(target, drafter, [1, 2, 3, 4], max_drafts=5, repetitions=3)
    assert switch == pytest.approx(0.0, abs=1e-4)   # this mock costs the same after any shape
    assert len(step) == len(draft) == 6 and draft[0] == 0.0
    assert all(d > 0 for d in draft[1:])
    assert step[5] - step[0] == pytest.approx(0.005, abs=1e-4)   # 1 ms per extra token
    assert target.committed == 0 and drafter.context == []
    policy = BlockPolicy(step, draft)
    prompt = [3, 1, 4]
    assert tokens(generate(target, drafter, prompt, 30, GREEDY, policy=policy)) == \
        tokens(generate(target, None, prompt, 30, GREEDY))


class ShapeSwitchMockTarget(SlowMockTarget):
    """SlowMockTarget plus 6 ms whenever the input length differs from the previous call's."""

    def forward(self, token_ids, all_logits):
        if self.lengths and self.lengths[-1] != len(token_ids):
            self.clock.spend(0.006)
        return super().forward(token_ids, all_logits)


def test_measure_costs_separates_the_switch_cost_from_the_steady_costs(clock):
    target = ShapeSwitchMockTarget(clock, vocab_size=32, seed=13)
    drafter = MockDrafter(target, block_size=6, error_rate=0.5)
    step, draft, switch = measure_costs(target, drafter, [1, 2, 3, 4], max_drafts=3, repetitions=4)
    assert switch == pytest.approx(0.006, abs=1e-4)
    assert step[3] - step[0] == pytest.approx(0.003, abs=1e-4)   # steady: 1 ms per token, no switch in it
    assert step[0] == pytest.approx(0.003, abs=1e-4)


# ------------------------------------------------------------------ the real tiny OpenVINO pair
@pytest.fixture(scope="module", params=["paged", "stateful"])
def strict_pipe(request, tiny_pair, tmp_path_factory):
    pipe = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("ov_cache"),
                                          INFERENCE_NUM_THREADS=1, target_runner=request.param, **STRICT_F32)
    if request.param == "stateful":
        pipe.target.compact_min_garbage = 24  # force compactions in short generations
    return pipe


def test_auto_block_size_through_the_real_models_equals_autoregressive(strict_pipe):
    pipe = strict_pipe
    policy = pipe.auto_block_policy()
    assert policy is pipe.auto_block_policy()               # calibrated once, then kept
    assert policy.max_drafts == pipe.block_size - 1
    assert all(c > 0 for c in policy.round_cost_s)
    rng = np.random.default_rng(3)
    stats = GenerationStats()
    for i in range(6):
        prompt = rng.integers(0, pipe.tokenizer.vocab_size, size=int(rng.integers(1, 60))).tolist()
        ar = tokens(pipe.generate_tokens(prompt, 40, draft=False, eos_token_ids=[]))
        pipe.block_policy = RandomPolicy(pipe.block_size - 1, seed=i) if i % 2 else policy
        assert tokens(pipe.generate_tokens(prompt, 40, block_size="auto", eos_token_ids=[], stats=stats)) == ar
    assert stats.num_drafts > 0 and stats.num_ar_steps > 0
    pipe.block_policy = policy
    text = pipe.generate("Hello", max_new_tokens=8, block_size="auto")
    assert text.token_ids == pipe.generate("Hello", max_new_tokens=8, draft=False).token_ids
    with pytest.raises(ValueError):
        pipe.generate("Hello", max_new_tokens=4, block_size="big")


def test_auto_without_a_drafter_is_plain_autoregressive(tiny_pair, tmp_path):
    pipe = DFlashPipeline.from_pretrained(tiny_pair, draft=False, cache_dir=tmp_path, **STRICT_F32)
    stats = GenerationStats()
    list(pipe.generate_tokens([1, 2, 3], 6, block_size="auto", stats=stats))
    assert stats.num_drafts == 0 and stats.num_ar_steps == 5 and pipe.block_policy is None


# -- several sequences per call --------------------------------------------------------------------
def batch_rate(policy, states, ks, fixed=0, lookup=None):
    """The batch's expected tokens per second, written out: lookup drafts call no drafter; drafter calls
    cost each their own, or (shared) the largest one for all; a call of another size than the last
    one switches, and one of another size than this round's AR size switches back."""
    offers = lookup or [0] * len(ks)
    expected = sum(s["lookup" if n else "estimate"].expected_tokens()[k] for s, k, n in zip(states, ks, offers))
    drafter = [policy.draft_cost_s[k] for k, n in zip(ks, offers) if not n and k]
    drafting = (max(drafter) if policy.shared_draft_call else sum(drafter)) if drafter else 0.0
    size, last = fixed + sum(k + 1 for k in ks), policy.last_tokens
    switches = 0 if last is None else (size != last) + (size != fixed + len(ks))
    return expected / (float(policy.call_cost(size)) + switches * policy.switch_cost_s + drafting)


def batch_policy(call_ms, p, draft_ms=4.0, max_drafts=7):
    tokens = list(range(1, len(call_ms) + 1))
    policy = BatchDraftPolicy(tokens, [m / 1e3 for m in call_ms], [0.0] + [draft_ms / 1e3] * max_drafts,
                              prior_strength=1e6, prior_acceptance=p)
    return policy


@pytest.mark.parametrize("shared", [False, True])
def test_batch_policy_is_near_brute_force_and_never_below_all_ar(shared):
    """Random curves, acceptances, caps, lookup offers and shape switches (none yet, from the AR size,
    from another size); drafter calls each paid, or one shared call."""
    import itertools
    rng = np.random.default_rng(0 + shared)
    near = 0
    for trial in range(60):
        # a random nondecreasing cost curve over 1..24 tokens, flat stretches and cliffs
        call_ms = np.cumsum(rng.choice([0.0, 0.5, 3.0, 12.0], size=24, p=[0.4, 0.3, 0.2, 0.1])) + 20.0
        policy = batch_policy(call_ms, float(rng.uniform(0.05, 0.95)), draft_ms=float(rng.uniform(0, 10)),
                              max_drafts=3)
        policy.draft_cost_s[1:] *= np.linspace(1.0, float(rng.uniform(1, 2)), 3)  # longer drafts may cost more
        policy.shared_draft_call = shared
        n = int(rng.integers(1, 5))
        states = [policy.new_sequence() for _ in range(n)]
        for s in states:  # each sequence its own acceptance, per draft source
            s["estimate"].prior_acceptance = float(rng.uniform(0.05, 0.95))
            s["lookup"].prior_acceptance = float(rng.uniform(0.05, 0.95))
        caps = [int(c) for c in rng.integers(0, 4, size=n)]
        offers = [int(o) for o in rng.choice([0, 0, 1, 2, 3], size=n)]
        fixed = int(rng.integers(0, 3))
        policy.switch_cost_s = float(rng.choice([0.0, rng.uniform(0, 0.015)]))
        policy.last_tokens = [None, fixed + n, fixed + n + int(rng.integers(1, 8))][trial % 3]
        ks = policy.choose(states, caps, fixed_tokens=fixed, lookup=offers)
        assert all(0 <= k <= min(c, o or c) for k, c, o in zip(ks, caps, offers)), (ks, caps, offers)
        best = max(batch_rate(policy, states, combo, fixed, offers)
                   for combo in itertools.product(*[range(min(c, o or c) + 1) for c, o in zip(caps, offers)]))
        got = batch_rate(policy, states, ks, fixed, offers)
        assert got >= batch_rate(policy, states, [0] * n, fixed, offers) * (1 - 1e-9), trial  # never below all-AR
        assert got >= 0.85 * best, (trial, ks, caps, offers, policy.last_tokens)
        near += got >= 0.95 * best
    assert near >= 58  # a local search: a rare batch ends on a lower peak (about 1 in 300 below 95 %)


class AlwaysSearching(BatchDraftPolicy):
    """The same policy without its shortcut: every round climbs from every start."""

    @staticmethod
    def drafting_rate_bound(*args) -> float:
        return float("inf")


@pytest.mark.parametrize("shared", [False, True])
def test_the_shortcut_to_all_ar_chooses_what_the_whole_search_chooses(shared):
    """Where no drafting round can beat all-AR the policy skips its search; on random batches (weak and
    strong drafters, lookup offers, switch states, probes due) both policies choose the same drafts
    round after round, and the shortcut is taken in some rounds and not in others."""
    rng = np.random.default_rng(7 + shared)
    rounds = searched = 0
    for trial in range(80):
        call_ms = np.cumsum(rng.choice([0.0, 0.5, 3.0, 12.0], size=40, p=[0.4, 0.3, 0.2, 0.1])) + 20.0
        p, draft_ms, switch = float(rng.uniform(0.02, 0.9)), float(rng.uniform(0, 10)), float(rng.uniform(0, 0.015))
        n = int(rng.integers(1, 5))
        policies, runs = [], []
        for cls in (BatchDraftPolicy, AlwaysSearching):
            policy = cls(list(range(1, 41)), [m / 1e3 for m in call_ms], [0.0] + [draft_ms / 1e3] * 7,
                         prior_acceptance=p, shared_draft_call=shared, switch_cost_s=switch, explore_every=3)
            policies.append((policy, [policy.new_sequence() for _ in range(n)]))
            runs.append([])
        for step in range(6):
            caps = [int(c) for c in rng.integers(0, 8, size=n)]
            offers = [int(o) for o in rng.choice([0, 0, 0, 1, 4], size=n)]
            fixed, last = int(rng.integers(0, 3)), [None, 3, 6][int(rng.integers(0, 3))]
            for (policy, states), run in zip(policies, runs):
                policy.last_tokens = last
                run.append(policy.choose(states, caps, fixed, offers))
            accepted = [int(rng.integers(0, k + 1)) for k in runs[0][-1]]
            for (policy, states), ks in zip(policies, runs):
                for s, k, a, o in zip(states, ks[-1], accepted, offers):
                    if k:
                        policy.observe(s, k, min(a, k), bool(o))
        assert runs[0] == runs[1], trial
        assert policies[1][0].num_searches == 6  # the policy without the shortcut searched every round
        rounds, searched = rounds + 6, searched + policies[0][0].num_searches
    taken = rounds - searched
    assert taken >= 50 and searched >= 50, (taken, searched)


def test_one_shared_drafter_call_lets_every_sequence_draft_where_separate_calls_would_not():
    """Drafter calls of 8 ms beside a 20 ms target call that 16 tokens hardly slow: four separate
    calls (32 ms) outweigh what p = 0.6 drafts bring, one call for all (8 ms) does not."""
    call_ms = [20.0] * 16 + [20.0 + 2.0 * (t - 16) for t in range(17, 65)]
    separate = batch_policy(call_ms, 0.6, draft_ms=8.0, max_drafts=3)
    shared = batch_policy(call_ms, 0.6, draft_ms=8.0, max_drafts=3)
    shared.shared_draft_call = True
    ks_separate = separate.choose([separate.new_sequence() for _ in range(4)], [3] * 4)
    states = [shared.new_sequence() for _ in range(4)]
    ks_shared = shared.choose(states, [3] * 4)
    assert ks_shared == [3] * 4 and sum(ks_separate) < sum(ks_shared)
    assert shared.drafting_cost(ks_shared, [True] * 4) == pytest.approx(0.008)
    assert separate.drafting_cost(ks_shared, [True] * 4) == pytest.approx(0.032)
    assert batch_rate(shared, states, ks_shared) > batch_rate(shared, states, [0] * 4)


def test_lookup_offers_are_drafts_without_a_drafter_call_judged_by_the_lookups_acceptance():
    """A drafter too dear to call on a compute-bound curve; a sequence whose lookup matches and is
    mostly right still verifies its lookup drafts, one whose lookup is mostly wrong does not, and each
    source's rounds teach only its own estimate."""
    call_ms = [20.0 + 4.0 * (t - 1) for t in range(1, 65)]
    policy = batch_policy(call_ms, 0.5, draft_ms=30.0, max_drafts=3)
    policy.prior = (0.5, 2.0, 0.95)
    good, bad = policy.new_sequence(), policy.new_sequence()
    for _ in range(30):
        policy.observe(good, 3, 3, from_lookup=True)
        policy.observe(bad, 3, 0, from_lookup=True)
    assert policy.choose([good, bad], [3, 3]) == [0, 0]  # no offers: only the dear drafter
    assert policy.choose([good, bad], [3, 3], lookup=[2, 3]) == [2, 0]  # at most what the lookup offers
    assert good["estimate"].seen == [0.0] * 3 and good["lookup"].seen[0] > 0
    fresh = policy.new_sequence()  # the lookups seen so far set a new sequence's lookup prior
    assert fresh["lookup"].prior_acceptance == pytest.approx(policy.lookup_population.acceptance()[0])
    assert fresh["estimate"].prior_acceptance == pytest.approx(0.5)


def test_batch_policy_drafts_less_as_the_batch_grows_on_a_compute_bound_curve():
    # one AR step 20 ms, +2.5 ms per token past 4 (a compute-bound verify), drafts 4 ms, p = 0.6
    call_ms = [20.0] * 4 + [20.0 + 2.5 * (t - 4) for t in range(5, 129)]
    drafts_per_sequence = []
    for batch in (1, 2, 4, 8, 16):
        policy = batch_policy(call_ms, 0.6)
        states = [policy.new_sequence() for _ in range(batch)]
        ks = policy.choose(states, [7] * batch)
        drafts_per_sequence.append(sum(ks) / batch)
    assert drafts_per_sequence[0] >= 2
    assert drafts_per_sequence == sorted(drafts_per_sequence, reverse=True)
    assert drafts_per_sequence[-1] < drafts_per_sequence[0]
    # a flat (memory-bound) curve keeps every sequence of a good drafter drafting
    policy = batch_policy([20.0] * 128, 0.8)
    assert policy.choose([policy.new_sequence() for _ in range(8)], [7] * 8) == [7] * 8


def bad_drafter_batch(call_ms, num_sequences):
    """A batch policy probing every 3 AR rounds, and sequences whose every first draft was rejected."""
    policy = batch_policy(call_ms, 0.6)
    policy.explore_every = 3
    states = [policy.new_sequence() for _ in range(num_sequences)]
    for s in states:
        s["estimate"].prior_strength = 2.0
        for _ in range(30):
            policy.observe(s, 3, 0)
    return policy, states


def test_batch_policy_falls_back_to_ar_for_a_bad_drafter_and_probes():
    policy, states = bad_drafter_batch([20.0 + 3.0 * t for t in range(64)], 2)
    choices = [policy.choose(states, [7, 7]) for _ in range(10)]
    assert choices[0] == [0, 0]
    probes = [i for i, ks in enumerate(choices) if ks != [0, 0]]
    assert probes and all(choices[i] == [policy.probe_drafts] * 2 for i in probes)
    assert states[0]["explore_wait"] > 3  # a failed probe waits longer next time


def test_batch_policy_probes_only_where_a_good_drafter_could_pay():
    """A bad drafter holds four sequences at AR; on a curve where every token costs an AR step's
    worth no probe could pay, so none runs; on a flat curve they still probe."""
    def probes(call_ms):
        policy, states = bad_drafter_batch(call_ms, 4)
        return sum(1 for _ in range(40) if any(policy.choose(states, [7] * 4)))

    assert probes([20.0 * t for t in range(1, 65)]) == 0
    assert probes([20.0] * 64) > 0


def test_batch_policy_learns_the_cost_curve():
    policy = batch_policy([20.0] * 8, 0.5)
    for _ in range(50):
        policy.observe_call(4, 0.040)  # the machine runs 2x slower than calibrated
    assert float(policy.call_cost(4)) == pytest.approx(0.040, rel=0.05)
    assert float(policy.call_cost(1)) > 0.030  # the drift moved the whole curve
    policy.observe_call(20, 0.090)  # another size than the last call's: it teaches the switch cost only
    assert policy.call_tokens[-1] == 8 and policy.switch_cost_s > 0
    policy.observe_call(20, 0.090)  # past the measured sizes, repeated: a new point
    assert policy.call_tokens[-1] == 20
    assert policy.call_cost_s == sorted(policy.call_cost_s)
    with pytest.raises(ValueError, match="increasing"):
        BatchDraftPolicy([2, 1], [0.01, 0.02], [0.0, 0.001])


def test_batch_policy_learns_what_drafter_calls_cost_in_use():
    """A flat curve makes one draft look free beside three AR steps; once the drafter calls it
    chose are seen to cost 3x the calibration (context to catch up), that draft no longer pays."""
    policy = batch_policy([16.0] * 4 + [26.0] * 60, 0.45, draft_ms=1.4, max_drafts=3)
    states = [policy.new_sequence() for _ in range(3)]
    assert sum(policy.choose(states, [3] * 3)) == 1
    calibrated = policy.draft_cost_s.copy()
    policy.observe_draft(1, 0.0042)  # the first call seen moves the estimate all the way
    assert policy.draft_cost_s[1] == pytest.approx(0.0042)
    for _ in range(40):
        policy.observe_draft(1, 0.0042)
    assert policy.draft_cost_s[1] == pytest.approx(0.0042, rel=0.05)
    assert np.allclose(policy.draft_cost_s[1:] / calibrated[1:], policy.draft_cost_s[1] / calibrated[1])  # one factor
    assert policy.choose(states, [3] * 3) == [0, 0, 0]
    policy.observe_draft(1, 50.0)  # one descheduled call moves the costs by a bounded step
    assert policy.draft_cost_s[1] < 0.0042 * 2
    for bad in ((0, 0.01), (4, 0.01), (1, 0.0)):
        before = policy.draft_cost_s.copy()
        policy.observe_draft(*bad)
        assert np.array_equal(policy.draft_cost_s, before)


def test_batch_policy_drafts_for_all_where_no_single_draft_pays():
    """A curve that steps up once past 4 tokens (the runner's kernels change) and is shallow after:
    one sequence drafting alone pays the whole step, four drafting together share it."""
    call_ms = [16.0] * 4 + [26.0 + 1.5 * (t - 5) for t in range(5, 65)]
    policy = batch_policy(call_ms, 0.8, draft_ms=0.8, max_drafts=3)
    states = [policy.new_sequence() for _ in range(4)]
    ks = policy.choose(states, [3] * 4)
    assert ks == [3] * 4
    assert batch_rate(policy, states, ks) > batch_rate(policy, states, [0] * 4)
    assert all(batch_rate(policy, states, [3 if j == i else 0 for j in range(4)]) < batch_rate(policy, states, [0] * 4)
               for i in range(4))  # the trap a climb from all-AR alone stops in


def test_a_batch_steady_at_ar_pays_a_shape_switch_to_draft_and_learns_it_from_switched_calls():
    """Four sequences at AR calls of 4 tokens; drafts that pay on the steady curve stop paying once a
    call of another size is seen to cost 13 ms more, and lookup room is no longer free."""
    call_ms = [33.0] * 16 + [33.0 + 3.0 * (t - 16) for t in range(17, 65)]
    policy = batch_policy(call_ms, 0.3, draft_ms=2.0, max_drafts=3)
    policy.shared_draft_call = True
    states = [policy.new_sequence() for _ in range(4)]
    for _ in range(3):
        policy.observe_call(4, 0.033)
    assert policy.switch_cost_s == 0.0 and sum(policy.choose(states, [3] * 4)) > 0
    assert policy.free_tokens(4) > 0
    policy.observe_call(8, 0.033 + 0.013)  # the first switched call teaches the whole excess
    assert policy.switch_cost_s == pytest.approx(0.013, rel=0.05)
    assert float(policy.call_cost(8)) == pytest.approx(0.033)  # and leaves the steady curve alone
    policy.saw_call(4)  # e.g. a prefill: not learnt from, but the next call's shape follows it
    assert policy.last_tokens == 4
    assert policy.choose(states, [3] * 4) == [0, 0, 0, 0]
    assert policy.free_tokens(4) == 0
    policy.saw_call(12)  # after a call of 12 tokens, going back to 4 switches too: the steady curve decides
    assert sum(policy.choose(states, [3] * 4)) > 0


def test_leaving_the_ar_size_for_a_lookup_match_pays_the_switch_back_too():
    """Four sequences steady at AR calls of 4 tokens (33 ms, 13 ms more after a size change); one
    sequence's lookup offers 3 drafts it gets right 80 % of the time: 1.95 more tokens, worth one
    switch but not the two a one-round trip costs. Away from the AR size (after a call of 7), going
    back costs a switch as well, so there the lookup drafts pay; a third size pays two."""
    call_ms = [33.0] * 16 + [33.0 + 3.0 * (t - 16) for t in range(17, 65)]
    policy = batch_policy(call_ms, 0.3, draft_ms=30.0, max_drafts=3)
    policy.switch_cost_s = 0.013
    states = [policy.new_sequence() for _ in range(4)]
    states[0]["lookup"].prior_acceptance = 0.8
    offers = [3, 0, 0, 0]
    policy.saw_call(4)
    assert policy.choose(states, [3] * 4, 0, offers) == [0, 0, 0, 0]
    assert batch_rate(policy, states, [3, 0, 0, 0], 0, offers) < batch_rate(policy, states, [0] * 4, 0, offers)
    assert float(policy.costs_with_switch(np.array([7]), 4)[0]) == pytest.approx(0.033 + 2 * 0.013)
    assert policy.free_tokens(4) == 0
    policy.saw_call(7)
    assert policy.choose(states, [3] * 4, 0, offers) == [3, 0, 0, 0]
    assert policy.costs_with_switch(np.array([4, 7, 9]), 4).tolist() == pytest.approx([0.046, 0.046, 0.059])


def test_new_sequences_start_from_the_acceptance_seen_so_far():
    policy = BatchDraftPolicy([1, 8], [0.02, 0.03], [0.0] + [0.001] * 3)
    assert policy.new_sequence()["estimate"].acceptance()[0] == pytest.approx(0.5)
    seen = policy.new_sequence()
    for _ in range(200):
        policy.observe(seen, 3, 3)  # every draft accepted
    fresh = policy.new_sequence()["estimate"]
    assert fresh.acceptance()[0] > 0.9
    assert fresh.accepted == [0.0] * 3  # a prior only: the sequence's own rounds still decide
    for _ in range(40):
        policy.observe(seen, 3, 0)
    assert policy.new_sequence()["estimate"].acceptance()[0] < fresh.acceptance()[0]


# ------------------------------------------------------------------ cutting a proposal by its confidence
def confidence_rates(policy, confidence):
    """E[accepted+1](k) / cost(k) for k = 1..n, summing over a round's outcomes with the c_i as p_i."""
    n, rates = len(confidence), []
    for k in range(1, n + 1):
        expected = sum(np.prod(confidence[:a]) * ((1 - confidence[a]) if a < k else 1.0) * (a + 1)
                       for a in range(k + 1))
        switch = policy.switch_cost_s if policy.previous_k is not None and k != policy.previous_k else 0.0
        rates.append(expected / (policy.round_cost_s[k] - policy.draft_cost_s[k] + policy.draft_cost_s[n] + switch))
    return rates


def test_the_cut_verifies_the_drafts_that_maximize_the_expected_rate():
    policy = smollm_like_policy()
    low_third = [0.9, 0.9, 0.1, 0.9, 0.9, 0.9, 0.9]  # reaching draft 3 is unlikely: stop before it
    assert policy.cut(low_third) == 2 == 1 + int(np.argmax(confidence_rates(policy, low_third)))
    assert policy.cut([0.99] * 7) == 7  # confident: no cut
    assert policy.cut([0.01] * 7) == 1  # never below one draft: drafting at all is choose's
    assert policy.cut([0.9, 0.9, 0.1]) == 2 and policy.cut([0.3]) == 1 and policy.cut([]) == 0
    rng = np.random.default_rng(4)
    for _ in range(50):
        c = rng.uniform(0, 1, size=int(rng.integers(1, 8)))
        assert policy.cut(c) == 1 + int(np.argmax(confidence_rates(policy, c)))


def test_the_cut_pays_the_whole_switch_and_counts_the_drafter_call_as_paid():
    policy = smollm_like_policy(switch_cost_s=0.02)
    policy.observe_round(7, 7)  # the previous round verified 7 drafts: a shorter block is a new shape
    low_third = [0.9, 0.9, 0.1, 0.9, 0.9, 0.9, 0.9]
    assert policy.cut(low_third) == 7 == 1 + int(np.argmax(confidence_rates(policy, low_third)))
    # a drafter call that grows with its drafts: cutting does not give the longer call's time back
    growing = BlockPolicy([m / 1e3 for m in STEP_MS], [0.0] + [0.004 * k for k in range(1, 8)])
    assert growing.draft_cost_s[7] == pytest.approx(0.028)
    fading = [0.9, 0.9, 0.5, 0.5, 0.5, 0.5, 0.5]
    assert growing.cut(fading) == 4 == 1 + int(np.argmax(confidence_rates(growing, fading)))  # 2 if it were not paid


def test_a_fixed_block_cuts_where_the_predicted_reach_falls_below_the_threshold():
    cut = block_policy.ConfidenceCut()
    assert cut.threshold == block_policy.DEFAULT_CONFIDENCE_THRESHOLD
    assert cut.cut([0.5] * 7) == 2          # reach 0.5, 0.25, 0.125: below 0.2 from draft 3
    assert cut.cut([0.95] * 7) == 7         # 0.95 ** 7 = 0.70: no cut
    assert cut.cut([0.1, 0.9]) == 1         # the first draft stays
    assert block_policy.ConfidenceCut(0.0).cut([0.01] * 5) == 5  # 0: never cut
    assert block_policy.ConfidenceCut(0.6).cut([0.9, 0.8, 0.8]) == 2  # reach 0.9, 0.72, 0.58
    for bad in (-0.1, 1.5, "0.2", True):
        with pytest.raises(ValueError, match="confidence_threshold"):
            block_policy.ConfidenceCut(bad)


class ConfidentMockDrafter(MockDrafter):
    """A MockDrafter that reports a per-slot confidence with each proposal (None: reports none)."""

    def __init__(self, target, slot_confidence, **kwargs):
        super().__init__(target, **kwargs)
        self.slot_confidence = slot_confidence
        self.confidence = None

    def propose(self, last, ctx_feats, start, num_drafts):
        drafts = super().propose(last, ctx_feats, start, num_drafts)
        if self.slot_confidence is not None:
            self.confidence = np.full(num_drafts, self.slot_confidence)
        return drafts


@pytest.mark.parametrize("slot_confidence, longest", [(0.5, 2), (0.95, 7), (None, 7)])
def test_a_cut_proposal_stays_lossless_and_no_confidence_changes_nothing(slot_confidence, longest):
    target = MockTarget(vocab_size=32, seed=11)
    drafter = ConfidentMockDrafter(target, slot_confidence, block_size=8, error_rate=0.2, seed=5)
    stats = GenerationStats()
    for prompt in ([1, 2, 3], [7, 30]):
        ar = tokens(generate(target, None, prompt, 40, GREEDY))
        assert tokens(generate(target, drafter, prompt, 40, GREEDY, block_size=8, stats=stats,
                               draft_cut=block_policy.ConfidenceCut())) == ar
    assert len(stats.drafted_per_position) == longest and stats.num_accepted_tokens > 0
