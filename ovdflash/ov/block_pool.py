"""The books of the batched paged target's KV blocks: bookings, block tables, the free list, the prefix cache.

Contract:
- `BlockPool(pool_blocks, block_tokens, max_length, grow, initial_blocks=16, caches_prefixes=True,
  max_idle_cached=None)` keeps the books of ONE pool of `pool_blocks` blocks of `block_tokens` tokens
  that every sequence takes its blocks from; it holds no tensor. `grow(needed, limit)` makes the
  storage hold `needed` blocks at least and `limit` at most, and returns how many it holds
  (`PagedKV.fit_blocks`: by doubling); the pool asks it for `initial_blocks` first and for more only
  when every allocated block has been used, so a growth copies used blocks only. A sequence takes a
  freed block first, then a block never used (in order: blocks 0..`num_touched`-1 are the ones
  whose memory was ever written).
- `reserve(seq_id, num_tokens, prompt_ids=None)` books the blocks a sequence can ever write (at
  most `max_length` tokens); False when the pool has too few free blocks now (the scheduler keeps it
  waiting); a booking larger than the whole pool is a `PoolExhaustedError` (a ValueError).
  `release(seq_id)` returns them. `write(seq_id, num_tokens)` takes the blocks the sequence's next
  forward writes, always within its booking, so no inference ever runs out of cache, and returns its
  past length and block table. `commit(seq_id, k, token_ids=None)` keeps the first k tokens of that
  forward (the next one overwrites the rest); `slots(seq_id, start, end)`: the (block, slot) of
  positions start..end-1.
- Prefix caching (`caches_prefixes`): every full block of committed tokens (their `token_ids` given
  to `commit`) is kept under a digest of its tokens and all tokens before it (`block_digest`).
  `reserve` with prompt_ids shares the cached blocks that begin the prompt (its last token excluded,
  so at least one token is prefilled): `committed(seq_id)` then starts at their tokens and
  `matched_blocks(seq_id)` names them. Shared blocks are only read: a sequence writes from its
  committed length on, which lies past every full block. A cached block nobody holds counts as free:
  it is evicted (least recently released first, a chain's tail before its head) when a sequence needs
  a block and no freed one is left, once `max_idle_cached` such blocks wait (None: a quarter of the
  pool, `default_idle_cached`) or the pool is at its limit: the memory the pool touches stays within what running sequences
  hold plus that many cached blocks. A block is found only by its exact tokens (copied, by its exact
  leading ones and every token before it). The digests
  and which cached blocks are idle are `prefixes`' (a `PrefixCache`); `num_prefix_queries` /
  `num_prefix_hits` count the prompt tokens looked up and found. `digests(seq_id)` lists the chain
  digest of each of a sequence's hashed blocks (matched or filled), in order. `match_limit` (None:
  share every matched block) takes the matched blocks' digests and returns how many leading ones
  `reserve` may share (a hybrid target shares only up to a block with a kept linear-attention state).
- Reuse within a block (`copy_block(src, dst)` given: the caller copies one block's KV and features):
  past the shared full blocks, `reserve` also finds the cached block after them whose leading tokens
  the prompt shares longest (a prompt that parts from it mid-block, such as a common system prompt
  followed by another question) and copies it into the sequence's first own block, which then holds
  those tokens committed; the sequence overwrites the rest of it. A released sequence's last,
  partly filled block joins the cache too, for copies only (a conversation's next turn reuses every
  committed token of the last one); it is never shared, and is evicted like any idle cached block.
  `reused(seq_id)` counts the tokens shared or copied at reserve.
- Copies only up to a state (`copy_state(digest)` given: a hybrid target, whose linear-attention
  state exists only where a sequence kept one): a copy may reuse a cached block's first n tokens
  only where `copy_state` holds for the chain digest of everything up to them (`block_digest` of
  the parent's digest and those n tokens; for the whole block, its own digest), and reuses the
  most such tokens. When such a copy follows every matched block and the pool has room to book the
  sequence while holding the copy's source, `match_limit` cuts none of them. `copied_key(seq_id)`
  is that chain digest for the tokens the copy reused at reserve (None: no copy); `end_digest(seq_id)`
  is the chain digest of all its committed tokens (None when not all of them were given to `commit`),
  the one its last block is cached by at release when partly filled.
May import: numpy and the standard library only (the tensors are the caller's).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


class PoolExhaustedError(ValueError):
    pass


def default_idle_cached(pool_blocks: int) -> int:
    """Cached blocks nobody holds that a pool keeps beyond its running sequences' by default: a quarter."""
    return max(1, pool_blocks // 4)


def block_digest(previous: bytes, token_ids: np.ndarray) -> bytes:
    """The prefix cache's key of a full block: its tokens and, through `previous`, every token before it."""
    return hashlib.blake2b(previous + np.ascontiguousarray(token_ids, dtype=np.int64).tobytes(),
                           digest_size=16).digest()


@dataclass
class SequenceBlocks:
    """One sequence's view of the pool."""
    committed: int = 0       # tokens with valid KV
    pending: int = 0         # tokens of the last forward not committed yet
    budget: int = 0          # blocks it may still take from the pool (its booking, less what it took)
    blocks: list = field(default_factory=list)  # its block table: shared cached blocks first
    digests: list = field(default_factory=list)  # chain digest after each leading block whose digest is known
    tail_ids: list = field(default_factory=list)  # committed token ids after the hashed blocks
    num_matched: int = 0     # leading blocks shared from the prefix cache at reserve
    num_reused: int = 0      # committed tokens reserve found cached (shared blocks and a copied block's part)
    copied_key: bytes | None = None  # chain digest of the tokens a copy at reserve reused (None: no copy)

    @property
    def num_hashed(self) -> int:
        """Leading blocks whose digest is known (matched or registered)."""
        return len(self.digests)

    @property
    def digest(self) -> bytes:
        """Chain digest of the hashed blocks (b"" for none)."""
        return self.digests[-1] if self.digests else b""


class PrefixCache:
    """Full blocks of committed tokens under their chain digest (`block_digest`), and which of them
    nobody holds (`evictable`, oldest first: they count as free and are evicted on demand)."""

    def __init__(self, block_tokens: int):
        self.block_tokens = block_tokens
        self.cached: dict[bytes, int] = {}       # digest -> block id
        self.digest_of: dict[int, bytes] = {}    # block id -> digest, cached blocks only
        self.tokens_of: dict[bytes, np.ndarray] = {}    # digest -> the block's own tokens
        self.children: dict[bytes, dict[bytes, None]] = {}  # chain digest -> digests of the cached blocks after it
        self.parent_of: dict[bytes, bytes] = {}  # digest -> the chain digest before its block
        self.evictable: OrderedDict[bytes, None] = OrderedDict()  # cached, held by nobody; oldest first

    def match(self, prompt_ids) -> list[tuple[bytes, int]]:
        """(digest, block id) of the cached full blocks that begin prompt_ids, its last token excluded."""
        matched, digest = [], b""
        ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        for b in range((len(ids) - 1) // self.block_tokens):
            digest = block_digest(digest, ids[b * self.block_tokens:(b + 1) * self.block_tokens])
            block = self.cached.get(digest)
            if block is None:
                break
            matched.append((digest, block))
        return matched

    def longest_continuation(self, digest: bytes, ids: np.ndarray,
                             state_at: Callable[[bytes], bool] | None = None) -> tuple[bytes | None, int]:
        """(digest, n) of the cached block right after chain `digest` whose first n tokens equal
        ids[:n], n as large as any such block gives (None, 0: none shares a token). With `state_at`,
        n counts only where it holds for `block_digest(digest, those n tokens)`."""
        best_child, best = None, 0
        for child in self.children.get(digest, ()):
            tokens = self.tokens_of[child]
            same = tokens[:len(ids)] == ids[:len(tokens)]
            n = len(same) if same.all() else int(np.argmin(same))
            if state_at is not None:
                n = next((m for m in range(n, best, -1) if state_at(block_digest(digest, tokens[:m]))), 0)
            if n > best:
                best_child, best = child, n
        return best_child, best

    def add_full_blocks(self, seq: SequenceBlocks) -> None:
        """Cache every block the sequence's committed `tail_ids` fill, under the chain digest."""
        b = self.block_tokens
        while len(seq.tail_ids) >= b:
            block, parent = seq.blocks[seq.num_hashed], seq.digest
            tokens = np.asarray(seq.tail_ids[:b], dtype=np.int64)
            seq.digests.append(block_digest(parent, tokens))
            del seq.tail_ids[:b]
            self._add(parent, tokens, block)

    def add_partial_block(self, seq: SequenceBlocks) -> None:
        """Cache the block that holds the sequence's committed `tail_ids` (fewer than a block), for copies."""
        if seq.tail_ids and len(seq.blocks) > seq.num_hashed:
            self._add(seq.digest, np.asarray(seq.tail_ids, dtype=np.int64), seq.blocks[seq.num_hashed])

    def _add(self, parent: bytes, tokens: np.ndarray, block: int) -> None:
        """Keep the block under the digest of its tokens after chain `parent`, unless another block
        holds those tokens already (a partial block's digest covers fewer tokens than a full one's)."""
        digest = block_digest(parent, tokens)
        if digest not in self.cached:
            self.cached[digest] = block
            self.digest_of[block] = digest
            self.tokens_of[digest] = tokens
            self.children.setdefault(parent, {})[digest] = None
            self.parent_of[digest] = parent

    def held(self, block: int) -> None:
        """A sequence holds the block now: it is no longer evictable."""
        digest = self.digest_of.get(block)
        if digest is not None:
            self.evictable.pop(digest, None)

    def idle(self, block: int) -> bool:
        """Nobody holds the block now: a cached one becomes evictable (True), any other is free (False)."""
        digest = self.digest_of.get(block)
        if digest is not None:
            self.evictable[digest] = None
        return digest is not None

    def evict(self) -> int:
        """Forget the cached block released longest ago, and return it."""
        digest, _ = self.evictable.popitem(last=False)
        block = self.cached.pop(digest)
        del self.digest_of[block], self.tokens_of[digest]
        parent = self.parent_of.pop(digest)
        siblings = self.children[parent]
        del siblings[digest]
        if not siblings:
            del self.children[parent]
        return block


class BlockPool:
    """Bookings, block tables, free list and prefix cache of one pool of KV blocks (module contract)."""

    def __init__(self, pool_blocks: int, block_tokens: int, max_length: int, grow: Callable[[int, int], int],
                 initial_blocks: int = 16, caches_prefixes: bool = True, max_idle_cached: int | None = None,
                 copy_block: Callable[[int, int], None] | None = None,
                 copy_state: Callable[[bytes], bool] | None = None):
        if isinstance(pool_blocks, bool) or not isinstance(pool_blocks, (int, np.integer)) or pool_blocks < 1:
            raise ValueError(f"pool_blocks must be an integer >= 1, got {pool_blocks!r}")
        if max_idle_cached is not None and (isinstance(max_idle_cached, bool) or
                                            not isinstance(max_idle_cached, (int, np.integer)) or max_idle_cached < 0):
            raise ValueError(f"max_idle_cached must be an integer >= 0 or None, got {max_idle_cached!r}")
        self.pool_blocks = int(pool_blocks)
        # cached blocks nobody holds that may keep memory running sequences do not need
        self.max_idle_cached = default_idle_cached(self.pool_blocks) if max_idle_cached is None else int(max_idle_cached)
        self.block_tokens = block_tokens
        self.max_length = max_length
        self.grow = grow
        self.caches_prefixes = caches_prefixes
        self.copy_block = copy_block  # (src, dst): copies one block's contents; None: whole blocks only
        self.copy_state = copy_state  # chain digest -> may a copy end there; None: anywhere
        self.num_allocated = 0     # blocks the storage holds
        self.num_touched = 0       # blocks 0.. of it ever handed out (their memory written)
        self.free: list[int] = []  # allocated blocks holding nothing: never used ones (descending) first, freed ones after
        self.refs: dict[int, int] = {}  # block id -> sequences whose table holds it (absent: 0)
        self.num_referenced = 0    # blocks some sequence holds
        self.num_budgeted = 0      # blocks booked by sequences and not taken yet
        self.num_evicted = 0
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0     # of which found there
        self.prefixes = PrefixCache(block_tokens)
        self.match_limit: Callable[[list[bytes]], int] | None = None  # leading matched blocks reserve may share
        self.seqs: dict = {}       # seq_id -> SequenceBlocks
        self._allocate(min(initial_blocks, self.pool_blocks))

    # -- counts ----------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_tokens)

    @property
    def num_reserved(self) -> int:
        """Blocks the running sequences hold or may still take."""
        return self.num_referenced + self.num_budgeted

    @property
    def free_blocks(self) -> int:
        """Blocks a new booking may take (cached blocks nobody holds count: they are evicted on demand)."""
        return self.pool_blocks - self.num_reserved

    def pool_usage(self) -> dict[str, int]:
        """Blocks held by running sequences (`used`), cached ones nobody holds (`cached`, evicted on
        demand) and the rest (`free`), which add up to `pool_blocks`; `allocated`: in the storage,
        `touched`: of those, ever used (resident)."""
        used, cached = self.num_referenced, len(self.prefixes.evictable)
        return {"used": used, "cached": cached, "free": self.pool_blocks - used - cached,
                "allocated": self.num_allocated, "touched": self.num_touched}

    # -- bookings --------------------------------------------------------------------------------
    def reserve(self, seq_id, num_tokens: int, prompt_ids=None) -> bool:
        """Book the blocks of num_tokens tokens; with prompt_ids (and prefix caching), the cached full
        blocks that begin the prompt are shared instead, and `committed(seq_id)` starts at their tokens."""
        need = self.blocks_for(min(num_tokens, self.max_length))
        if need > self.pool_blocks:
            raise PoolExhaustedError(f"a sequence of {num_tokens} tokens needs {need} KV blocks; the pool holds "
                                     f"{self.pool_blocks} (raise pool_blocks)")
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already in the batch")
        looked_up = self.caches_prefixes and prompt_ids is not None
        matched = self.prefixes.match(prompt_ids) if looked_up else []
        prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1) if looked_up else None
        if matched and self.match_limit is not None and not self._stated_copy_fits(matched, prompt, need):
            matched = matched[:self.match_limit([digest for digest, _ in matched])]
        if need - len(matched) + self._num_idle(block for _, block in matched) > self.free_blocks:
            return False
        seq = SequenceBlocks(committed=len(matched) * self.block_tokens, budget=need - len(matched),
                             digests=[digest for digest, _ in matched], num_matched=len(matched))
        for _, block in matched:
            self._hold(block)
            seq.blocks.append(block)
        self.num_budgeted += seq.budget
        if looked_up and seq.budget:
            self._copy_continuation(seq, prompt)
        seq.num_reused = seq.committed
        if looked_up:
            self.num_prefix_queries += len(prompt_ids)
            self.num_prefix_hits += seq.committed
        self.seqs[seq_id] = seq
        return True

    def _copy_continuation(self, seq: SequenceBlocks, prompt: np.ndarray) -> None:
        """Start the sequence's first own block as a copy of the cached block after its shared ones that
        shares the most leading tokens with the prompt (its last token excluded); those tokens count as
        committed."""
        start = seq.committed
        digest, n = self._continuation(seq.digest, prompt, start)
        if not n:
            return
        source = self.prefixes.cached[digest]
        self._hold(source)  # not evicted for the block it is copied into
        if self.free_blocks < 0:  # the source was the one block left: no room to copy it
            self._drop(source)
            return
        self.copy_block(source, self._take_booked(seq))
        self._drop(source)
        seq.committed += n
        seq.tail_ids = [int(t) for t in prompt[start:start + n]]
        seq.copied_key = block_digest(seq.digest, prompt[start:start + n])

    def _stated_copy_fits(self, matched: list, prompt: np.ndarray, need: int) -> bool:
        """Whether a copy up to a state follows every matched block (a next turn) and the pool has room
        to book the sequence while the copy's source is held."""
        digest, n = self._continuation(matched[-1][0], prompt, len(matched) * self.block_tokens)
        if not n:
            return False
        blocks = [block for _, block in matched] + [self.prefixes.cached[digest]]
        return need - len(matched) + self._num_idle(blocks) <= self.free_blocks

    def _num_idle(self, blocks) -> int:
        """How many of these blocks nobody holds (cached ones counted free, which holding them takes)."""
        return sum(1 for block in blocks if self.refs.get(block, 0) == 0)

    def _continuation(self, digest: bytes, prompt: np.ndarray, start: int) -> tuple[bytes | None, int]:
        """The cached block after chain `digest` that the prompt from `start` (its last token excluded)
        may start as a copy of, and how many of its tokens (None, 0: none; always none without copies)."""
        if self.copy_block is None:
            return None, 0
        return self.prefixes.longest_continuation(digest, prompt[start:len(prompt) - 1], self.copy_state)

    def release(self, seq_id) -> None:
        seq = self.seqs.pop(seq_id)
        if self.caches_prefixes and self.copy_block is not None:
            self.prefixes.add_partial_block(seq)
        for block in reversed(seq.blocks):  # a chain's tail is evicted before its head
            self._drop(block)
        self.num_budgeted -= seq.budget

    def committed(self, seq_id) -> int:
        return self.seqs[seq_id].committed

    def digests(self, seq_id) -> list[bytes]:
        """The chain digest after each of the sequence's hashed blocks (shared at reserve or filled since)."""
        return self.seqs[seq_id].digests

    def copied_key(self, seq_id) -> bytes | None:
        """Chain digest of the committed tokens after a copy at reserve (None: no copy)."""
        return self.seqs[seq_id].copied_key

    def end_digest(self, seq_id) -> bytes | None:
        """The digest its committed tokens leave cached at release: its partly filled last block's, else
        its last full block's (None: no tokens, or not all of them given to `commit`)."""
        seq = self.seqs[seq_id]
        if not self.caches_prefixes or not seq.committed or \
                seq.num_hashed * self.block_tokens + len(seq.tail_ids) != seq.committed:
            return None
        return block_digest(seq.digest, np.asarray(seq.tail_ids, dtype=np.int64)) if seq.tail_ids else seq.digest

    def reused(self, seq_id) -> int:
        """Committed tokens the sequence found cached at reserve (shared blocks and a copied block's part)."""
        return self.seqs[seq_id].num_reused

    def matched_blocks(self, seq_id) -> list[int]:
        """The cached blocks `reserve` shared with this sequence, in order."""
        seq = self.seqs[seq_id]
        return seq.blocks[:seq.num_matched]

    # -- a sequence's forwards -------------------------------------------------------------------
    def write(self, seq_id, num_tokens: int) -> tuple[int, list[int]]:
        """Take the blocks of the sequence's next forward of num_tokens tokens; returns its past length
        and its block table up to that forward's last token."""
        seq = self.seqs[seq_id]
        assert seq.pending == 0, "commit() the previous forward of this sequence first"
        end = seq.committed + num_tokens
        if end > self.max_length:
            raise ValueError(f"sequence {seq_id!r} would pass the context limit ({end} > {self.max_length})")
        need = self.blocks_for(end)
        while len(seq.blocks) < need:
            if seq.budget == 0:
                raise PoolExhaustedError(f"a sequence wrote past its booking ({end} tokens)")
            self._take_booked(seq)
        seq.pending = num_tokens
        return seq.committed, seq.blocks[:need]

    def commit(self, seq_id, num_kept: int, token_ids=None) -> None:
        """Keep the first num_kept tokens of the last forward. With their token_ids (prefix caching),
        every block they fill joins the prefix cache."""
        seq = self.seqs[seq_id]
        assert 0 < num_kept <= seq.pending
        seq.committed += num_kept
        seq.pending = 0
        if self.caches_prefixes and token_ids is not None:
            assert len(token_ids) == num_kept
            seq.tail_ids.extend(int(t) for t in token_ids)
            self.prefixes.add_full_blocks(seq)

    def slots(self, seq_id, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(block ids, slots in them) of the sequence's positions start..end-1."""
        positions = np.arange(start, end)
        return np.asarray(self.seqs[seq_id].blocks)[positions // self.block_tokens], positions % self.block_tokens

    # -- blocks ----------------------------------------------------------------------------------
    def _allocate(self, needed: int) -> None:
        allocated = self.grow(needed, self.pool_blocks)
        self.free[:0] = range(allocated - 1, self.num_allocated - 1, -1)  # popped after the older unused ones
        self.num_allocated = allocated

    def _take_block(self) -> int:
        freed = bool(self.free) and self.free[-1] < self.num_touched
        if not freed and self.prefixes.evictable and (len(self.prefixes.evictable) >= self.max_idle_cached
                                                      or (not self.free and self.num_allocated == self.pool_blocks)):
            self.num_evicted += 1
            return self.prefixes.evict()
        if not self.free:  # bookings guarantee room: see free_blocks
            self._allocate(self.num_allocated + 1)
        block = self.free.pop()
        self.num_touched = max(self.num_touched, block + 1)
        return block

    def _take_booked(self, seq: SequenceBlocks) -> int:
        """A block from the sequence's booking, held and appended to its table."""
        block = self._take_block()
        seq.budget -= 1
        self.num_budgeted -= 1
        self._hold(block)
        seq.blocks.append(block)
        return block

    def _hold(self, block: int) -> None:
        count = self.refs.get(block, 0)
        if count == 0:
            self.num_referenced += 1
            self.prefixes.held(block)
        self.refs[block] = count + 1

    def _drop(self, block: int) -> None:
        count = self.refs.pop(block) - 1
        if count:
            self.refs[block] = count
            return
        self.num_referenced -= 1
        if not self.prefixes.idle(block):
            self.free.append(block)
