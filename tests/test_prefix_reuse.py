"""Prefix reuse across calls (ovdflash.decode.prefix_cache) on the tiny pair under STRICT_F32: a call that
keeps the previous call's KV and drafter context for its prompt's common prefix gives the same
tokens as a pipeline that prefills every prompt whole (greedy and seeded sampling), on the paged
and the stateful runner, and prefills only the new tokens (from its stats). Covered: chat turns
(token ids and messages), a turn cut by a stop string or a stream broken off mid-block, a prompt
that parts from the cached tokens early (the drafter's state is cut, the stateful cache compacts),
an autoregressive call between drafted ones, a call broken by an error, and the hybrid target
(reuse only when the prompt extends the cached tokens, else a full prefill)."""
import numpy as np
import pytest

from ovdflash import STRICT_F32, DFlashPipeline
from ovdflash.decode.prefix_cache import PrefixCache, common_prefix_length

MAX_NEW = 24


def load(pair, cache_dir, runner=None, prefix_cache=True):
    pipe = DFlashPipeline.from_pretrained(pair, cache_dir=cache_dir, INFERENCE_NUM_THREADS=1, target_runner=runner,
                                          prefix_cache=prefix_cache, **STRICT_F32)
    if runner == "stateful":
        pipe.target.compact_min_garbage = 24  # compactions in short runs, rewinds included
    pipe.default_block_size = pipe.block_size  # every round drafts
    return pipe


@pytest.fixture(scope="module", params=["paged", "stateful"])
def pipes(request, tiny_pair, tmp_path_factory):
    """(reusing pipeline, reference pipeline that prefills every prompt whole)."""
    cache_dir = tmp_path_factory.mktemp("ov_cache")
    return load(tiny_pair, cache_dir, request.param), load(tiny_pair, cache_dir, request.param, prefix_cache=False)


def run(pipe, prompt, max_new=MAX_NEW, **kwargs):
    out = [e.token for e in pipe.generate_tokens(prompt, max_new, eos_token_ids=[], **kwargs)]
    return out, pipe.last_stats


def same_drafts(stats, ref_stats):
    """The kept drafter context is the one a full prefill builds: the same drafts, accepted alike."""
    assert (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_lookup_drafts) == (
        ref_stats.num_draft_tokens, ref_stats.num_accepted_tokens, ref_stats.num_lookup_drafts)


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([7], [8]) == 0


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_k": 20, "seed": 11}], ids=["greedy", "seeded"])
def test_chat_turns_with_reuse_equal_full_prefills_and_prefill_only_the_new_tokens(pipes, sampling):
    pipe, ref = pipes
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 400, 30).tolist()
    pipe.prefix_store.invalidate()
    for turn in range(4):
        out, stats = run(pipe, prompt, **sampling)
        expected, ref_stats = run(ref, prompt, **sampling)
        assert out == expected, f"turn {turn}"
        same_drafts(stats, ref_stats)
        assert ref_stats.num_cached_prompt_tokens == 0
        if turn == 0:
            assert stats.num_cached_prompt_tokens == 0
        else:  # the KV holds the last prompt and every output token but the last sampled one
            assert stats.num_cached_prompt_tokens == cached, f"turn {turn}"
            assert stats.num_prompt_tokens - stats.num_cached_prompt_tokens == len(user) + 1
        user = rng.integers(0, 400, int(rng.integers(3, 12))).tolist()
        cached = len(prompt) + len(out) - 1
        prompt = prompt + out + user
    assert pipe.stats.num_cached_prompt_tokens > 0 and ref.stats.num_cached_prompt_tokens == 0


def test_text_chat_with_a_stop_string_cut_equals_full_prefills(pipes):
    """A reply cut by a stop string: its text is cut but the round's tokens are in the KV; the next
    turn's messages re-encode the cut text, and the reuse stops where the ids part."""
    pipe, ref = pipes
    pipe.prefix_store.invalidate()
    first = [{"role": "user", "content": "hello there, how are you"}]
    whole = ref.generate(first, max_new_tokens=MAX_NEW)
    stop = whole.text[len(whole.text) // 2:][:2]
    assert stop.strip(), whole.text  # a stop string inside the reply
    messages = list(first)
    for turn, user in enumerate(["tell me more", "and then?", "thanks"]):
        got = pipe.generate(messages, max_new_tokens=MAX_NEW, stop=stop)
        want = ref.generate(messages, max_new_tokens=MAX_NEW, stop=stop)
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        prompt_ids = pipe.encode_prompt(messages)
        assert got.stats.num_cached_prompt_tokens <= len(prompt_ids) - 1
        if turn > 0:  # at least the earlier turns' prompt is reused
            assert got.stats.num_cached_prompt_tokens >= len(pipe.encode_prompt(messages[:-2]))
        messages += [{"role": "assistant", "content": got.text}, {"role": "user", "content": user}]


def test_a_stream_broken_off_mid_block_then_reused(pipes):
    pipe, ref = pipes
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 400, 20).tolist()
    pipe.prefix_store.invalidate()
    run(pipe, [1, 2, 3])
    num_broken = 0
    for trial in range(6):
        kept, broken = [], False
        events = pipe.generate_tokens(prompt, MAX_NEW, eos_token_ids=[])
        for event in events:  # stop at an accepted draft: the rest of its block is in the KV, unseen
            kept.append(event.token)
            if event.from_draft and len(kept) > 2:
                broken = True
                break
        events.close()
        num_broken += broken
        follow = prompt + kept + rng.integers(0, 400, 5).tolist()
        out, stats = run(pipe, follow)
        assert out == run(ref, follow)[0]
        # a draft has its KV; a round's last token has not
        assert len(prompt) + len(kept) - (not broken) <= stats.num_cached_prompt_tokens <= len(follow) - 1
        prompt = follow + out
    assert num_broken >= 2


def test_prompts_that_part_from_the_cached_tokens(pipes):
    """Divergence inside the cached prompt (the drafter's state cut back, the stateful cache
    compacting), a repeated prompt (all but its last token reused), a shorter prefix of it."""
    pipe, ref = pipes
    rng = np.random.default_rng(2)
    base = rng.integers(0, 400, 90).tolist()
    pipe.prefix_store.invalidate()
    run(pipe, base)
    context_before = pipe.drafter.context_len
    for cut in (60, 10, 30, 1):
        prompt = base[:cut] + [(base[cut] + 1) % 400] + rng.integers(0, 400, 6).tolist()
        out, stats = run(pipe, prompt)
        expected, ref_stats = run(ref, prompt)
        assert out == expected, cut
        same_drafts(stats, ref_stats)
        assert stats.num_cached_prompt_tokens == cut
        base = prompt + out
    assert context_before > 60  # the first cut was inside the drafter's consumed context
    again, stats = run(pipe, base)
    assert again == run(ref, base)[0] and stats.num_cached_prompt_tokens == len(base) - 1
    half = base[: len(base) // 2]
    shorter, stats = run(pipe, half)
    assert shorter == run(ref, half)[0] and stats.num_cached_prompt_tokens == len(half) - 1


def test_drafter_rewind_keeps_exactly_the_state_of_the_kept_positions(pipes):
    pipe, _ = pipes
    drafter = pipe.drafter
    pipe.prefix_store.invalidate()  # the drafter is driven by hand here
    width = drafter.compiled.input("hidden_states").get_partial_shape()[2].get_length()
    feats = np.random.default_rng(6).standard_normal((30, width)).astype(np.float32)

    def states():
        return {s.name: np.array(s.state.data) for s in drafter.request.query_state()}

    drafter.reset()
    drafter.propose(1, feats[:12], 12, 3)
    drafter.propose(2, feats[12:30], 30, 3)
    drafter.rewind(17)
    cut = states()
    drafts_after_cut = drafter.propose(5, feats[17:25], 25, 3)
    drafter.reset()
    drafter.propose(1, feats[:17], 17, 3)
    fresh = states()
    assert cut.keys() == fresh.keys() and cut
    for name in cut:
        assert cut[name].shape == fresh[name].shape
        np.testing.assert_allclose(cut[name], fresh[name], atol=1e-5, err_msg=name)
    drafter.reset()
    np.testing.assert_array_equal(drafter.propose(5, feats[:25], 25, 3), drafts_after_cut)
    drafter.reset()


def test_autoregressive_calls_between_drafted_ones(pipes):
    """An AR call leaves the drafter's context behind the target's: a later drafted call reuses only
    what the drafter covers, and equals the reference either way."""
    pipe, ref = pipes
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 400, 25).tolist()
    pipe.prefix_store.invalidate()
    for draft in (True, False, False, True, True):
        out, stats = run(pipe, prompt, draft=draft)
        assert out == run(ref, prompt, draft=draft)[0]
        prompt = prompt + out + rng.integers(0, 400, 4).tolist()
    assert pipe.stats.num_cached_prompt_tokens > 0


def test_a_call_broken_inside_a_round_starts_the_next_afresh(pipes, monkeypatch):
    pipe, ref = pipes
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, 400, 20).tolist()
    pipe.prefix_store.invalidate()
    out, _ = run(pipe, prompt)
    calls = []
    real_forward = pipe.target.forward

    def failing_forward(ids, all_logits):
        calls.append(len(ids))
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return real_forward(ids, all_logits)

    monkeypatch.setattr(pipe.target, "forward", failing_forward)
    follow = prompt + out + [5, 6]
    with pytest.raises(RuntimeError, match="injected"):
        run(pipe, follow)
    monkeypatch.undo()
    again, stats = run(pipe, follow)
    assert stats.num_cached_prompt_tokens == 0 and again == run(ref, follow)[0]
    prefill_only = run(pipe, follow + again + [7])[1]
    assert prefill_only.num_cached_prompt_tokens == len(follow) + len(again) - 1


def test_a_cache_of_other_runners_is_refused(pipes):
    from ovdflash.decode import sequence
    from ovdflash.decode.sampling import SamplingParams

    pipe, ref = pipes
    events = sequence.generate(pipe.target, pipe.drafter, [1, 2], 4, SamplingParams(), (), 4,
                             prefix_cache=PrefixCache(ref.target, ref.drafter))
    with pytest.raises(ValueError, match="other runners"):
        next(events)


@pytest.mark.parametrize("runner", ["paged", "hybrid"])
def test_hybrid_target_reuses_only_an_extension(export_tiny_pair, tmp_path, runner):
    pair = export_tiny_pair(arch="qwen3_5_text", target_layer_ids=(1, 3))
    pipe, ref = load(pair, tmp_path, runner), load(pair, tmp_path, runner, prefix_cache=False)
    assert pipe.target.kind == runner and not pipe.target.rewinds_exactly
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 400, 20).tolist()
    out, _ = run(pipe, prompt)
    assert out == run(ref, prompt)[0]
    follow = prompt + out + rng.integers(0, 400, 5).tolist()  # extends every cached token: reused
    again, stats = run(pipe, follow)
    assert again == run(ref, follow)[0]
    assert stats.num_cached_prompt_tokens == len(prompt) + len(out) - 1
    parted = follow[:10] + [(follow[10] + 1) % 400] + [3, 4]  # would need a cut: a full prefill
    other, stats = run(pipe, parted)
    assert other == run(ref, parted)[0] and stats.num_cached_prompt_tokens == 0
    with pytest.raises(ValueError, match="cannot rewind"):
        pipe.target.rewind(3)
