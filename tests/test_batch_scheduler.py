"""The batched scheduler against mock runners: every sequence of a batch equals its run alone."""
import numpy as np
import pytest
from mock_models import MockDrafter, MockTarget

from ovdflash.decode.lookup import NgramLookup
from ovdflash.decode.sampling import SamplingParams
from ovdflash.decode.scheduler import Scheduler
from ovdflash.decode.sequence import PromptTooLongError, generate

VOCAB = 32
TARGET_SEED = 11


class MockBatchTarget:
    """scheduler.BatchTarget over one MockTarget per sequence, with a block pool of a fixed size."""

    def __init__(self, pool_blocks=10_000, block_tokens=4, max_length=4096, make_target=None):
        self.make_target = make_target or (lambda: MockTarget(vocab_size=VOCAB, seed=TARGET_SEED,
                                                              max_length=max_length))
        self.pool_blocks = pool_blocks
        self.block_tokens = block_tokens
        self.max_length = max_length
        self.seqs, self.reserved = {}, {}
        self.num_forward_calls = 0
        self.batch_sizes = []
        self.last_reserved = None

    def blocks_for(self, num_tokens):
        return -(-num_tokens // self.block_tokens)

    def reserve(self, seq_id, num_tokens, prompt_ids=None):  # caches no prefixes: prompt_ids ignored
        need = self.blocks_for(num_tokens)
        if need > self.pool_blocks - sum(self.reserved.values()):
            return False
        self.reserved[seq_id] = need
        self.seqs[seq_id] = self.last_reserved = self.make_target()
        return True

    def release(self, seq_id):
        del self.seqs[seq_id], self.reserved[seq_id]

    def committed(self, seq_id):
        return self.seqs[seq_id].committed

    def forward(self, batch):
        self.num_forward_calls += 1
        self.batch_sizes.append(len(batch))
        out = []
        for seq_id, ids, rows in batch:
            seq = self.seqs[seq_id]
            assert self.blocks_for(seq.committed + len(ids)) <= self.reserved[seq_id], "wrote past its booking"
            logits, feats = seq.forward(ids, all_logits=True)
            out.append((logits[np.asarray(rows)], feats))
        return out

    def cached_features(self, seq_id):
        return None

    def commit(self, seq_id, num_kept, token_ids=None, features=None):
        self.seqs[seq_id].commit(num_kept)


class MockDrafterSource:
    def __init__(self, target: MockBatchTarget, block_size=8, error_rate=0.3):
        self.target, self.block_size, self.error_rate = target, block_size, error_rate
        self.out = 0

    def take(self):  # bound to the sequence just admitted (the scheduler takes right after reserve)
        self.out += 1
        return MockDrafter(self.target.last_reserved, block_size=self.block_size, error_rate=self.error_rate, seed=7)

    def give(self, drafter):
        self.out -= 1


def alone(prompt, max_new, block_size, params=SamplingParams(), eos=(), lookup=False, max_length=4096):
    target = MockTarget(vocab_size=VOCAB, seed=TARGET_SEED, max_length=max_length)
    drafter = MockDrafter(target, block_size=8, error_rate=0.3, seed=7) if block_size > 1 else None
    return list(generate(target, drafter, prompt, max_new, params, eos, block_size,
                         lookup=NgramLookup() if lookup and drafter else None))


def drain(scheduler, joins=None):
    """Step until idle; `joins` maps a step number to requests added before it."""
    events, step = {}, 0
    while scheduler.has_work() or (joins and any(k >= step for k in joins)):
        for args in (joins or {}).get(step, []):
            scheduler.add(*args)
        for rid, evs in scheduler.step():
            events.setdefault(rid, []).extend(evs)
        step += 1
    return events


def random_requests(rng, n, sampled=False):
    reqs = []
    for i in range(n):
        prompt = rng.integers(0, VOCAB, size=int(rng.integers(1, 30))).tolist()
        params = SamplingParams(temperature=0.8, top_k=int(rng.integers(0, 10)), seed=int(rng.integers(1000))) \
            if sampled and i % 2 == 0 else SamplingParams()
        reqs.append((f"r{i}", prompt, int(rng.integers(1, 40)), params, int(rng.choice([1, 2, 4, 8])),
                     bool(rng.integers(2)), ()))
    return reqs


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("sampled", [False, True])
def test_every_sequence_of_a_batch_equals_its_run_alone(batch, sampled):
    rng = np.random.default_rng(batch + 100 * sampled)
    target = MockBatchTarget()
    scheduler = Scheduler(target, MockDrafterSource(target), max_batch_size=batch)
    reqs = random_requests(rng, 2 * batch, sampled)
    for r in reqs:
        scheduler.add(*r)
    events = drain(scheduler)
    for rid, prompt, max_new, params, block, lookup, eos in reqs:
        assert events[rid] == alone(prompt, max_new, block, params, eos, lookup), rid
    assert max(target.batch_sizes) == batch
    assert not target.seqs and not scheduler.running


def test_sequences_join_mid_batch_and_one_call_serves_all():
    rng = np.random.default_rng(5)
    target = MockBatchTarget()
    drafters = MockDrafterSource(target)
    scheduler = Scheduler(target, drafters)
    reqs = random_requests(rng, 6)
    joins = {0: reqs[:2], 3: reqs[2:4], 7: reqs[4:]}
    events = drain(scheduler, joins)
    for rid, prompt, max_new, params, block, lookup, eos in reqs:
        assert events[rid] == alone(prompt, max_new, block, params, eos, lookup), rid
    assert target.num_forward_calls == scheduler.num_steps < sum(len(e) for e in events.values())
    assert drafters.out == 0


class MockRowsSource(MockDrafterSource):
    """A source that drafts a round's sequences in one call (`propose_many`), recording each call's size."""

    def __init__(self, target):
        super().__init__(target)
        self.call_sizes = []

    def propose_many(self, calls):
        self.call_sizes.append(len(calls))
        return [drafter.propose(*args) for drafter, *args in calls]


def test_a_source_that_drafts_together_gets_every_drafter_call_of_a_round_in_one():
    rng = np.random.default_rng(8)
    target = MockBatchTarget()
    drafters = MockRowsSource(target)
    scheduler = Scheduler(target, drafters, max_batch_size=4)
    reqs = [(f"r{i}", rng.integers(0, VOCAB, size=int(rng.integers(1, 30))).tolist(), int(rng.integers(5, 40)),
             SamplingParams(), 8, i % 3 == 0, ()) for i in range(8)]
    events, steps = {}, 0
    for r in reqs:
        scheduler.add(*r)
    while scheduler.has_work():
        before = len(drafters.call_sizes)
        for rid, evs in scheduler.step():
            events.setdefault(rid, []).extend(evs)
        assert len(drafters.call_sizes) - before <= 1
        steps += 1
    for rid, prompt, max_new, params, block, lookup, eos in reqs:
        assert events[rid] == alone(prompt, max_new, block, params, eos, lookup), rid
    assert len(drafters.call_sizes) <= steps and max(drafters.call_sizes) >= 3 and drafters.out == 0


def test_eos_stops_one_sequence_and_the_others_go_on():
    base = [e.token for e in alone([3, 4, 5], 30, 4)]
    eos = (base[6],)
    target = MockBatchTarget()
    scheduler = Scheduler(target, MockDrafterSource(target))
    scheduler.add("eos", [3, 4, 5], 30, SamplingParams(), 4, False, eos)
    scheduler.add("long", [3, 4, 5], 30, SamplingParams(), 4, False, ())
    events = drain(scheduler)
    assert events["eos"] == alone([3, 4, 5], 30, 4, eos=eos)
    assert events["eos"][-1].finish_reason == "stop" and len(events["eos"]) == base.index(eos[0]) + 1
    assert [e.token for e in events["long"]] == base and events["long"][-1].finish_reason == "length"


def test_context_full_stops_as_alone():
    target = MockBatchTarget(max_length=20)
    scheduler = Scheduler(target, MockDrafterSource(target))
    scheduler.add("a", [1, 2, 3], 100, SamplingParams(), 8, False, ())
    scheduler.add("b", list(range(15)), 100, SamplingParams(), 1, False, ())
    events = drain(scheduler)
    assert events["a"] == alone([1, 2, 3], 100, 8, max_length=20)
    assert events["b"] == alone(list(range(15)), 100, 1, max_length=20)
    assert events["a"][-1].finish_reason == events["b"][-1].finish_reason == "context"
    with pytest.raises(PromptTooLongError):
        scheduler.add("c", list(range(20)), 5)


def test_a_request_waits_for_the_pool_and_one_too_large_is_refused():
    # 4 tokens a block: each request books ceil((10 + 10 - 1) / 4) = 5 blocks, so 2 fit in 12
    target = MockBatchTarget(pool_blocks=12)
    scheduler = Scheduler(target, MockDrafterSource(target))
    for i in range(4):
        scheduler.add(f"r{i}", list(range(1, 11)), 10, SamplingParams(), 4, False, ())
    with pytest.raises(ValueError, match="whole pool"):
        scheduler.add("big", list(range(1, 40)), 20)
    events, most = {}, 0
    while scheduler.has_work():
        for rid, evs in scheduler.step():
            events.setdefault(rid, []).extend(evs)
        most = max(most, len(scheduler.running))
        assert sum(target.reserved.values()) <= 12
    assert most == 2 and max(target.batch_sizes) == 2
    for i in range(4):
        assert events[f"r{i}"] == alone(list(range(1, 11)), 10, 4)


def test_abort_frees_the_slot_and_the_rest_is_unchanged():
    target = MockBatchTarget()
    drafters = MockDrafterSource(target)
    scheduler = Scheduler(target, drafters, max_batch_size=2)
    for rid in "abc":
        scheduler.add(rid, [5, 6, 7], 25, SamplingParams(), 4, False, ())
    first = scheduler.step()
    assert {rid for rid, _ in first} == {"a", "b"}
    assert scheduler.abort("a") and not scheduler.abort("a") and not scheduler.abort("nobody")
    events = drain(scheduler)
    assert "a" not in events and events["c"] == alone([5, 6, 7], 25, 4)
    assert "a" not in target.seqs and drafters.out == 0
    with pytest.raises(ValueError, match="drafter"):
        Scheduler(target).add("x", [1], 3, block_size=4)


@pytest.mark.parametrize("load_aware", [False, True])
def test_sampling_inside_a_batch_matches_the_exact_ar_distribution(load_aware):
    """Pearson chi-square of the first tokens of 3,000 sampled sequences run 8 at a time (fixed
    blocks of 4, or load-aware drafts) against the exactly enumerated AR distribution."""
    from collections import Counter

    from test_sampling_stats import NUM_TOKENS, P_THRESHOLD, PROMPT, chisquare_p, exact_joint, marginal

    from ovdflash.decode.block_policy import BatchDraftPolicy

    def make_target():
        return MockTarget(vocab_size=8, seed=11, sharpness=1.2)

    target = MockBatchTarget(make_target=make_target)
    # costs fixed (no learning from the mocks' wall clock), so the policy keeps drafting
    policy = BatchDraftPolicy(list(range(1, 65)), [0.020 + 0.0001 * t for t in range(1, 65)], [0.0] + [0.0005] * 3,
                              cost_update_rate=0.0, drift_rate=0.0)
    scheduler = Scheduler(target, MockDrafterSource(target, block_size=4), max_batch_size=8, draft_policy=policy)
    params, n = SamplingParams(temperature=1.0), 3000
    for i in range(n):
        scheduler.add(i, PROMPT, NUM_TOKENS, SamplingParams(1.0, seed=50_000 + i), 4, False, (), load_aware=load_aware)
    events = drain(scheduler)
    counts = Counter(tuple(e.token for e in events[i]) for i in range(n))
    joint = exact_joint(make_target(), params)
    p_values = {pos: chisquare_p(marginal(counts, pos), marginal(joint, pos), n)
                for pos in [(0,), (1,), (2,), (3,), (4,), (1, 2), (3, 4)]}
    assert min(p_values.values()) > P_THRESHOLD, p_values
    assert max(target.batch_sizes) == 8
    drafted = sum(1 for evs in events.values() for e in evs if e.from_draft)
    assert drafted > n // 2  # drafts were accepted, so the acceptance path ran


def test_load_aware_sequences_held_at_ar_verify_lookup_drafts_in_free_room():
    """A drafter whose drafts are always wrong keeps every load-aware sequence at AR steps; where the
    call's cost is flat, the text's repeats still get their n-gram lookup drafts verified (no
    drafter call), on a steep curve much less, and every sequence equals its AR run alone."""
    from ovdflash.decode.block_policy import BatchDraftPolicy

    def cycle(seq):  # the target repeats the token 3 back, with a nudge so that cycles can break
        logits = np.zeros(VOCAB, dtype=np.float32)
        logits[seq[-3] if len(seq) >= 3 else 0] = 5.0
        logits[(sum(seq) * 7) % VOCAB] += 4.0
        return logits

    def make_target():
        return MockTarget(vocab_size=VOCAB, max_length=4096, logits_fn=cycle)

    def run(call_s):
        target = MockBatchTarget(make_target=make_target)
        # the drafter is known to be useless: every sequence starts (and stays) at AR steps
        policy = BatchDraftPolicy(list(range(1, 65)), call_s, [0.0] + [0.002] * 7, prior_acceptance=0.01,
                                  prior_strength=100.0)
        scheduler = Scheduler(target, MockDrafterSource(target, error_rate=1.0), max_batch_size=4,
                              draft_policy=policy)
        prompts = [[3, 4, 5, 6] * 6, [7, 8, 9] * 8, [1, 2] * 10, [5, 9, 5, 9, 5]]
        stats = [scheduler.add(i, p, 30, SamplingParams(), 8, True, (), load_aware=True)
                 for i, p in enumerate(prompts)]
        events = drain(scheduler)
        for i, p in enumerate(prompts):
            want = generate(make_target(), None, p, 30, SamplingParams(), (), 1)
            assert [e.token for e in events[i]] == [e.token for e in want], i
        return stats

    flat = run([0.020] * 32 + [0.020 + 0.003 * t for t in range(1, 33)])
    # probes alone (every 16, 32, ... AR rounds) verify a few: 4 lookup rounds, 8 tokens accepted
    assert sum(s.num_accepted_tokens for s in flat) > 40 and sum(s.num_lookup_drafts for s in flat) > 12
    steep = run([0.020 + 0.01 * t for t in range(64)])  # every extra token costs half an AR step
    assert sum(s.num_lookup_drafts for s in steep) < sum(s.num_lookup_drafts for s in flat) / 2
    policy = BatchDraftPolicy([1, 4, 8], [0.02, 0.02, 0.04], [0.0, 0.001])
    assert policy.free_tokens(1) == 3 and policy.free_tokens(4) == 0 and policy.free_tokens(2) == 2


def test_the_policy_learns_the_drafter_calls_it_chose_and_no_lookup_drafts():
    from ovdflash.decode.block_policy import BatchDraftPolicy

    class Recording(BatchDraftPolicy):
        def observe_draft(self, num_drafts, seconds):
            self.seen.append((num_drafts, seconds))
            super().observe_draft(num_drafts, seconds)

    target = MockBatchTarget(make_target=lambda: MockTarget(vocab_size=VOCAB, seed=3))
    policy = Recording(list(range(1, 65)), [0.020] * 64, [0.0] + [0.001] * 3, cost_update_rate=0.0, drift_rate=0.0)
    policy.seen = []
    scheduler = Scheduler(target, MockDrafterSource(target, block_size=4), max_batch_size=4, draft_policy=policy)
    prompts = [[3, 4, 5, 6] * 4, [7, 8, 9], [1, 2] * 5]
    stats = [scheduler.add(i, p, 20, SamplingParams(), 4, True, (), load_aware=True) for i, p in enumerate(prompts)]
    drain(scheduler)
    drafter_rounds = sum(s.num_drafts - s.num_lookup_drafts for s in stats)
    assert drafter_rounds > 0 and len(policy.seen) == drafter_rounds
    assert all(1 <= k <= 3 and seconds > 0 for k, seconds in policy.seen)


def test_a_shared_drafter_call_is_learnt_once_a_round_and_lookup_rounds_teach_the_lookup():
    """With drafter rows (one call for a round's sequences) the policy times the round's one call, for
    its largest k; rounds on lookup drafts teach the lookup's acceptance, the drafter's rounds its own."""
    from ovdflash.decode.block_policy import BatchDraftPolicy

    class Recording(BatchDraftPolicy):
        def observe_draft(self, num_drafts, seconds):
            self.seen.append((num_drafts, seconds))
            super().observe_draft(num_drafts, seconds)

        def observe(self, state, num_drafted, num_accepted, from_lookup=False):
            self.sources.append(from_lookup)
            super().observe(state, num_drafted, num_accepted, from_lookup)

    target = MockBatchTarget(make_target=lambda: MockTarget(vocab_size=VOCAB, seed=3))
    policy = Recording(list(range(1, 65)), [0.020] * 64, [0.0] + [0.001] * 3, cost_update_rate=0.0, drift_rate=0.0,
                       shared_draft_call=True)
    policy.seen, policy.sources = [], []
    drafters = MockRowsSource(target)
    scheduler = Scheduler(target, drafters, max_batch_size=4, draft_policy=policy)
    prompts = [[3, 4, 5, 6] * 4, [7, 8, 9], [1, 2] * 5, [9, 8, 7, 6, 5]]
    stats = [scheduler.add(i, p, 24, SamplingParams(), 4, True, (), load_aware=True) for i, p in enumerate(prompts)]
    events = drain(scheduler)
    for i, p in enumerate(prompts):
        want = generate(MockTarget(vocab_size=VOCAB, seed=3), None, p, 24, SamplingParams(), (), 1)
        assert [e.token for e in events[i]] == [e.token for e in want], i
    assert len(policy.seen) == len(drafters.call_sizes) > 0 and max(drafters.call_sizes) >= 2
    assert all(1 <= k <= 3 and seconds > 0 for k, seconds in policy.seen)
    lookup_rounds = sum(s.num_lookup_drafts for s in stats)
    assert lookup_rounds > 0 and policy.sources.count(True) == lookup_rounds
    assert policy.sources.count(False) == sum(s.num_drafts - s.num_lookup_drafts for s in stats) > 0


# -- chunked prefill: a per-round token budget ------------------------------------------------------
@pytest.mark.parametrize("budget", [1, 5, 23])
@pytest.mark.parametrize("sampled", [False, True])
def test_a_token_budget_chunks_prefills_and_every_sequence_still_equals_its_run_alone(budget, sampled):
    """Prompts of up to 60 tokens prefill over many rounds; the mock drafter checks it gets exactly the
    committed tokens' features, so every chunk's features reach its context."""
    rng = np.random.default_rng(budget + 10 * sampled)
    target = MockBatchTarget()
    scheduler = Scheduler(target, MockDrafterSource(target), max_batch_size=4, max_num_batched_tokens=budget)
    reqs = random_requests(rng, 8, sampled)
    reqs = [(rid, prompt * 2, *rest) for rid, prompt, *rest in reqs]  # longer prompts: more chunks
    events = drain(scheduler, {0: reqs[:5], 4: reqs[5:]})
    for rid, prompt, max_new, params, block, lookup, eos in reqs:
        assert events[rid] == alone(prompt, max_new, block, params, eos, lookup), rid
    assert scheduler.num_steps > max(len(r[1]) for r in reqs) // max(budget, 16)  # prefills took several rounds
    assert not target.seqs and not scheduler.running


def test_a_long_prefill_blocks_neither_new_requests_nor_running_sequences():
    """With a 16-token budget a 400-token prompt prefills over 25+ rounds: a short request arriving in
    the middle gets its first token one round after it joins, and a running sequence gets at least
    one token every round of the long prefill."""
    target = MockBatchTarget()
    scheduler = Scheduler(target, MockDrafterSource(target), max_batch_size=4, max_num_batched_tokens=16)
    long_prompt = (np.arange(400) % VOCAB).tolist()
    scheduler.add("running", [1, 2, 3], 200, SamplingParams(), 4, False, ())
    scheduler.step()  # its prefill
    scheduler.add("long", long_prompt, 5, SamplingParams(), 4, False, ())
    rounds, per_round, events = {}, [], {}
    for step in range(40):
        if step == 6:
            scheduler.add("short", [7, 8, 9, 10, 11], 5, SamplingParams(), 4, False, ())
        got = dict(scheduler.step())
        per_round.append(got)
        for rid, evs in got.items():
            rounds.setdefault(rid, step)
            events.setdefault(rid, []).extend(evs)
    assert rounds["short"] == 6  # the round it was added in, not after the long prompt's prefill
    assert rounds["long"] > 20
    assert all(len(got.get("running", [])) >= 1 for got in per_round[:rounds["long"] + 1])
    assert max(target.batch_sizes) == 3
    for rid, evs in drain(scheduler).items():
        events[rid].extend(evs)
    assert events["long"] == alone(long_prompt, 5, 4) and events["short"] == alone([7, 8, 9, 10, 11], 5, 4)


def test_load_aware_drafts_with_a_token_budget_equal_ar():
    from ovdflash.decode.block_policy import BatchDraftPolicy

    target = MockBatchTarget()
    policy = BatchDraftPolicy(list(range(1, 65)), [0.020 + 0.0002 * t for t in range(1, 65)], [0.0] + [0.0005] * 7)
    scheduler = Scheduler(target, MockDrafterSource(target), max_batch_size=3, draft_policy=policy,
                          max_num_batched_tokens=12)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (40, 3, 25, 60, 9)]
    for i, p in enumerate(prompts):
        scheduler.add(i, p, 20, SamplingParams(), 8, i % 2 == 0, (), load_aware=True)
    events = drain(scheduler)
    for i, p in enumerate(prompts):
        assert [e.token for e in events[i]] == [e.token for e in alone(p, 20, 1)], i


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "256"])
def test_a_bad_token_budget_is_a_one_line_error(bad):
    with pytest.raises(ValueError, match="max_num_batched_tokens must be an integer >= 1") as info:
        Scheduler(MockBatchTarget(), max_num_batched_tokens=bad)
    assert "\n" not in str(info.value)


# -- whole prompts, grouped up to prefill_batch_tokens a round ---------------------------------------
def test_a_burst_prefills_whole_prompts_a_few_at_a_time_and_every_sequence_equals_its_run_alone():
    """Four 30-token prompts at once with prefill_batch_tokens=40: one prompt a round (in arrival
    order), so the first reply starts after one prefill, not four; the running ones verify in the
    same calls. Small prompts share a round while they fit; output is unchanged."""
    target = MockBatchTarget()
    scheduler = Scheduler(target, MockDrafterSource(target), max_batch_size=8, prefill_batch_tokens=40)
    rng = np.random.default_rng(21)
    burst = [(f"b{i}", rng.integers(0, VOCAB, size=30).tolist(), 12, SamplingParams(), 4, False, ())
             for i in range(4)]
    for r in burst:
        scheduler.add(*r)
    first_round, events = {}, {}
    for step in range(4):
        for rid, evs in scheduler.step():
            first_round.setdefault(rid, step)
            events.setdefault(rid, []).extend(evs)
    assert first_round == {"b0": 0, "b1": 1, "b2": 2, "b3": 3}
    assert target.batch_sizes[:4] == [1, 2, 3, 4]  # each round: one prefill beside the verifies
    small = [(f"s{i}", rng.integers(0, VOCAB, size=8).tolist(), 6, SamplingParams(), 4, False, ()) for i in range(5)]
    calls_before = target.num_forward_calls
    for rid, evs in drain(scheduler, {0: small}).items():
        events.setdefault(rid, []).extend(evs)
    for rid, prompt, max_new, params, block, lookup, eos in burst + small:
        assert events[rid] == alone(prompt, max_new, block, params, eos, lookup), rid
    assert target.batch_sizes[calls_before] == 8  # 4 verifies and 4 of the 8-token prompts (32 <= 40) in one call


def test_a_prompt_longer_than_prefill_batch_tokens_still_prefills_whole():
    target = MockBatchTarget()
    scheduler = Scheduler(target, MockDrafterSource(target), max_batch_size=2, prefill_batch_tokens=4)
    prompt = (np.arange(50) % VOCAB).tolist()
    scheduler.add("long", prompt, 5, SamplingParams(), 4, False, ())
    events = dict(scheduler.step())
    assert len(events["long"]) >= 1 and target.batch_sizes == [1]  # one round, the whole prompt
    events["long"] += drain(scheduler)["long"]
    assert events["long"] == alone(prompt, 5, 4)
    with pytest.raises(ValueError, match="prefill_batch_tokens must be an integer >= 1"):
        Scheduler(MockBatchTarget(), prefill_batch_tokens=0)


def test_prefill_groups_take_shortest_first_among_prompts_admitted_together_and_never_overtake_earlier_ones():
    target = MockBatchTarget()
    scheduler = Scheduler(target, MockDrafterSource(target), max_batch_size=8, prefill_batch_tokens=40)
    rng = np.random.default_rng(4)
    reqs = {n: (f"p{n}", rng.integers(0, VOCAB, size=n).tolist(), 8, SamplingParams(), 4, False, ())
            for n in (30, 10, 20)}
    for r in reqs.values():
        scheduler.add(*r)
    assert sorted(rid for rid, _ in scheduler.step()) == ["p10", "p20"]  # 10 + 20 fit 40, the 30 waits
    late = ("late", rng.integers(0, VOCAB, size=15).tolist(), 8, SamplingParams(), 4, False, ())
    scheduler.add(*late)
    firsts = [rid for rid, evs in scheduler.step() if rid in ("p30", "late")]
    assert firsts == ["p30"]  # admitted a round earlier: the shorter latecomer (30 + 15 > 40) waits for it
    got = [evs for rid, evs in scheduler.step() if rid == "late"]
    assert len(got) == 1
    assert got[0] + drain(scheduler).get("late", []) == alone(late[1], 8, 4)
