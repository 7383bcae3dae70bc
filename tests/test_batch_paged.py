"""The batched paged target on the tiny exported pair (STRICT_F32): each sequence equals its run alone."""
import numpy as np
import pytest

from ovdflash import STRICT_F32, DFlashPipeline
from ovdflash.decode.lookup import NgramLookup
from ovdflash.decode.sampling import SamplingParams
from ovdflash.decode.scheduler import Scheduler
from ovdflash.decode.sequence import generate
from ovdflash.ov.block_pool import PoolExhaustedError
from ovdflash.ov.paged_batch import DrafterPool, batch_target_for


@pytest.fixture(scope="module")
def pipe(tiny_pair, tmp_path_factory):
    return DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("cache"),
                                          INFERENCE_NUM_THREADS=1, **STRICT_F32)


def alone(pipe, prompt, max_new, block, lookup):
    drafter = pipe.drafter if block > 1 else None
    return list(generate(pipe.target, drafter, prompt, max_new, SamplingParams(), (), block,
                         lookup=NgramLookup() if lookup and drafter else None))


def test_greedy_batch_equals_alone_with_joins(pipe):
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(8):
        prompt = rng.integers(1, 500, size=int(rng.integers(3, 40))).tolist()
        reqs.append((i, prompt, int(rng.integers(1, 14)), SamplingParams(), int(rng.choice([1, 2, 4])), i % 3 == 0, ()))
    target = batch_target_for(pipe.target, pool_blocks=64)
    scheduler = Scheduler(target, DrafterPool(pipe.drafter), max_batch_size=5)
    events, step = {}, 0
    for r in reqs[:6]:
        scheduler.add(*r)
    while scheduler.has_work():
        if step == 2:
            for r in reqs[6:]:
                scheduler.add(*r)
        for rid, evs in scheduler.step():
            events.setdefault(rid, []).extend(evs)
        step += 1
    for rid, prompt, max_new, _, block, lookup, _ in reqs:
        assert events[rid] == alone(pipe, prompt, max_new, block, lookup), rid
    assert target.num_reserved == 0 and len(target.free) + len(target.evictable) == target.num_blocks


def test_pool_limit_waits_and_refuses_cleanly(pipe):
    target = batch_target_for(pipe.target, pool_blocks=2)
    scheduler = Scheduler(target, DrafterPool(pipe.drafter))
    per_block = target.block_tokens
    prompt = list(range(1, per_block))  # one block each with its new tokens
    for i in range(3):
        scheduler.add(i, prompt, 1, SamplingParams(), 2, False, ())
    with pytest.raises(ValueError, match="whole pool"):
        scheduler.add("big", list(range(1, 3 * per_block)), 4)
    with pytest.raises(PoolExhaustedError):
        target.reserve("big", 3 * per_block)
    sizes = []
    while scheduler.has_work():
        sizes.append(len(scheduler.step()))
    assert max(sizes) == 2 and target.num_blocks <= 2


def test_generate_batch_equals_generate_alone(pipe):
    """The public batch API: greedy and seeded sampling, mixed prompt lengths, a stop string."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 500, size=int(n)).tolist() for n in (3, 17, 9, 31, 5)]
    for kwargs in ({"block_size": 4}, {"block_size": 1}, {"block_size": 4, "temperature": 0.9, "seed": 11},
                   {"block_size": 2, "prompt_lookup": True}):
        batch = pipe.generate_batch(prompts, max_new_tokens=10, max_batch_size=3, **kwargs)
        for prompt, got in zip(prompts, batch):
            want = list(pipe.generate_tokens(prompt, 10, **kwargs))
            assert got.token_ids == [e.token for e in want], kwargs
            assert got.finish_reason == want[-1].finish_reason
            alone_stats = pipe.last_stats
            assert got.stats.num_output_tokens == len(want) == alone_stats.num_output_tokens
            assert got.stats.num_accepted_tokens == alone_stats.num_accepted_tokens
    with pytest.raises(ValueError, match="trained block size"):
        pipe.generate_batch(prompts, block_size=pipe.block_size + 1)
    with pytest.raises(TypeError, match="list of prompts"):
        pipe.generate_batch("one string")


def test_load_aware_batch_equals_generate_alone(pipe):
    """block_size="auto" in a batch: the policy picks each round's drafts (some AR steps, some
    blocks), and every sequence still equals its greedy / seeded run alone."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 500, size=int(n)).tolist() for n in (4, 23, 11, 30, 7, 15)]
    for kwargs in ({}, {"temperature": 0.8, "seed": 3}):
        batch = pipe.generate_batch(prompts, max_new_tokens=12, max_batch_size=4, block_size="auto", **kwargs)
        for prompt, got in zip(prompts, batch):
            want = list(pipe.generate_tokens(prompt, 12, block_size=1, **kwargs))
            assert got.token_ids == [e.token for e in want], kwargs
            assert got.finish_reason == want[-1].finish_reason
    policy = pipe.batch_draft_policy()
    assert policy.call_tokens[0] == 1 and len(policy.call_tokens) > 4
    assert policy.call_cost_s == sorted(policy.call_cost_s) and policy.call_cost_s[0] > 0
    assert policy.draft_cost_s[0] == 0 and policy.draft_cost_s[1] > 0
    target = pipe.batch_target()
    # calibration gave its blocks back
    assert target.num_reserved == 0 and len(target.free) + len(target.evictable) == target.num_blocks


def test_batching_another_runner_is_one_line_naming_the_fix(tiny_pair, tmp_path):
    stateful = DFlashPipeline.from_pretrained(tiny_pair, target_runner="stateful", cache_dir=tmp_path,
                                              INFERENCE_NUM_THREADS=1, **STRICT_F32)
    with pytest.raises(ValueError, match="has 'stateful'.*--target-runner paged") as info:
        stateful.generate_batch([[5, 6, 7]], max_new_tokens=2)
    assert "\n" not in str(info.value)
