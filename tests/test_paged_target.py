"""The paged target runner (`target_runner="paged"`, OVPagedTarget) on real tiny OpenVINO pairs:
rollback by `past_lens` is exact, its numbers match the stateful runner's, the host-held block
cache grows without changing results, rounds never copy the cache, and a bad runner name is a
one-line error. Greedy losslessness over many prompts runs on both runners in test_lossless.py."""
import json
import shutil

import numpy as np
import pytest

from ovdflash import STRICT_F32, DFlashPipeline
from ovdflash.ov.paged import OVPagedTarget


def load(pair, tmp_path, runner="paged"):
    pipe = DFlashPipeline.from_pretrained(pair, cache_dir=tmp_path, INFERENCE_NUM_THREADS=1,
                                          target_runner=runner, **STRICT_F32)
    pipe.default_block_size = pipe.block_size  # fixed blocks: every round drafts
    return pipe


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_rollback_by_past_lens_equals_a_fresh_run(arch, export_tiny_pair, tmp_path):
    pipe = load(export_tiny_pair(arch=arch), tmp_path)
    target = pipe.target
    assert isinstance(target, OVPagedTarget) and target.cache_inputs
    assert len(target.request.query_state()) == 0  # no state variables: the cache is the host's tensors
    rng = np.random.default_rng(0)
    vocab = pipe.tokenizer.vocab_size
    prompt, kept = rng.integers(0, vocab, 11), rng.integers(0, vocab, 5)
    target.reset()
    target.forward(prompt, all_logits=False)
    target.commit(len(prompt))
    target.forward(np.r_[kept[:2], rng.integers(0, vocab, 2)], all_logits=True)  # 2 of 4 accepted
    target.commit(2)
    logits, feats = target.forward(kept[2:], all_logits=True)  # overwrites the 2 rejected slots
    rolled_logits, rolled_feats = np.array(logits), np.array(feats)
    target.commit(3)
    assert target.committed == len(prompt) + 5
    target.reset()
    fresh_logits, fresh_feats = target.forward(np.r_[prompt, kept], all_logits=True)
    assert fresh_logits.shape[0] == len(prompt) + 5
    np.testing.assert_allclose(rolled_logits, fresh_logits[-3:], atol=1e-4)
    np.testing.assert_allclose(rolled_feats, fresh_feats[-3:], atol=1e-4)
    target.commit(len(prompt) + 5)
    for _ in range(4):
        p = rng.integers(0, vocab, int(rng.integers(1, 30))).tolist()
        ar = [e.token for e in pipe.generate_tokens(p, 40, draft=False, eos_token_ids=[])]
        assert [e.token for e in pipe.generate_tokens(p, 40, eos_token_ids=[])] == ar


def test_paged_and_stateful_runners_compute_the_same_rounds(tiny_pair, tmp_path):
    paged, stateful = load(tiny_pair, tmp_path).target, load(tiny_pair, tmp_path, "stateful").target
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 512, 40)
    for runner in (paged, stateful):
        runner.reset()
    outs = [r.forward(prompt, all_logits=False) for r in (paged, stateful)]
    np.testing.assert_allclose(outs[0][0], outs[1][0], atol=1e-4)
    for r in (paged, stateful):
        r.commit(len(prompt))
    for _ in range(60):  # verify blocks of 1-6 tokens, a random number kept
        block = rng.integers(0, 512, int(rng.integers(1, 7)))
        (lp, fp), (ls, fs) = (r.forward(block, all_logits=True) for r in (paged, stateful))
        assert lp.shape == ls.shape == (len(block), 512) and fp.shape == fs.shape
        np.testing.assert_allclose(lp, ls, atol=1e-4)
        np.testing.assert_allclose(fp, fs, atol=1e-4)
        kept = int(rng.integers(1, len(block) + 1))
        for r in (paged, stateful):
            r.commit(kept)
    assert paged.committed == stateful.committed > 100
    assert stateful.num_compactions > 0 and paged.num_compactions == 0


class CountingRequest:
    """Counts set_tensor (how the paged runner hands the plugin its cache) and query_state."""

    def __init__(self, request):
        self._request, self.set_tensor_calls, self.query_state_calls = request, 0, 0

    def set_tensor(self, *args):
        self.set_tensor_calls += 1
        return self._request.set_tensor(*args)

    def query_state(self):
        self.query_state_calls += 1
        return self._request.query_state()

    def __getattr__(self, name):
        return getattr(self._request, name)


def test_the_cache_grows_by_doubling_and_rounds_never_copy_it(tiny_pair, tmp_path):
    pipe = load(tiny_pair, tmp_path)
    compiled, max_length = pipe.target.compiled, pipe.target.max_length
    prompt = list(range(1, 30))
    roomy = OVPagedTarget(compiled, max_length, initial_blocks=64)
    pipe.target = roomy
    expected = [e.token for e in pipe.generate_tokens(prompt, 150, eos_token_ids=[])]
    assert roomy.num_cache_grows == 1  # the first allocation only

    small = OVPagedTarget(compiled, max_length, initial_blocks=1)
    counting = CountingRequest(small.request)
    small.request = counting
    pipe.target = small
    assert [e.token for e in pipe.generate_tokens(prompt, 150, eos_token_ids=[])] == expected
    needed = -(-(len(prompt) + 150) // small.block_tokens)
    assert small.num_blocks >= needed and small.num_blocks & (small.num_blocks - 1) == 0  # 1, 2, 4, ...
    grows = small.num_cache_grows - 1
    assert grows == int(np.ceil(np.log2(small.num_blocks)))
    assert counting.set_tensor_calls == grows * len(small.cache_inputs)  # only when growing
    assert counting.query_state_calls == 0

    sets_before = counting.set_tensor_calls
    assert [e.token for e in pipe.generate_tokens(prompt, 150, eos_token_ids=[])] == expected
    assert counting.set_tensor_calls == sets_before  # a second generation reuses the grown cache


def test_a_bad_target_runner_is_a_one_line_error(tiny_pair, tmp_path):
    with pytest.raises(ValueError, match=r"target_runner must be one of paged, stateful\b.*, got 'pagd'"):
        DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path, target_runner="pagd")
    copy = tmp_path / "pair"
    shutil.copytree(tiny_pair, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["target_runner"] = "stateful"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    pipe = DFlashPipeline.from_pretrained(copy, cache_dir=tmp_path)
    assert not isinstance(pipe.target, OVPagedTarget)  # a model directory may pin its runner
    manifest["target_runner"] = 3
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError) as err:
        DFlashPipeline.from_pretrained(copy, cache_dir=tmp_path)
    assert "manifest.json" in str(err.value) and "target_runner" in str(err.value) and "\n" not in str(err.value)
