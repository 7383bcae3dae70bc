"""The speculative loop against mock runners whose logits we control."""
import numpy as np
import pytest
from mock_models import MockDrafter, MockTarget

from ovdflash.decode.sampling import SamplingParams
from ovdflash.decode.sequence import PromptTooLongError, generate
from ovdflash.decode.stats import GenerationStats

GREEDY = SamplingParams()


def run(target, drafter, prompt, max_new, params=GREEDY, eos=(), block_size=None, stats=None):
    return list(generate(target, drafter, prompt, max_new, params, eos, block_size, stats))


def tokens(events):
    return [e.token for e in events]


@pytest.mark.parametrize("block_size", [2, 3, 4, 8])
@pytest.mark.parametrize("error_rate", [0.0, 0.3, 0.9])
def test_greedy_speculative_equals_autoregressive(block_size, error_rate):
    target = MockTarget(vocab_size=32, seed=block_size)
    drafter = MockDrafter(target, block_size=block_size, error_rate=error_rate, seed=7)
    rng = np.random.default_rng(0)
    for _ in range(10):
        prompt = rng.integers(0, 32, size=int(rng.integers(1, 20))).tolist()
        ar = tokens(run(target, None, prompt, 60))
        stats = GenerationStats()
        spec = tokens(run(target, drafter, prompt, 60, stats=stats))
        assert spec == ar
        assert stats.num_drafts > 0
    assert target.num_compactions > 0 or error_rate == 0.0


def test_from_draft_pattern_with_perfect_drafter():
    target = MockTarget(seed=3)
    drafter = MockDrafter(target, block_size=4, error_rate=0.0)
    events = run(target, drafter, [1, 2, 3], 13)
    # prefill token, then rounds of 3 accepted drafts + 1 target token
    assert [e.from_draft for e in events] == [False] + [True, True, True, False] * 3
    assert [e.finish_reason for e in events] == [None] * 12 + ["length"]


def test_every_round_ends_with_a_target_token():
    target = MockTarget(seed=4)
    drafter = MockDrafter(target, block_size=5, error_rate=0.5)
    stats = GenerationStats()
    events = run(target, drafter, [5, 6], 80, stats=stats)
    assert not events[-1].from_draft or events[-1].finish_reason
    assert sum(not e.from_draft for e in events[1:]) == stats.num_drafts + stats.num_ar_steps
    assert sum(e.from_draft for e in events) == stats.num_accepted_tokens


@pytest.mark.parametrize("max_new", [1, 2, 3, 5, 6, 7, 11, 30])
def test_max_new_tokens_exact_even_mid_block(max_new):
    target = MockTarget(seed=5)
    drafter = MockDrafter(target, block_size=4, error_rate=0.0)
    events = run(target, drafter, [1, 2], max_new)
    assert len(events) == max_new
    assert events[-1].finish_reason == "length"
    assert tokens(events) == tokens(run(target, None, [1, 2], max_new))


def test_no_round_verifies_past_max_new_tokens():
    # with 2 tokens left and a perfect drafter, the last block shrinks to 2: no wasted verify rows
    target = MockTarget(seed=5)
    drafter = MockDrafter(target, block_size=8, error_rate=0.0)
    stats = GenerationStats()
    run(target, drafter, [1, 2], 1 + 8 + 2, stats=stats)
    assert stats.num_draft_tokens == 7 + 1
    assert stats.num_ar_steps == 0


def test_eos_in_the_middle_of_an_accepted_block():
    target = MockTarget(seed=6)
    drafter = MockDrafter(target, block_size=8, error_rate=0.0)
    ar = tokens(run(target, None, [9], 40))
    eos = ar[5]  # a token that the perfect drafter proposes inside the first block
    first = ar.index(eos)
    events = run(target, drafter, [9], 40, eos=[eos])
    assert tokens(events) == ar[: first + 1]
    assert events[-1].finish_reason == "stop"
    assert events[-1].from_draft == (first != 0)


def test_consumer_stopping_early_runs_no_further_round():
    target = MockTarget(seed=8)
    drafter = MockDrafter(target, block_size=4, error_rate=0.0)
    gen = generate(target, drafter, [1, 2, 3], 100, GREEDY)
    for _ in range(3):  # prefill token + 2 drafts of round 1
        next(gen)
    calls = target.num_forward_calls
    gen.close()
    assert target.num_forward_calls == calls == 2  # prefill + one verify


def test_prompt_too_long_is_a_clear_error():
    target = MockTarget(max_length=16)
    with pytest.raises(PromptTooLongError, match="context limit is 16"):
        run(target, None, list(range(16)), 4)


def test_generation_stops_at_context_limit():
    target = MockTarget(max_length=20, seed=2)
    drafter = MockDrafter(target, block_size=4, error_rate=0.2)
    events = run(target, drafter, list(range(10)), 100)
    assert len(events) == 10 and events[-1].finish_reason == "context"
    assert target.committed == 19  # the last token is the 20th and never needs KV
    assert tokens(events) == tokens(run(target, None, list(range(10)), 100))


def test_mask_token_id_in_output_is_kept():
    mask_token_id = 7
    target = MockTarget(logits_fn=lambda seq: np.eye(32)[mask_token_id if len(seq) % 3 == 0 else 3] * 5)
    drafter = MockDrafter(target, block_size=4, error_rate=0.0)
    out = tokens(run(target, drafter, [1, 2], 12, eos=[31]))
    assert out.count(mask_token_id) == 4 and len(out) == 12


def test_stats_are_consistent():
    target = MockTarget(seed=9)
    drafter = MockDrafter(target, block_size=4, error_rate=0.4)
    stats = GenerationStats()
    events = run(target, drafter, [1, 2, 3], 50, stats=stats)
    assert stats.num_output_tokens == len(events) == 50
    assert sum(stats.acceptance_length_histogram.values()) == stats.num_drafts
    assert sum(n * c for n, c in stats.acceptance_length_histogram.items()) == \
        stats.num_accepted_tokens + stats.num_drafts
    assert stats.accepted_per_position[0] >= stats.accepted_per_position[1] >= stats.accepted_per_position[2]
    assert 0 < stats.acceptance_rate < 1
    assert stats.mean_acceptance_length == pytest.approx(1 + stats.num_accepted_tokens / stats.num_drafts)
    assert stats.ttft_s > 0 and stats.total_s >= stats.ttft_s
    total = GenerationStats()
    total.merge(stats)
    total.merge(stats)
    assert total.num_drafts == 2 * stats.num_drafts and total.num_calls == 2
    assert total.per_position_acceptance_rate == pytest.approx(stats.per_position_acceptance_rate)


def test_sampling_is_reproducible_with_a_seed():
    target = MockTarget(seed=10, sharpness=1.0)
    drafter = MockDrafter(target, block_size=4, error_rate=0.2)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=123)
    a = tokens(run(target, drafter, [1], 40, params))
    b = tokens(run(target, drafter, [1], 40, params))
    c = tokens(run(target, drafter, [1], 40, SamplingParams(temperature=0.8, top_p=0.9, seed=124)))
    assert a == b and a != c


# -- the pipeline's text layer on the mock runners ------------------------------------------------
from mock_models import byte_tokenizer  # noqa: E402

from ovdflash.pipeline import DFlashPipeline  # noqa: E402
from ovdflash.tokenizer import IncrementalDetokenizer  # noqa: E402

EOS_ID = 256
LETTERS = np.r_[97:123, 32]


def text_pipeline(error_rate=0.3, block_size=4, seed=12):
    target = MockTarget(vocab_size=257, seed=seed)
    allowed = np.full(257, -1e9)
    allowed[LETTERS] = 0.0
    base = target.logits_fn
    target.logits_fn = lambda seq: base(seq) + allowed  # lowercase letters and spaces only
    drafter = MockDrafter(target, block_size=block_size, error_rate=error_rate)
    return DFlashPipeline(target, drafter, byte_tokenizer(), [EOS_ID], block_size)


def test_stop_string_ends_generation_mid_block():
    pipe = text_pipeline(error_rate=0.0, block_size=6)
    full = pipe.generate("hello", max_new_tokens=40, draft=False)
    stop = full.text[13:16]  # ends at token 16: inside the third 6-token block
    first = full.text.find(stop)
    for draft in (False, True):
        out = pipe.generate("hello", max_new_tokens=40, stop=[stop, "zzzzz"], draft=draft)
        assert out.text == full.text[:first]
        assert out.finish_reason == "stop"
        assert out.token_ids == full.token_ids[: first + len(stop)]  # up to the completing token
    streamed = "".join(pipe.stream("hello", max_new_tokens=40, stop=stop))
    assert streamed == full.text[:first]


def test_stream_yields_once_per_block_and_joins_to_generate():
    pipe = text_pipeline(error_rate=0.3)
    out = pipe.generate("abc", max_new_tokens=50)
    chunks = list(pipe.stream("abc", max_new_tokens=50))
    assert "".join(chunks) == out.text and len(out.token_ids) == 50
    stats = pipe.last_stats
    assert len(chunks) <= 1 + stats.num_drafts + stats.num_ar_steps
    assert len(chunks) > 50 / stats.mean_acceptance_length - 2  # not per token: per block
    assert pipe.stats.num_calls == 2 and pipe.stats.num_output_tokens == 100


def test_streaming_holds_back_a_possible_stop_prefix():
    pipe = text_pipeline(error_rate=0.0)
    full = pipe.generate("x", max_new_tokens=30, draft=False).text
    stop = full[10:14] + "\x01"  # never completes, but its prefix appears in the text
    seen = ""
    for chunk in pipe.stream("x", max_new_tokens=30, stop=stop):
        seen += chunk
        if len(seen) < len(full):  # mid-stream: never ends inside a possible stop string
            assert not any(seen.endswith(stop[:n]) for n in range(1, len(stop)))
    assert seen == full


def test_stop_helpers():
    from ovdflash.text import _find_stop, held_back
    assert held_back("abc</s", ["</stop>", "xyz"]) == 3
    assert held_back("abc", ["</stop>"]) == 0
    assert _find_stop("ab</stop>cd", 5, ["</stop>", "cd"]) == 2
    assert _find_stop("ab</stop>cd", 9, ["</stop>"]) is None  # ended before the new text


def test_eos_token_is_kept_in_ids_but_not_in_text():
    pipe = text_pipeline()
    ar = pipe.generate("ab", max_new_tokens=30).token_ids
    pipe.eos_token_ids = [ar[7]]
    out = pipe.generate("ab", max_new_tokens=30)
    assert out.token_ids == ar[: ar.index(ar[7]) + 1] and out.finish_reason == "stop"
    assert out.text == pipe.tokenizer.decode(ar[: ar.index(ar[7])])


def test_messages_go_through_the_chat_template():
    pipe = text_pipeline()
    ids = pipe.encode_prompt([{"role": "user", "content": "hi"}])
    assert pipe.tokenizer.decode(ids) == "<user>hi\n<assistant>"


def test_incremental_detokenizer_is_utf8_safe():
    tok = byte_tokenizer()
    text = "naïve café — 你好 😀 done"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text
    assert sum(1 for d in deltas if d) < len(ids)  # multi-byte characters were held back


def test_draft_requested_without_a_drafter_is_an_error():
    pipe = text_pipeline()
    ar = pipe.generate("ab", max_new_tokens=5, draft=False).token_ids
    pipe.drafter = None
    assert pipe.generate("ab", max_new_tokens=5).token_ids == ar  # draft=None: AR when none is loaded
    with pytest.raises(ValueError, match="without a drafter"):
        pipe.generate("ab", max_new_tokens=5, draft=True)


def test_plain_prompts_get_the_manifest_bos_once():
    pipe = text_pipeline()
    assert pipe.encode_prompt("ab") == [97, 98]
    pipe.bos_token_id = EOS_ID
    assert pipe.encode_prompt("ab") == [EOS_ID, 97, 98]
    assert pipe.encode_prompt([{"role": "user", "content": "a"}])[0] != EOS_ID  # the template decides


def test_apply_chat_template_renders_a_string_as_one_user_message():
    pipe = text_pipeline()
    as_message = pipe.encode_prompt([{"role": "user", "content": "ab"}])
    assert pipe.encode_prompt("ab", apply_chat_template=True) == as_message
    assert pipe.encode_prompt("ab") == [97, 98]  # the default stays a raw completion
    assert pipe.encode_prompt([5, 6], apply_chat_template=True) == [5, 6]  # ids pass through
    templated = pipe.generate("ab", max_new_tokens=12, apply_chat_template=True)
    assert templated.token_ids == pipe.generate(as_message, max_new_tokens=12).token_ids
    assert "".join(pipe.stream("ab", max_new_tokens=12, apply_chat_template=True)) == templated.text
    assert templated.token_ids != pipe.generate("ab", max_new_tokens=12).token_ids
