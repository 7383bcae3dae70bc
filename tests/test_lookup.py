"""N-gram lookup drafts: the index against a brute-force scan, and the engine with lookup rounds
(mock runners): output equals autoregressive decoding, lookup rounds skip the drafter's call, and
the drafter still sees every committed token's features in order."""
import numpy as np
import pytest
from mock_models import MockDrafter, MockTarget

from ovdflash.decode.lookup import NgramLookup
from ovdflash.decode.sampling import SamplingParams
from ovdflash.decode.sequence import generate
from ovdflash.decode.stats import GenerationStats


def brute_force(tokens, k, min_n, max_n):
    """The longest suffix (max_n..min_n) that ended earlier; the tokens after its latest earlier end."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return None


def test_proposes_what_followed_the_latest_longest_match():
    look = NgramLookup(min_n=2, max_n=3)
    look.reset([5, 6, 7, 8, 9, 6, 7, 1, 5, 6, 7])
    # (6, 7) ended at 2 and 6; the 3-gram (5, 6, 7) only at 2: longest wins
    assert look.propose(3).tolist() == [8, 9, 6]
    look.extend([2])  # suffix (7, 2): never seen before
    assert look.propose(3) is None
    look.extend([7, 2])  # (7, 2) ended at 11: continuation runs into the suffix itself
    assert look.propose(4).tolist() == [7, 2]


def test_no_proposal_without_an_earlier_occurrence():
    look = NgramLookup(min_n=2, max_n=4)
    look.reset([1, 2, 3, 4])
    assert look.propose(3) is None
    assert look.propose(0) is None
    look.reset([])
    assert look.propose(3) is None
    look.reset([3, 3])  # a bigram needs an earlier end: (3, 3) has none yet
    assert look.propose(2) is None
    look.extend([3])    # (3, 3) ended at 1: the continuation is the last 3
    assert look.propose(2).tolist() == [3]


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (2, 4), (3, 3)])
def test_index_agrees_with_a_brute_force_scan(min_n, max_n):
    rng = np.random.default_rng(min_n * 10 + max_n)
    for trial in range(30):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 60))).tolist()  # small vocab: many repeats
        look = NgramLookup(min_n, max_n)
        split = int(rng.integers(0, len(tokens) + 1))
        look.reset(tokens[:split])
        for i in range(split, len(tokens) + 1):
            k = int(rng.integers(1, 8))
            got = look.propose(k)
            want = brute_force(tokens[:i], k, min_n, max_n)
            assert (None if got is None else got.tolist()) == want, (tokens[:i], k)
            if i < len(tokens):
                look.extend([tokens[i]])


def test_bad_sizes_are_a_clear_error():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramLookup(min_n=3, max_n=2)
    with pytest.raises(ValueError, match="1 <= min_n"):
        NgramLookup(min_n=0, max_n=2)


def cycling_target(vocab=16, seed=0, period_noise=0.0):
    """A target whose greedy output depends on the last token only: it falls into a cycle, the
    text that lookup drafts perfectly; the full-history term breaks ties differently per prompt."""
    target = MockTarget(vocab_size=vocab, seed=seed, sharpness=3.0)
    target.logits_fn = lambda seq: target.w_last[seq[-1]] + period_noise * target.w_sum[sum(seq) % vocab]
    return target


@pytest.mark.parametrize("block_size", [2, 4, 8])
@pytest.mark.parametrize("noise", [0.0, 0.6])
def test_greedy_with_lookup_equals_autoregressive(block_size, noise):
    target = cycling_target(seed=block_size, period_noise=noise)
    drafter = MockDrafter(target, block_size=block_size, error_rate=0.5, seed=3)
    rng = np.random.default_rng(1)
    total = GenerationStats()
    for _ in range(12):
        prompt = rng.integers(0, 16, size=int(rng.integers(1, 12))).tolist()
        ar = [e.token for e in generate(target, None, prompt, 50, SamplingParams())]
        stats = GenerationStats()
        calls_before = drafter.num_propose_calls
        spec = [e.token for e in generate(target, drafter, prompt, 50, SamplingParams(), block_size=block_size,
                                          stats=stats, lookup=NgramLookup())]
        assert spec == ar
        # every round either called the drafter or took lookup drafts, never both
        assert drafter.num_propose_calls - calls_before == stats.num_drafts - stats.num_lookup_drafts
        total.merge(stats)
    assert total.num_lookup_drafts > 0
    assert total.num_lookup_accepted_tokens > 0
    assert total.num_lookup_draft_tokens > total.num_lookup_accepted_tokens or noise == 0.0
    if noise == 0.0:  # a pure cycle: once it repeats, lookup drafts whole blocks
        assert total.num_lookup_accepted_tokens >= 0.5 * total.num_lookup_draft_tokens


def test_lookup_rounds_mixed_with_ar_steps_and_a_policy_keep_the_drafter_in_sync():
    class Alternating:  # k = 0 (an AR step) every third round, else the whole block
        max_drafts = 3

        def __init__(self):
            self.n = 0

        def begin_sequence(self):
            self.n = 0

        def choose(self, max_drafts):
            self.n += 1
            return 0 if self.n % 3 == 0 else max_drafts

        def observe_round(self, drafted, accepted, seconds=None):
            pass

    target = cycling_target(seed=9, period_noise=0.3)
    drafter = MockDrafter(target, block_size=4, error_rate=0.4, seed=2)
    for prompt in ([1, 2, 3], [4, 4, 4, 4], [7]):
        ar = [e.token for e in generate(target, None, prompt, 70, SamplingParams())]
        stats = GenerationStats()
        spec = [e.token for e in generate(target, drafter, prompt, 70, SamplingParams(), stats=stats,
                                          policy=Alternating(), lookup=NgramLookup())]
        assert spec == ar
        assert stats.num_ar_steps > 0 and stats.num_lookup_drafts > 0


def test_a_policy_learns_the_number_of_tokens_a_lookup_round_really_drafted():
    class Recorder:
        max_drafts = 7

        def __init__(self):
            self.rounds = []

        def begin_sequence(self):
            pass

        def choose(self, max_drafts):
            return max_drafts

        def observe_round(self, drafted, accepted, seconds=None):
            self.rounds.append((drafted, accepted))

    target = cycling_target(seed=2)
    drafter = MockDrafter(target, block_size=8, error_rate=0.5, seed=4)
    policy, stats = Recorder(), GenerationStats()
    # a match near the end of a short history offers fewer than the 7 tokens asked for, and the
    # policy must hear the real count (not 7 with the missing ones counted as rejected)
    list(generate(target, drafter, [3, 9, 3, 9], 60, SamplingParams(), stats=stats, policy=policy,
                  lookup=NgramLookup()))
    assert sum(d for d, _ in policy.rounds) == stats.num_draft_tokens
    assert all(a <= d for d, a in policy.rounds)
    assert any(d < 7 for d, _ in policy.rounds)
