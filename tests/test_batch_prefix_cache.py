"""KV blocks shared across batched requests (OVPagedBatchTarget's prefix cache) on the tiny pair under
STRICT_F32: a request whose prompt begins with full blocks that an earlier or a running sequence
computed prefills only the rest, and every sequence's tokens and drafts equal its run alone with a
full prefill (greedy, seeded sampling, lookup, AR); a prompt that parts from a cached block mid-block
starts from a copy of its shared tokens, with the same tokens and drafts; shared blocks are counted
once; cached blocks nobody holds are evicted under pressure, and the pool's books balance after
every run."""
import numpy as np
import pytest

from ovdflash import STRICT_F32, DFlashPipeline
from ovdflash.decode.sampling import SamplingParams
from ovdflash.decode.scheduler import Scheduler
from ovdflash.ov.block_pool import block_digest
from ovdflash.ov.paged_batch import DrafterPool, batch_target_for


@pytest.fixture(scope="module")
def pipe(tiny_pair, tmp_path_factory):
    return DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("cache"),
                                          INFERENCE_NUM_THREADS=1, prefix_cache=False, **STRICT_F32)


def alone(pipe, prompt, max_new, **kwargs):
    """(tokens, stats) of one prompt through the single-sequence engine with a full prefill."""
    tokens = [e.token for e in pipe.generate_tokens(prompt, max_new, prefix_cache=False, eos_token_ids=[], **kwargs)]
    return tokens, pipe.last_stats


def balanced(target):
    """Every allocated block is free, held, or cached and idle; nothing is booked after a run."""
    assert target.num_reserved == 0 and not target.seqs
    assert len(target.free) + len(target.evictable) == target.num_blocks
    assert set(target.digest_of) == set(target.cached.values())
    assert len(target.evictable) == len(target.cached)


def run(scheduler, requests, join_at=None):
    """Events per request id; requests[join_at:] are added after the first round."""
    join_at = len(requests) if join_at is None else join_at
    for r in requests[:join_at]:
        scheduler.add(*r[:-1], **r[-1])
    events, step = {}, 0
    while scheduler.has_work():
        if step == 1:
            for r in requests[join_at:]:
                scheduler.add(*r[:-1], **r[-1])
        for rid, evs in scheduler.step():
            events.setdefault(rid, []).extend(e.token for e in evs)
        step += 1
    return events


@pytest.mark.parametrize("mode", ["greedy", "seeded", "lookup", "ar"])
def test_a_shared_system_prompt_is_prefilled_once_and_outputs_equal_full_prefills(pipe, mode):
    target = batch_target_for(pipe.target, pool_blocks=96)
    scheduler = Scheduler(target, DrafterPool(pipe.drafter), max_batch_size=3)
    rng = np.random.default_rng(1)
    b = target.block_tokens
    system = rng.integers(1, 500, size=2 * b + 5).tolist()  # two full blocks and a part
    params = SamplingParams(0.9, 1.0, 20, 7) if mode == "seeded" else SamplingParams()
    block = 1 if mode == "ar" else 4
    requests = [(i, system + rng.integers(1, 500, size=int(rng.integers(1, 12))).tolist(), 10 + i, params, block,
                 mode == "lookup", (), {}) for i in range(6)]
    events = run(scheduler, requests, join_at=1)
    kwargs = {"temperature": 0.9, "top_k": 20, "seed": 7} if mode == "seeded" else {}
    for rid, prompt, max_new, *_ in requests:
        tokens, ref = alone(pipe, prompt, max_new, block_size=block, prompt_lookup=mode == "lookup", **kwargs)
        assert events[rid] == tokens, rid
    # the first request computed the shared blocks; every later one found them, and the three admitted
    # after a request ended also copied the system's last 5 tokens from that request's partly filled block
    assert target.num_prefix_hits == 5 * 2 * b + 3 * 5
    assert target.num_prefix_queries == sum(len(r[1]) for r in requests)
    balanced(target)
    assert len(target.cached) >= 2


@pytest.mark.parametrize("mode", ["greedy", "seeded", "lookup"])
def test_prompts_parting_mid_block_reuse_the_shared_part_and_equal_full_prefills(pipe, mode):
    """A system prompt of a block and a half, cached by an earlier request: three requests at once reuse
    all of it (the half block copied into a block of each), and tokens and drafts equal a full prefill's."""
    target = batch_target_for(pipe.target, pool_blocks=96)
    scheduler = Scheduler(target, DrafterPool(pipe.drafter), max_batch_size=3)
    rng = np.random.default_rng(11)
    b = target.block_tokens
    system = rng.integers(1, 500, size=b + b // 2).tolist()
    params = SamplingParams(0.9, 1.0, 20, 7) if mode == "seeded" else SamplingParams()
    lookup = mode == "lookup"
    run(scheduler, [("first", system + rng.integers(1, 500, size=b).tolist(), 4, params, 4, lookup, (), {})])
    requests = [(i, system + rng.integers(1, 500, size=int(rng.integers(1, 12))).tolist(), 10 + i, params, 4,
                 lookup, (), {}) for i in range(3)]
    # the drafter's context from the copied part: the features a full prefill gives those tokens
    assert target.reserve("probe", 64, requests[0][1]) and target.committed("probe") == len(system)
    pipe.target.reset()
    _, full = pipe.target.forward(np.asarray(requests[0][1], dtype=np.int64), all_logits=False)
    np.testing.assert_allclose(target.cached_features("probe"), full[:len(system)], rtol=1e-5, atol=1e-5)
    target.release("probe")
    stats = {r[0]: scheduler.add(*r[:-1]) for r in requests}
    events = run(scheduler, [])
    kwargs = {"temperature": 0.9, "top_k": 20, "seed": 7} if mode == "seeded" else {}
    for rid, prompt, max_new, *_ in requests:
        tokens, ref = alone(pipe, prompt, max_new, block_size=4, prompt_lookup=lookup, **kwargs)
        got = stats[rid]
        assert events[rid] == tokens, rid
        assert (got.num_draft_tokens, got.num_accepted_tokens, got.accepted_per_position) == \
            (ref.num_draft_tokens, ref.num_accepted_tokens, ref.accepted_per_position), rid
        assert got.num_cached_prompt_tokens == len(system), rid
    balanced(target)


def test_cached_context_gives_the_drafter_the_same_drafts(pipe):
    """The drafter's context from cached features equals a full prefill's: same drafts, same acceptance."""
    target = batch_target_for(pipe.target, pool_blocks=96)
    scheduler = Scheduler(target, DrafterPool(pipe.drafter), max_batch_size=4)
    rng = np.random.default_rng(2)
    system = rng.integers(1, 500, size=3 * target.block_tokens).tolist()
    prompts = [system + rng.integers(1, 500, size=n).tolist() for n in (1, 4, 9)]
    stats = {}
    for i, prompt in enumerate(prompts):  # one after another: each finds the earlier ones' blocks
        stats[i] = scheduler.add(i, prompt, 16, SamplingParams(), 4)
        while scheduler.has_work():
            scheduler.step()
        _, ref = alone(pipe, prompt, 16, block_size=4, prompt_lookup=False)
        got = stats[i]
        assert (got.num_draft_tokens, got.num_accepted_tokens, got.accepted_per_position) == \
            (ref.num_draft_tokens, ref.num_accepted_tokens, ref.accepted_per_position), i
    b = target.block_tokens
    assert [stats[i].num_cached_prompt_tokens for i in range(3)] == [0, 3 * b, 3 * b]
    # the tiny drafter accepts alike from many contexts: compare the context itself with a full prefill's
    assert target.reserve("probe", 64, prompts[1])
    reused = target.committed("probe")
    assert reused == len(prompts[1]) - 1  # prompt 1's run left every token cached, its last one excepted
    pipe.target.reset()
    _, full = pipe.target.forward(np.asarray(prompts[1], dtype=np.int64), all_logits=False)
    np.testing.assert_allclose(target.cached_features("probe"), full[:reused], rtol=1e-5, atol=1e-5)
    target.release("probe")
    balanced(target)


def test_a_conversation_turn_reuses_the_generated_reply(pipe):
    """Turn 2's prompt is turn 1's prompt + reply + more: the reply's full blocks were cached as they were
    committed and its last, partly filled block when turn 1 ended, so every committed token is
    reused, and the answer equals a full prefill's."""
    target = batch_target_for(pipe.target, pool_blocks=96)
    scheduler = Scheduler(target, DrafterPool(pipe.drafter), max_batch_size=2)
    b = target.block_tokens
    rng = np.random.default_rng(4)
    first = rng.integers(1, 500, size=b + 3).tolist()
    events = run(scheduler, [("t1", first, 2 * b, SamplingParams(), 4, False, (), {})])
    second = first + events["t1"] + rng.integers(1, 500, size=5).tolist()
    stats = scheduler.add("t2", second, 12, SamplingParams(), 4)
    events.update(run(scheduler, []))
    assert events["t2"] == alone(pipe, second, 12, block_size=4, prompt_lookup=False)[0]
    # the last token sampled in turn 1 never had KV
    assert stats.num_cached_prompt_tokens == len(first) + 2 * b - 1
    balanced(target)


def test_reuse_off_per_request_and_on_the_target(pipe):
    target = batch_target_for(pipe.target, pool_blocks=64)
    scheduler = Scheduler(target, DrafterPool(pipe.drafter))
    prompt = list(range(1, 2 * target.block_tokens + 2))
    run(scheduler, [("a", prompt, 4, SamplingParams(), 4, False, (), {})])
    stats = scheduler.add("b", prompt, 4, SamplingParams(), 4, reuse_prefix=False)
    run(scheduler, [])
    assert stats.num_cached_prompt_tokens == 0 and target.num_prefix_hits == 0
    off = batch_target_for(pipe.target, pool_blocks=64, prefix_caching=False)
    assert not off.caches_prefixes and off.features.size == 0
    scheduler = Scheduler(off, DrafterPool(pipe.drafter))
    events = run(scheduler, [(i, prompt, 4, SamplingParams(), 4, False, (), {}) for i in range(2)], join_at=1)
    assert events[0] == events[1] and not off.cached
    assert off.num_reserved == 0 and len(off.free) == off.num_blocks


def test_shared_blocks_are_booked_once_and_evicted_under_pressure(pipe):
    """A pool just large enough: blocks two running sequences share count once; cached blocks nobody
    holds are evicted, tail first, when new sequences need room, and outputs never change."""
    b = pipe.batch_target().block_tokens
    target = batch_target_for(pipe.target, pool_blocks=6)
    prefix = list(range(1, 2 * b + 1))
    # 2 shared blocks + 2 own blocks each: two sequences fit together only by sharing
    assert target.reserve("x", 4 * b, prefix + [7] * (2 * b)) and target.committed("x") == 0
    target.forward([("x", prefix, [0])])
    feats = np.ones((2 * b, target.features.shape[-1]), dtype=np.float32)
    target.commit("x", 2 * b, prefix, feats)
    assert len(target.cached) == 2
    assert target.reserve("y", 4 * b, prefix + [9] * (2 * b))
    assert target.committed("y") == 2 * b and target.num_reserved == 6 and target.free_blocks == 0
    assert np.array_equal(target.cached_features("y"), feats)
    assert not target.reserve("z", b, [5] * b)  # the pool is full: z waits
    target.release("x")
    target.release("y")
    assert target.free_blocks == 6 and len(target.evictable) == 2
    chain = list(target.evictable)
    assert chain[0] == block_digest(block_digest(b"", np.array(prefix[:b])), np.array(prefix[b:]))  # tail first

    scheduler = Scheduler(target, DrafterPool(pipe.drafter), max_batch_size=2)
    rng = np.random.default_rng(6)
    requests = [(i, rng.integers(1, 500, size=int(rng.integers(b, 2 * b))).tolist(), 12, SamplingParams(), 4,
                 False, (), {}) for i in range(5)]
    events = run(scheduler, requests)
    for rid, prompt, max_new, *_ in requests:
        assert events[rid] == alone(pipe, prompt, max_new, block_size=4, prompt_lookup=False)[0], rid
    assert target.num_evicted > 0 and target.num_blocks <= 6
    balanced(target)


def test_generate_batch_reuses_across_calls_and_can_be_turned_off(pipe):
    rng = np.random.default_rng(8)
    b = pipe.batch_target().block_tokens
    system = rng.integers(1, 500, size=2 * b).tolist()
    prompts = [system + rng.integers(1, 500, size=n).tolist() for n in (3, 8)]
    want = [alone(pipe, p, 8, block_size=4)[0] for p in prompts]
    pipe.prefix_cache = True
    try:
        first = pipe.generate_batch(prompts[:1], max_new_tokens=8, block_size=4)
        again = pipe.generate_batch(prompts, max_new_tokens=8, block_size=4)
        assert [r.token_ids for r in again] == want and first[0].token_ids == want[0]
        # the first prompt again: all but its last token, two of them copied from the first call's last block
        assert [r.stats.num_cached_prompt_tokens for r in again] == [2 * b + 2, 2 * b]
        off = pipe.generate_batch(prompts, max_new_tokens=8, block_size=4, prefix_cache=False)
        assert [r.stats.num_cached_prompt_tokens for r in off] == [0, 0]
        assert [r.token_ids for r in off] == want
    finally:
        pipe.prefix_cache = False
    assert not pipe.batch_target().caches_prefixes  # the pipeline's setting decides the runner's
