"""The block pool's books alone (no model): how much storage varied traffic touches.

Checked: a stream of distinct prompts touches at most the blocks its running sequences hold plus
`max_idle_cached` cached ones, and the storage grows only once every block in it was used (so a
growth copies used blocks only); a bound as large as the pool keeps every prefix, as before; the
most recently released prefix survives a small bound; freed blocks are reused before new ones;
bad bounds are ValueErrors.
"""
import numpy as np
import pytest

from ovdflash.ov.block_pool import BlockPool, default_idle_cached

B = 4  # tokens a block


class Storage:
    """A grow callback that doubles, and records the pool's books at every growth."""

    def __init__(self):
        self.blocks = 0
        self.pool = None
        self.grown_when_used = []

    def __call__(self, needed: int, limit: int) -> int:
        if self.pool is not None:
            self.grown_when_used.append(self.pool.num_touched == self.pool.num_allocated)
        if needed > self.blocks:
            self.blocks = min(max(needed, 2 * self.blocks), limit)
        return self.blocks


def make_pool(pool_blocks, max_idle_cached=None, initial_blocks=2):
    storage = Storage()
    pool = BlockPool(pool_blocks, B, 10_000, storage, initial_blocks, True, max_idle_cached)
    storage.pool = pool
    return pool, storage


def serve(pool, seq_id, prompt, new_tokens):
    """One request's life in the books: reserve, prefill the uncached rest, decode, release."""
    assert pool.reserve(seq_id, len(prompt) + new_tokens, prompt)
    start = pool.committed(seq_id)
    pool.write(seq_id, len(prompt) - start)
    pool.commit(seq_id, len(prompt) - start, prompt[start:])
    for t in range(new_tokens):
        pool.write(seq_id, 1)
        pool.commit(seq_id, 1, [10_000 + t])
    held = pool.num_referenced
    pool.release(seq_id)
    return held


@pytest.mark.parametrize("max_idle_cached", [0, 3, 10])
def test_distinct_prompts_touch_what_runs_plus_the_bound(max_idle_cached):
    pool, storage = make_pool(200, max_idle_cached)
    rng = np.random.default_rng(0)
    most_held = 0
    for i in range(60):
        prompt = rng.integers(1, 1000, size=int(rng.integers(2, 6 * B))).tolist()
        most_held = max(most_held, serve(pool, i, prompt, int(rng.integers(1, 3 * B))))
        assert pool.num_touched <= most_held + max_idle_cached
    assert pool.num_evicted > 0
    assert 0 < len(pool.prefixes.evictable) <= most_held + max_idle_cached
    assert storage.grown_when_used and all(storage.grown_when_used)
    assert pool.free_blocks == pool.pool_blocks and pool.num_reserved == 0


def pool_after_prompts(max_idle_cached: int, count: int, seed: int):
    """A pool of 200 blocks that served `count` distinct 3-block prompts one after another."""
    pool, _ = make_pool(200, max_idle_cached)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 1000, size=3 * B + 1).tolist() for _ in range(count)]
    for i, prompt in enumerate(prompts):
        serve(pool, i, prompt, 2)
    return pool, prompts


def test_a_bound_as_large_as_the_pool_keeps_every_prefix():
    pool, prompts = pool_after_prompts(200, 20, seed=1)
    assert pool.num_evicted == 0 and pool.num_touched >= 20 * 3
    assert pool.reserve("again", 3 * B + 3, prompts[0]) and pool.committed("again") == 3 * B


def test_a_small_bound_keeps_the_latest_prefix_and_evicts_the_oldest():
    pool, prompts = pool_after_prompts(6, 10, seed=2)
    assert pool.num_evicted > 0
    assert pool.reserve("latest", 3 * B + 3, prompts[-1]) and pool.committed("latest") == 3 * B
    assert pool.reserve("oldest", 3 * B + 3, prompts[0]) and pool.committed("oldest") == 0


def test_freed_blocks_go_before_new_ones():
    pool, _ = make_pool(50, max_idle_cached=50, initial_blocks=8)
    pool.caches_prefixes = False
    for i in range(5):
        serve(pool, i, list(range(1, 2 * B + 1)), B)  # 3 blocks a request, all freed after it
    assert pool.num_touched == 3 and pool.num_allocated == 8


def test_bad_bounds_are_value_errors():
    assert default_idle_cached(64) == 16 and default_idle_cached(2) == 1
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(ValueError, match="max_idle_cached must be an integer >= 0"):
            BlockPool(8, B, 100, Storage(), 2, True, bad)
