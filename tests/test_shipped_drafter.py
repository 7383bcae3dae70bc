"""The shipped SmolLM2 drafter, end to end (slow: fetches SmolLM2 and exports the pair once).

Loads the embedded default (`ensure_default_model`: SmolLM2-135M-Instruct int8 + the drafter
committed under models/smollm2_dflash), and on held-out eval prompts checks that greedy
DFlash output is token-identical to the pipeline's own autoregressive output (strict f32
numerics) and that the drafter actually gets drafts accepted: mean acceptance length clearly
above 1 (a random drafter scores ~1.0).
"""
import json

import pytest

import ovdflash

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_pipe():
    from ovdflash_models.default import ensure_default_model

    return ovdflash.DFlashPipeline.from_pretrained(ensure_default_model(), **ovdflash.STRICT_F32)


def _eval_prompts(domain, n):
    from ovdflash.bench import prompts_dir

    rows = [json.loads(line) for line in (prompts_dir() / f"eval_{domain}.jsonl").read_text().splitlines()]
    return [row["turns"][0] for row in rows[:n]]


def test_shipped_drafter_is_lossless_and_accepts(default_pipe):
    from ovdflash.decode.stats import GenerationStats

    pipe = default_pipe
    total = GenerationStats()
    for domain in ("code", "math", "chat"):
        for prompt in _eval_prompts(domain, 2):
            ids = pipe.encode_prompt([{"role": "user", "content": prompt}])
            ar = [e.token for e in pipe.generate_tokens(ids, 64, draft=False)]
            stats = GenerationStats()
            spec = [e.token for e in pipe.generate_tokens(ids, 64, block_size=8, stats=stats)]
            assert spec == ar, f"{domain}: DFlash diverged from AR at token {next(i for i, (a, b) in enumerate(zip(spec, ar)) if a != b)}"
            total.merge(stats)
    print("shipped drafter, 6 held-out prompts, block 8:", total.report())
    assert total.num_drafts > 0
    assert total.mean_acceptance_length > 1.3  # a trained drafter, not a random one (~1.0; docs/BENCHMARKS.md)
