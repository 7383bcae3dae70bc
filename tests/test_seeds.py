"""Seeds mean the same reply: a seeded sampled reply is token-identical across decoding modes.

The randomness of the token at absolute position t comes from (seed, t) alone (sampling.
PositionRandomness), and a draft is accepted iff it equals the target's own sample at its position,
so DFlash at any block size, with or without lookup drafts, with "auto", and plain AR all emit the
same tokens for one seed. Real tiny pair under STRICT_F32 (so a verify row and an AR step compute
the same logits); the distribution itself is checked by the chi-square tests (test_sampling_stats).
"""
import numpy as np
import pytest

from ovdflash import STRICT_F32, DFlashPipeline

NUM_PROMPTS = 20
SEEDS = (0, 1, 2)
SETTINGS = {0: dict(temperature=1.0), 1: dict(temperature=0.7, top_p=0.9), 2: dict(temperature=1.3, top_k=20)}


@pytest.fixture(scope="module")
def pipe(export_tiny_pair, tmp_path_factory):
    model = export_tiny_pair(block_size=8)
    return DFlashPipeline.from_pretrained(model, cache_dir=tmp_path_factory.mktemp("ov_cache_seeds"), **STRICT_F32)


def prompts():
    rng = np.random.default_rng(7)
    out = []
    for i in range(NUM_PROMPTS):
        part = [int(t) for t in rng.integers(1, 500, size=int(rng.integers(2, 12)))]
        out.append(part * 3 if i % 2 else part)  # repeats give the n-gram lookup matches
    return out


def test_a_seeded_reply_is_the_same_in_every_mode(pipe):
    modes = [dict(draft=False)] + [dict(block_size=b, prompt_lookup=pl) for b in (2, 4, 8, "auto")
                                   for pl in (True, False)]
    accepted = lookup_rounds = 0
    for seed in SEEDS:
        for prompt in prompts():
            ar = pipe.generate(prompt, max_new_tokens=24, seed=seed, **SETTINGS[seed], **modes[0])
            for mode in modes[1:]:
                out = pipe.generate(prompt, max_new_tokens=24, seed=seed, **SETTINGS[seed], **mode)
                assert out.token_ids == ar.token_ids, (seed, prompt, mode)
                accepted += out.stats.num_accepted_tokens
                lookup_rounds += out.stats.num_lookup_drafts
    assert accepted > 0 and lookup_rounds > 0  # drafts were accepted, and lookup rounds ran


def test_different_seeds_give_different_replies(pipe):
    replies = {tuple(pipe.generate([5, 6, 7], max_new_tokens=16, seed=s, temperature=1.0).token_ids)
               for s in range(5)}
    assert len(replies) > 1
    unseeded = {tuple(pipe.generate([5, 6, 7], max_new_tokens=16, temperature=1.0).token_ids) for _ in range(3)}
    assert len(unseeded) > 1  # no seed: fresh randomness each call
