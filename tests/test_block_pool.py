"""The block pool's books alone (no model): how much storage varied traffic touches.

Checked: a stream of distinct prompts touches at most the blocks its running sequences hold plus
`max_idle_cached` cached ones, and the storage grows only once every block in it was used (so a
growth copies used blocks only); a bound as large as the pool keeps every prefix, as before; the
most recently released prefix survives a small bound; freed blocks are reused before new ones;
bad bounds are ValueErrors. Reuse within a block: a prompt that parts from a cached block mid-block
starts from a copy of it holding exactly the shared tokens (checked on storage that records the
token at every slot, through random traffic with evictions), never from a block with room too
short to copy into, and not at all without a copy callback; a released sequence's partly filled
last block is copied by the next turn of its conversation. Copies only up to a state (a hybrid
target's books, its linear-attention states emulated by a set of digests, kept where a prompt ends
and where a sequence ends): nothing is shared or copied past the last point with a state, a next
turn reuses every committed token of the last one, or its prompt alone where it parts after it
(the copied block's matched blocks not cut), and random traffic reads back its own tokens.
"""
import numpy as np
import pytest

from ovdflash.ov.block_pool import BlockPool, block_digest, default_idle_cached

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


class Contents:
    """Storage whose blocks record the token written at every slot; `copy` is the pool's copy_block."""

    def __init__(self):
        self.blocks: dict[int, np.ndarray] = {}
        self.copies: list[tuple[int, int]] = []

    def grow(self, needed: int, limit: int) -> int:
        size = min(max(needed, 2 * len(self.blocks)), limit) if needed > len(self.blocks) else len(self.blocks)
        for block in range(len(self.blocks), size):
            self.blocks[block] = np.full(B, -1)
        return len(self.blocks)

    def copy(self, source: int, block: int) -> None:
        self.copies.append((source, block))
        self.blocks[block] = self.blocks[source].copy()

    def read(self, pool, seq_id, end: int) -> list[int]:
        blocks, slots = pool.slots(seq_id, 0, end)
        return [int(self.blocks[b][s]) for b, s in zip(blocks, slots)]

    def write(self, pool, seq_id, tokens) -> None:
        start = pool.committed(seq_id)
        pool.write(seq_id, len(tokens))
        for (b, s), t in zip(zip(*pool.slots(seq_id, start, start + len(tokens))), tokens):
            self.blocks[int(b)][s] = t
        pool.commit(seq_id, len(tokens), tokens)


def copying_pool(pool_blocks=200, max_idle_cached=None, copy=True):
    contents = Contents()
    pool = BlockPool(pool_blocks, B, 10_000, contents.grow, 2, True, max_idle_cached,
                     copy_block=contents.copy if copy else None)
    return pool, contents


def serve_contents(pool, contents, seq_id, prompt, new_tokens, states=None):
    """serve() on recorded storage: what reserve found is the prompt's own tokens; returns it. With
    `states` (copies up to a state), the sequence's state is kept where its prompt ends and at
    release, as a hybrid's is."""
    assert pool.reserve(seq_id, len(prompt) + new_tokens, prompt)
    reused = pool.committed(seq_id)
    assert reused == pool.reused(seq_id) < len(prompt)
    assert contents.read(pool, seq_id, reused) == prompt[:reused]
    contents.write(pool, seq_id, prompt[reused:])
    if states is not None:
        states.add(pool.end_digest(seq_id))
    for t in range(new_tokens):
        contents.write(pool, seq_id, [10_000 + t])
    assert contents.read(pool, seq_id, len(prompt) + new_tokens) == prompt + [10_000 + t for t in range(new_tokens)]
    if states is not None:
        states.add(pool.end_digest(seq_id))
    pool.release(seq_id)
    return reused


def stated_copying_pool(pool_blocks=200, max_idle_cached=None):
    """A copying pool with a hybrid's limits; the set of digests with a state stands for its shared states."""
    pool, contents = copying_pool(pool_blocks, max_idle_cached)
    states = set()
    pool.copy_state = states.__contains__
    pool.match_limit = lambda digests: max((n for n in range(1, len(digests) + 1) if digests[n - 1] in states),
                                           default=0)
    return pool, contents, states


def test_a_prompt_parting_mid_block_starts_from_a_copy_of_the_shared_part():
    pool, contents = copying_pool()
    system = [7, 8, 9, 10, 11, 12]  # a full block and 2 tokens of the next
    first = system + [20, 21, 22, 23]
    assert serve_contents(pool, contents, "a", first, 3) == 0
    cached_tail = pool.prefixes.cached[pool.prefixes.match(first[:2 * B + 1])[1][0]]
    assert serve_contents(pool, contents, "b", system + [30, 31], 2) == len(system)
    assert contents.copies[-1][0] == cached_tail and contents.copies[-1][1] != cached_tail
    assert list(contents.blocks[cached_tail]) == first[B:2 * B]  # the source is only read
    # the prompt's last token is always prefilled: the same prompt again copies all but it
    assert serve_contents(pool, contents, "c", first[:2 * B], 1) == 2 * B - 1
    off, off_contents = copying_pool(copy=False)
    serve_contents(off, off_contents, "a", first, 3)
    assert off.reserve("b", 10, system + [30, 31]) and off.committed("b") == B


def test_no_copy_when_the_source_is_the_last_block_left():
    pool, contents = copying_pool(pool_blocks=2, max_idle_cached=2)
    serve_contents(pool, contents, "a", [1, 2, 3, 4, 5], 0)  # block 0 cached, block 1 freed
    assert serve_contents(pool, contents, "b", [1, 2, 9, 9, 9, 9, 9], 1) == 0  # needs both blocks
    assert not contents.copies
    # b left [1, 2, 9, 9] and [9, 9, 9, 10000] cached: a one-block prompt copies the first into the second
    assert serve_contents(pool, contents, "c", [1, 2, 9, 5], 0) == 3 and len(contents.copies) == 1
    assert pool.free_blocks == 2 and pool.num_reserved == 0


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("pool_blocks, max_idle_cached", [(12, 2), (40, None), (200, 200)])
def test_random_traffic_reads_back_its_own_tokens(pool_blocks, max_idle_cached, whole):
    """Prompts drawn from a few shared beginnings of random lengths, with evictions, and next turns of
    earlier ones: whatever reserve shares or copies holds the prompt's tokens, and the books balance
    after every request. Copies up to a state: every reuse ends where some sequence kept a state."""
    if whole:
        pool, contents, states = stated_copying_pool(pool_blocks, max_idle_cached)
    else:
        (pool, contents), states = copying_pool(pool_blocks, max_idle_cached), None
    rng = np.random.default_rng(pool_blocks)
    systems = [rng.integers(1, 50, size=3 * B).tolist() for _ in range(3)]
    reused, served = [], []
    for i in range(150):
        if served and rng.random() < 0.3:  # a next turn: an earlier request's tokens, then more
            earlier, new = served[-int(rng.integers(1, min(3, len(served)) + 1))]
            prompt = earlier + [10_000 + t for t in range(new)] + rng.integers(1, 50, size=int(rng.integers(1, B))).tolist()
        else:
            system = systems[int(rng.integers(0, 3))]
            prompt = system[:int(rng.integers(1, 3 * B))] + rng.integers(1, 50, size=int(rng.integers(1, 2 * B))).tolist()
        new = int(rng.integers(0, B))
        reused.append(serve_contents(pool, contents, i, prompt, new, states))
        served.append((prompt, new))
        assert pool.free_blocks == pool.pool_blocks and pool.num_reserved == 0
        if whole and reused[-1]:
            assert states_digest(prompt[:reused[-1]]) in states
    assert sum(r % B != 0 for r in reused) > (10 if whole else 20) and contents.copies


def states_digest(tokens) -> bytes:
    """The chain digest a sequence of these tokens ends on (its last block partial or full)."""
    digest = b""
    for start in range(0, len(tokens), B):
        digest = block_digest(digest, np.asarray(tokens[start:start + B], dtype=np.int64))
    return digest


def test_a_copy_with_no_room_for_it_cuts_back_to_a_kept_state():
    """The pool's last free block is the copy's source: the next turn neither copies nor shares blocks
    past the last state (it would start from a state that does not exist), and nothing is lost."""
    pool, contents, states = stated_copying_pool(pool_blocks=4, max_idle_cached=4)
    first = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    serve_contents(pool, contents, "t1", first, 1, states)  # 10 tokens: two full blocks and a partial one
    # 13 tokens + 3 new need all 4 blocks, and the partial block would have to stay as the source
    assert serve_contents(pool, contents, "t2", first + [10_000, 1, 2, 3], 3, states) == 0
    assert not contents.copies and pool.free_blocks == pool.pool_blocks


def test_copies_reuse_only_up_to_a_kept_state_and_a_next_turn_reuses_it_all():
    pool, contents, states = stated_copying_pool()
    first = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # two full blocks and one token
    assert serve_contents(pool, contents, "t1", first, 3, states) == 0  # 12 tokens: three full blocks
    assert states == {states_digest(first), states_digest(first + [10_000, 10_001, 10_002])}
    # parting mid-block or before the prompt's end: no state there, nothing reused (a dense pool copies 8)
    assert serve_contents(pool, contents, "p", first[:8] + [1, 2], 1) == 0
    # a next turn shares all three blocks, not cut back to a state
    t2 = first + [10_000, 10_001, 10_002] + [40, 41, 42]
    assert serve_contents(pool, contents, "t2", t2, 2, states) == 12
    # t2 ended partly into a block: its next turn copies that block and starts where t2 ended
    t3 = t2 + [10_000, 10_001] + [50]
    assert pool.reserve("t3", len(t3) + 1, t3)
    assert pool.committed("t3") == len(t2) + 2 and pool.copied_key("t3") == states_digest(t2 + [10_000, 10_001])
    assert contents.read(pool, "t3", len(t2) + 2) == t3[:-1]
    pool.release("t3")
    # a next turn whose template dropped t2's reply: it parts where t2's prompt ended, inside a block
    t4 = t2 + [60, 61]
    assert pool.reserve("t4", len(t4) + 1, t4)
    assert pool.committed("t4") == len(t2) and pool.copied_key("t4") == states_digest(t2)
    assert contents.read(pool, "t4", len(t2)) == t2
    pool.release("t4")
    assert pool.free_blocks == pool.pool_blocks


def test_the_next_turn_copies_the_last_turns_partly_filled_block():
    pool, contents = copying_pool()
    first = [5, 6, 7, 8, 9, 10]
    serve_contents(pool, contents, "t1", first, 3)  # 9 tokens committed: two full blocks and one token
    reply = [10_000, 10_001, 10_002]
    assert serve_contents(pool, contents, "t2", first + reply + [40, 41], 2) == len(first) + len(reply)
    assert len(pool.prefixes.cached) == len(pool.prefixes.evictable) == 5  # t1's and t2's, 2 of them partial
    off, off_contents = copying_pool(copy=False)
    serve_contents(off, off_contents, "t1", first, 3)
    assert serve_contents(off, off_contents, "t2", first + reply + [40, 41], 2) == 2 * B
