"""Checks every drafter kind's tests share: greedy and seeded decoding equal AR, export errors are one line.

`random_prompts(n, vocab, seed)`: n prompts of 1..59 random ids (the first two of length 1 and 2).
`assert_greedy_equals_ar(pipe, block)`: 20 prompts, 32 tokens, no lookup; rounds both accept and reject.
`assert_seeded_equals_ar(pipe)`: 4 seeded prompts at temperature 0.8 give AR's tokens.
`assert_sampled_follows_ar(pipe, prompt, tokens)`: two-sample chi-square of each token after the first, drafting against
  AR (independent seeds); at least 10 drafts accepted and some rejected.
`assert_export_fails(target, drafter, out, message)`: `ovdflash export` exits 2 with one line holding message.
"""
import numpy as np


def random_prompts(n, vocab, seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.r_[1, 2, rng.integers(1, 60, size=n - 2)]
    return [rng.integers(0, vocab, size=int(k)).tolist() for k in lengths]


def assert_greedy_equals_ar(pipe, block):
    from ovdflash.decode.stats import GenerationStats

    stats = GenerationStats()
    for i, prompt in enumerate(random_prompts(20, pipe.tokenizer.vocab_size, seed=block)):
        ar = [e.token for e in pipe.generate_tokens(prompt, 32, draft=False, eos_token_ids=[])]
        spec = [e.token for e in pipe.generate_tokens(prompt, 32, block_size=block, prompt_lookup=False,
                                                      eos_token_ids=[], stats=stats)]
        assert spec == ar, i
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0  # rounds both accept and roll back


def assert_seeded_equals_ar(pipe):
    for seed, prompt in enumerate(random_prompts(4, pipe.tokenizer.vocab_size, seed=9)):
        ar = pipe.generate(prompt, max_new_tokens=24, seed=seed, temperature=0.8, draft=False)
        spec = pipe.generate(prompt, max_new_tokens=24, seed=seed, temperature=0.8, prompt_lookup=False)
        assert spec.token_ids == ar.token_ids, seed


def assert_sampled_follows_ar(pipe, prompt=(5, 17, 33), tokens=4, samples=300, **params):
    from scipy import stats as sps

    from ovdflash.decode.stats import GenerationStats

    params = params or dict(temperature=0.3, top_k=3)
    stats = GenerationStats()

    def draw(draft):
        return np.array([[e.token for e in pipe.generate_tokens(
            list(prompt), tokens, draft=draft, seed=s + (10 ** 6 if draft else 0), eos_token_ids=[], block_size=4,
            prompt_lookup=False, stats=stats if draft else None, **params)] for s in range(samples)])

    ar, spec = draw(False), draw(True)
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 10, (stats.num_draft_tokens, stats.num_accepted_tokens)
    p_values = {}
    for pos in range(1, tokens):
        values = sorted(set(ar[:, pos]) | set(spec[:, pos]))
        table = np.array([[np.sum(ar[:, pos] == v) for v in values], [np.sum(spec[:, pos] == v) for v in values]])
        keep = table.sum(0) >= 10  # pool rare tokens
        table = np.c_[table[:, keep], table[:, ~keep].sum(1, keepdims=True)]
        p_values[pos] = sps.chi2_contingency(table[:, table.sum(0) > 0]).pvalue
    assert min(p_values.values()) > 1e-3, p_values


def assert_export_fails(target, drafter, out, message):
    from click.testing import CliRunner

    from ovdflash.cli import main

    result = CliRunner().invoke(main, ["export", "--target", str(target), "--drafter", str(drafter), "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], result.output
    assert not out.exists()


def strict_pipe(model_dir, cache_dir):
    """The exported pair under STRICT_F32 on one thread, a call that names no block size getting the whole block."""
    from ovdflash import STRICT_F32, DFlashPipeline

    pipe = DFlashPipeline.from_pretrained(model_dir, cache_dir=cache_dir, INFERENCE_NUM_THREADS=1, **STRICT_F32)
    pipe.default_block_size = pipe.block_size
    return pipe


def edited_checkpoint(src, dst, config=None, drop=(), section=None):
    """A copy of a checkpoint with config keys set (None: removed; in `section` when named) and tensors dropped."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        fields = cfg[section] if section else cfg
        for key, value in config.items():
            if value is None:
                fields.pop(key)
            else:
                fields[key] = value
        (dst / "config.json").write_text(json.dumps(cfg))
    if drop:
        state = load_file(str(dst / "model.safetensors"))
        save_file({k: v for k, v in state.items() if k not in drop}, str(dst / "model.safetensors"))
    return dst
