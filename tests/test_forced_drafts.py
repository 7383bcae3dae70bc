"""The switch for grammar-forced drafts: `structured={..., "forced_drafts": False}`.

Checked on the tiny pair (strict f32, JSON schemas of `ovdflash.bench.schemas`): with forced drafts off
the output is the same tokens as with them on and as AR, while the random drafter's own drafts are then
almost all refused, so the round needs more target calls per token and accepts less; a forced_drafts
that is not a boolean is a one-line error naming it.
"""
import pytest

from ovdflash.bench.schemas import SCHEMA_TASKS

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def pipe(tiny_pair, tmp_path_factory):
    from ovdflash import STRICT_F32, DFlashPipeline

    return DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("forced_cache"), **STRICT_F32)


def test_forced_drafts_off_gives_the_same_tokens_with_more_target_calls(pipe):
    from ovdflash.decode.stats import GenerationStats

    stats = {True: GenerationStats(), False: GenerationStats()}
    for prompt, schema in SCHEMA_TASKS[:6]:
        ids = pipe.encode_prompt([{"role": "user", "content": prompt}])
        ar = pipe.generate(ids, max_new_tokens=64, draft=False, structured={"json": schema}).token_ids
        for forced in (True, False):
            got = pipe.generate(ids, max_new_tokens=64, block_size=4, prompt_lookup=False, stats=stats[forced],
                                structured={"json": schema, "forced_drafts": forced})
            assert got.token_ids == ar, (prompt, forced)
    calls = {f: (s.num_drafts + s.num_ar_steps) / s.num_output_tokens for f, s in stats.items()}
    assert calls[True] < 0.6 < calls[False], calls
    assert stats[True].acceptance_rate > 0.5 > stats[False].acceptance_rate, \
        (stats[True].acceptance_rate, stats[False].acceptance_rate)


def test_a_forced_drafts_that_is_not_a_boolean_is_a_one_line_error():
    from ovdflash.decode.structured import structured_spec

    with pytest.raises(ValueError) as err:
        structured_spec({"regex": "a", "forced_drafts": "no"})
    assert "forced_drafts" in str(err.value) and "\n" not in str(err.value)
    assert structured_spec({"regex": "a", "forced_drafts": False}).forced_drafts is False
    assert structured_spec({"regex": "a"}).forced_drafts is True
