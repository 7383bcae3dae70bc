"""Chunked prefill in the batched engine on tiny exported pairs under STRICT_F32: with a token budget so
small that every prompt prefills over many rounds, each sequence's tokens equal its run alone (greedy
DFlash, AR, seeded sampling, lookup, load-aware drafts, a grammar), prefix-cache hits share their blocks
and chunk the rest, and a hybrid target carries its linear-attention state from chunk to chunk."""
import numpy as np
import pytest

from ovdflash import STRICT_F32, DFlashPipeline
from ovdflash.decode.sampling import SamplingParams
from ovdflash.decode.scheduler import Scheduler
from ovdflash.ov.paged_batch import DrafterPool, batch_target_for


def load(pair, cache_dir, prefix_cache=False):
    pipe = DFlashPipeline.from_pretrained(pair, cache_dir=cache_dir, INFERENCE_NUM_THREADS=1,
                                          prefix_cache=prefix_cache, **STRICT_F32)
    pipe.default_block_size = pipe.block_size
    return pipe


@pytest.fixture(scope="module")
def pipe(tiny_pair, tmp_path_factory):
    return load(tiny_pair, tmp_path_factory.mktemp("cache"))


def prompts_of(seed, lengths, vocab=500):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=int(n)).tolist() for n in lengths]


def counted_steps(pipe):
    """The batch target's calls and their sizes, recorded around its forward."""
    target, calls = pipe.batch_target(), []
    forward = target.forward
    target.forward = lambda batch: calls.append([len(ids) for _, ids, _ in batch]) or forward(batch)
    return target, calls


@pytest.mark.parametrize("kwargs", [{"block_size": 4}, {"block_size": 1}, {"block_size": 4, "temperature": 0.9,
                                    "top_k": 30, "seed": 11}, {"block_size": 2, "prompt_lookup": True},
                                    {"block_size": "auto"}])
def test_chunked_batch_equals_generate_alone(pipe, kwargs):
    prompts = prompts_of(3, (3, 47, 9, 31, 60, 5))
    pipe.batch_draft_policy(3)  # "auto" measures its cost curve before the counted calls
    target, calls = counted_steps(pipe)
    try:
        batch = pipe.generate_batch(prompts, max_new_tokens=10, max_batch_size=3, max_num_batched_tokens=7, **kwargs)
    finally:
        del target.forward
    alone_kwargs = {**kwargs, "block_size": 1} if kwargs["block_size"] == "auto" else kwargs
    for prompt, got in zip(prompts, batch):
        want = list(pipe.generate_tokens(prompt, 10, **alone_kwargs))
        assert got.token_ids == [e.token for e in want], kwargs
        assert got.finish_reason == want[-1].finish_reason
    # a 60-token prompt in chunks of at most 7, beside verifies of at most a block each
    assert len(calls) > 60 // 7
    assert all(sum(sizes) <= 7 + 3 * pipe.block_size for sizes in calls)


def test_a_bad_token_budget_is_a_one_line_error(pipe):
    with pytest.raises(ValueError, match="max_num_batched_tokens must be an integer >= 1 .*, got 0"):
        pipe.generate_batch([[1, 2, 3]], 4, max_num_batched_tokens=0)


def test_chunks_after_a_prefix_cache_hit_equal_full_prefills(tiny_pair, tmp_path):
    """A shared system prompt's cached blocks are shared at reserve and only the rest is chunked; the
    drafter's context (cached features, then every chunk's) gives the same drafts as a full prefill."""
    cached_pipe = load(tiny_pair, tmp_path, prefix_cache=True)
    target = batch_target_for(cached_pipe.target, pool_blocks=96)
    scheduler = Scheduler(target, DrafterPool(cached_pipe.drafter), max_batch_size=3, max_num_batched_tokens=5)
    b = target.block_tokens
    system = prompts_of(1, [3 * b + 2])[0]
    tails = prompts_of(2, (1, 20, 7, 13))
    requests = [(i, system + tail, 10, SamplingParams(), 4, False, ()) for i, tail in enumerate(tails)]
    scheduler.add(*requests[0])
    events, stats = {}, {}
    while scheduler.has_work():
        if 0 in events and not stats:  # the first one's prefill is done: the others find its blocks
            for r in requests[1:]:
                stats[r[0]] = scheduler.add(*r)
        for rid, evs in scheduler.step():
            events.setdefault(rid, []).extend(e.token for e in evs)
    for rid, prompt, *_ in requests:
        want = [e.token for e in cached_pipe.generate_tokens(prompt, 10, block_size=4, prefix_cache=False,
                                                             prompt_lookup=False, eos_token_ids=[])]
        assert events[rid] == want, rid
        if rid:
            alone_stats = cached_pipe.last_stats
            # the last one waits for a slot: by then a request that ended left its partly filled
            # block, which begins with the system prompt's last 2 tokens, for a copy
            assert stats[rid].num_cached_prompt_tokens == 3 * b + (2 if rid == 3 else 0)
            assert (stats[rid].num_draft_tokens, stats[rid].num_accepted_tokens) == \
                (alone_stats.num_draft_tokens, alone_stats.num_accepted_tokens)
    assert target.num_prefix_hits == 3 * 3 * b + 2 and target.num_reserved == 0


def test_a_grammar_starts_at_the_first_sampled_token_of_a_chunked_prefill(pipe):
    pytest.importorskip("llguidance")
    structured = {"regex": r"[ab]{2,4}-[0-9]{3}"}
    prompts = prompts_of(4, (40, 3, 25))
    for sampling in ({}, {"temperature": 0.9, "seed": 5}):
        batch = pipe.generate_batch(prompts, 12, block_size=4, structured=structured, max_num_batched_tokens=6,
                                    **sampling)
        alone = [pipe.generate(p, 12, block_size=4, structured=structured, **sampling) for p in prompts]
        assert [r.token_ids for r in batch] == [r.token_ids for r in alone], sampling


def test_a_hybrid_target_carries_its_linear_state_across_chunks(export_tiny_pair, tmp_path):
    pair = export_tiny_pair(arch="qwen3_5_text", target_layer_ids=(1, 3))
    hybrid = load(pair, tmp_path)
    assert hybrid.batch_target().linear is not None
    prompts = prompts_of(6, (37, 4, 21), vocab=400)
    for budget in (5, 20):  # chunks within and beyond the per-token checkpoints (16 tokens)
        batch = hybrid.generate_batch(prompts, max_new_tokens=8, max_batch_size=3, block_size=4,
                                      max_num_batched_tokens=budget)
        for prompt, got in zip(prompts, batch):
            assert got.token_ids == [e.token for e in hybrid.generate_tokens(prompt, 8, block_size=4)], budget


def test_the_server_passes_its_token_budget_to_the_batch_scheduler(pipe):
    pytest.importorskip("fastapi")
    from ovdflash.server.wiring import build_server_app

    app = build_server_app(pipe, ["tiny"], max_num_seqs=2, max_num_batched_tokens=7)
    assert app.state.engine.scheduler.batch.scheduler.max_num_batched_tokens == 7
    with pytest.raises(ValueError, match="max_num_batched_tokens must be an integer >= 1"):
        build_server_app(pipe, ["tiny"], max_num_seqs=2, max_num_batched_tokens=-1)
