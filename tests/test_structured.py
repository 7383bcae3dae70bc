"""Structured outputs (decode.structured, ovdflash.grammar) keep DFlash lossless.

On a toy grammar (tokens strictly increasing) the round's pieces do what their contract says: drafts
are cut at the first forbidden one, row i is masked by the state after drafts[:i], the matcher holds
exactly the chosen tokens after acceptance. On the tiny random pair under STRICT_F32 (as
tests/test_lossless.py), with llguidance grammars (a JSON schema, a regex, a choice, a Lark grammar):
greedy DFlash equals greedy AR token for token at blocks 4 and 8 with an oracle drafter that gets partial accepts,
and with the real drafter; seeded sampling and its logprobs too; the batch scheduler gives the same
tokens; the constrained text parses and validates while the unconstrained text does not; sampled
DFlash strings follow the constrained AR distribution (chi-square); a bad spec is a one-line error; tokens
the grammar forces are drafted, and accepted.
"""
import json
import re

import numpy as np
import pytest

from ovdflash import DFlashPipeline
from ovdflash.decode.stats import GenerationStats
from ovdflash.decode.structured import GrammarState, StructuredSpec, structured_spec

from test_logits_processing import pipe, run  # noqa: F401  (the strict tiny pipeline fixture, and its runs)
from test_lossless import OracleDrafter, random_prompts  # tests/ is on sys.path under pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

# no free whitespace and bounded values: a random model's output can finish within the token budget
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "size": {"enum": ["S", "M", "L"]}, "ok": {"type": "boolean"}},
          "required": ["name", "size", "ok"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}
REGEX = r"[ab]{2,4}-[0-9]{3}"
CHOICES = ["alpha", "beta", "gamma delta", "zeta"]
# a Lark grammar (llguidance's syntax): rules, alternatives, an optional part and a lexeme
LARK = 'start: item "," item "," item ("," item)?\nitem: "red" | "green" | "blue" | NUM\nNUM: /[0-9]{1,3}/'
LARK_TEXT = r"(red|green|blue|[0-9]{1,3})(,(red|green|blue|[0-9]{1,3})){2,3}"
GRAMMARS = {"json": {"json": SCHEMA}, "regex": {"regex": REGEX}, "choice": {"choice": CHOICES},
            "grammar": {"grammar": LARK}}
SAMPLED = {"temperature": 0.9, "top_k": 40, "top_p": 0.95}


def fits(kind: str, text: str) -> bool:
    """Whether `text` is a whole output of the grammar GRAMMARS[kind]."""
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "grammar":
        return re.fullmatch(LARK_TEXT, text) is not None
    return text in CHOICES


def oracle_run(pipe, prompt, ar_tokens, block, oracle_seed, stats, max_new, **kwargs):
    oracle = OracleDrafter(prompt + ar_tokens, block_size=block, vocab=pipe.tokenizer.vocab_size, seed=oracle_seed)
    # the pipeline's EOS ids: the grammar allows EOS (where it accepts) by those, as the AR run's does
    spec_pipe = DFlashPipeline(pipe.target, oracle, pipe.tokenizer, pipe.eos_token_ids, block,
                               prompt_lookup=False, prefix_cache=False)
    spec_pipe.vocab_size = pipe.vocab_size
    return list(spec_pipe.generate_tokens(prompt, max_new, eos_token_ids=[], stats=stats, **kwargs))


def text_of(pipe, events):
    return pipe.tokenizer.decode([e.token for e in events if e.token not in pipe.eos_token_ids])


# -- the round's pieces on a toy grammar -------------------------------------------------------------------
class IncreasingMatcher:
    """decode.structured.GrammarMatcher of a toy grammar: each token above the one before, complete at `top`
    (then only EOS, token 0, is allowed)."""

    def __init__(self, vocab=16, top=15):
        self.vocab, self.top, self.tokens = vocab, top, []

    @property
    def stopped(self):
        return bool(self.tokens) and self.tokens[-1] == self.top

    def _ok(self, t):
        return not self.stopped and (not self.tokens or t > self.tokens[-1])

    def consume(self, tokens):
        n = 0
        for t in tokens:
            if not self._ok(t):
                break
            self.tokens.append(int(t))
            n += 1
        return n

    def rollback(self, n):
        del self.tokens[len(self.tokens) - n:]

    def allowed(self):
        return np.array([t == 0 if self.stopped else self._ok(t) for t in range(self.vocab)])  # 0 is EOS

    def forced(self):
        return []


def test_drafts_are_cut_at_the_first_forbidden_one_and_the_matcher_is_left_as_it_was():
    matcher = IncreasingMatcher()
    grammar = GrammarState(matcher)
    matcher.consume([3])
    assert list(grammar.cut(np.array([5, 7, 6, 9]))) == [5, 7]
    assert list(grammar.cut(np.array([2, 9]))) == []
    assert list(grammar.cut(np.array([14, 15, 15]))) == [14, 15]  # nothing past the completing token
    assert matcher.tokens == [3]


def test_row_i_is_masked_by_the_state_after_the_drafts_before_it_and_the_rest_rolls_back():
    matcher = IncreasingMatcher()
    grammar = GrammarState(matcher)
    matcher.consume([2])
    logits = np.tile(np.arange(16.0)[::-1], (3, 1))  # unmasked, token 0 would always win
    rows = grammar.rows(logits, np.array([4, 9]))
    for i, lowest in enumerate([3, 5, 10]):
        assert int(np.argmax(rows[i])) == lowest
        assert np.isneginf(rows[i][:lowest]).all() and np.isfinite(rows[i][lowest:]).all()
    assert grammar.chosen([4, 5]) is None  # one draft accepted, then the target's token
    assert matcher.tokens == [2, 4, 5]
    rows = grammar.rows(logits, np.array([15]))
    rows[0], rows[1]
    assert grammar.chosen([15, 0]) == 1  # the accepted draft completed the grammar: the round stops there
    assert matcher.tokens == [2, 4, 5, 15]


@pytest.mark.parametrize("value,words", [
    ({"regex": "a", "choice": ["b"]}, "exactly one"), ({"jsn": {}}, "unknown key 'jsn'"), ("a", "must be a dict"),
    ({"choice": []}, "choice"), ({"choice": "ab"}, "choice"), ({"json": "{nope"}, "not valid JSON"),
    ({"regex": ""}, "regex"), ({"json": [1]}, "json"),
])
def test_bad_specs_are_one_line_errors(value, words):
    with pytest.raises(ValueError) as err:
        structured_spec(value)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("value,words", [
    ({"regex": "[a-"}, "structured regex"), ({"json": {"type": "nonsense"}}, "structured json"),
    ({"grammar": "start: foo"}, "structured grammar"),
])
def test_grammars_llguidance_refuses_are_one_line_errors_before_generating(pipe, value, words):
    for call in (lambda: run(pipe, [1, 2, 3], 4, structured=value),
                 lambda: pipe.generate_batch([[1, 2, 3]], 4, structured=value)):
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value).startswith(words) and "\n" not in str(err.value)
    assert StructuredSpec("json_object").kind == "json_object"


# -- DFlash equals AR under a grammar ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_greedy_dflash_equals_ar_under_each_grammar_and_the_text_fits_it(pipe, kind):
    structured = GRAMMARS[kind]
    stats, finished, loose = GenerationStats(), 0, 0
    for i, prompt in enumerate(random_prompts(5, pipe.tokenizer.vocab_size, seed=7)):
        ar = run(pipe, prompt, 60, draft=False, structured=structured)
        ar_tokens = [e.token for e in ar]
        if ar[-1].finish_reason == "stop":
            finished += 1
            assert fits(kind, text_of(pipe, ar)), (kind, text_of(pipe, ar))
        loose += not fits(kind, text_of(pipe, run(pipe, prompt, 60, draft=False)))
        for block in (4, 8):
            spec = oracle_run(pipe, prompt, ar_tokens, block, i, stats, 60, structured=structured)
            assert [e.token for e in spec] == ar_tokens, (kind, i, block)
            assert spec[-1].finish_reason == ar[-1].finish_reason
        assert [e.token for e in run(pipe, prompt, 60, draft=True, structured=structured)] == ar_tokens
    assert finished >= 3, f"{kind}: too few constrained outputs completed the grammar to test anything"
    assert loose >= 4, f"{kind}: the unconstrained outputs fit the grammar too: the grammar tested nothing"
    lengths = set(stats.acceptance_length_histogram)
    assert len(lengths) >= 3 and max(lengths) >= 4, lengths  # accepts of several lengths, long ones too
    # partial accepts: a corrupted draft the grammar allows is verified and rejected (a choice's grammar
    # forbids every corrupted draft: it is cut, and what is verified is accepted)
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0 if kind != "choice" else stats.num_accepted_tokens > 0


def test_seeded_sampling_and_logprobs_equal_ar_under_a_grammar_with_penalties(pipe):
    stats = GenerationStats()
    for i, prompt in enumerate(random_prompts(4, pipe.tokenizer.vocab_size, seed=8)):
        for kind, structured in GRAMMARS.items():
            kwargs = {**SAMPLED, "seed": 50 + i, "logprobs": 3, "presence_penalty": 1.0, "structured": structured}
            ar = run(pipe, prompt, 40, draft=False, **kwargs)
            if ar[-1].finish_reason == "stop":
                assert fits(kind, text_of(pipe, ar))
            for block in (4, 8):
                spec = oracle_run(pipe, prompt, [e.token for e in ar], block, i, stats, 40, **kwargs)
                assert [e.token for e in spec] == [e.token for e in ar], (kind, i, block)
                for a, b in zip(spec, ar, strict=True):
                    assert a.logprob.logprob == pytest.approx(b.logprob.logprob, abs=1e-5)
                    assert [t for t, _ in a.logprob.top] == [t for t, _ in b.logprob.top]
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0


def test_the_batch_scheduler_gives_the_same_tokens_under_a_grammar(pipe):
    prompts = random_prompts(4, pipe.tokenizer.vocab_size, seed=9)
    for kind, structured in GRAMMARS.items():
        for sampling in ({"temperature": 0.0}, {**SAMPLED, "seed": 5}):
            alone = [pipe.generate(p, 40, structured=structured, **sampling) for p in prompts]
            batch = pipe.generate_batch(prompts, 40, block_size=4, structured=structured, **sampling)
            assert [r.token_ids for r in batch] == [r.token_ids for r in alone], (kind, sampling)
            for r in batch:
                assert r.finish_reason != "stop" or fits(kind, r.text), (kind, r.text)


def test_sampled_dflash_strings_follow_the_constrained_ar_distribution(pipe):
    """Two samples, AR with seeds 0..N-1 and DFlash (real drafter) with seeds N..2N-1, on a grammar of
    eight strings: a chi-square test of homogeneity must not tell them apart."""
    from scipy.stats import chi2_contingency

    structured, prompt, n = {"regex": "[ab]{3}"}, [5, 17, 42], 300
    ar = [pipe.generate(prompt, 8, temperature=1.0, seed=s, draft=False, structured=structured).text
          for s in range(n)]
    spec = [pipe.generate(prompt, 8, temperature=1.0, seed=s, block_size=4, structured=structured).text
            for s in range(n, 2 * n)]
    strings = sorted(set(ar) | set(spec))
    assert all(re.fullmatch("[ab]{3}", s) for s in strings)
    counts = np.array([[ar.count(s) for s in strings], [spec.count(s) for s in strings]])
    kept = counts.sum(axis=0) >= 10  # expected counts of a few are outside the test's assumptions
    assert kept.sum() >= 3, counts
    assert chi2_contingency(counts[:, kept]).pvalue > 0.001, counts


def test_tokens_the_grammar_forces_are_drafted_and_accepted(pipe):
    """The tiny random drafter almost never guesses a JSON key; the grammar forces them (`"size":"`), and
    those forced tokens go in as drafts: most drafts are then accepted, and the output is AR's."""
    stats = GenerationStats()
    for prompt in random_prompts(4, pipe.tokenizer.vocab_size, seed=11):
        ar = [e.token for e in run(pipe, prompt, 48, draft=False, structured=GRAMMARS["json"])]
        spec = run(pipe, prompt, 48, block_size=4, prompt_lookup=False, structured=GRAMMARS["json"], stats=stats)
        assert [e.token for e in spec] == ar
    assert stats.acceptance_rate > 0.5 and stats.num_accepted_tokens >= 20, stats
