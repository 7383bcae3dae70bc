"""Mask-based KV rollback on the real OpenVINO target (the stateful runner): exact, and never a
per-round cache copy. The paged runner's rollback: tests/test_paged_target.py."""
import numpy as np
import pytest

from ovdflash import STRICT_F32, DFlashPipeline


class CountingRequest:
    """Wraps an InferRequest and counts every query_state() (the only way to touch the KV state)."""

    def __init__(self, request):
        self._request = request
        self.query_state_calls = 0
        self.infer_calls = 0

    def query_state(self):
        self.query_state_calls += 1
        return self._request.query_state()

    def infer(self, *args, **kwargs):
        self.infer_calls += 1
        return self._request.infer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._request, name)


@pytest.fixture(scope="module")
def pipe(tiny_pair, tmp_path_factory):
    pipe = DFlashPipeline.from_pretrained(tiny_pair, cache_dir=tmp_path_factory.mktemp("ov_cache"),
                                          INFERENCE_NUM_THREADS=1,  # tiny calls: 1 thread is faster
                                          target_runner="stateful", **STRICT_F32)
    pipe.default_block_size = pipe.block_size  # these tests are about fixed-block rounds, not block_size="auto"
    return pipe


def check_masked_rollback_equals_fresh_run(pipe):
    target = pipe.target
    rng = np.random.default_rng(0)
    vocab = pipe.tokenizer.vocab_size
    prompt = rng.integers(0, vocab, 11)
    kept = rng.integers(0, vocab, 5)
    target.reset()
    target.forward(prompt, all_logits=False)
    target.commit(len(prompt))
    # a verify block of 4 where only 2 are accepted, then a block of 3 fully accepted
    target.forward(np.r_[kept[:2], rng.integers(0, vocab, 2)], all_logits=True)
    target.commit(2)
    logits, feats = target.forward(kept[2:], all_logits=True)
    rolled_logits, rolled_feats = np.array(logits), np.array(feats)
    target.commit(3)
    assert target.physical == len(prompt) + 4 + 3 and target.committed == len(prompt) + 5
    target.reset()
    fresh_logits, fresh_feats = target.forward(np.r_[prompt, kept], all_logits=True)
    np.testing.assert_allclose(rolled_logits, fresh_logits[-3:], atol=1e-4)
    np.testing.assert_allclose(rolled_feats, fresh_feats[-3:], atol=1e-4)
    target.commit(len(prompt) + 5)


def test_masked_rollback_equals_a_fresh_run(pipe):
    check_masked_rollback_equals_fresh_run(pipe)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_architecture_honours_the_physical_mask(arch, export_tiny_pair, tmp_path):
    """Mask rollback relies on the graph applying a non-contiguous attention_mask: check per family
    (llama = SmolLM2's), then greedy DFlash == AR on a few prompts."""
    pipe = DFlashPipeline.from_pretrained(export_tiny_pair(arch=arch), cache_dir=tmp_path,
                                          INFERENCE_NUM_THREADS=1, target_runner="stateful", **STRICT_F32)
    pipe.default_block_size = pipe.block_size  # these tests are about fixed-block rounds, not block_size="auto"
    check_masked_rollback_equals_fresh_run(pipe)
    rng = np.random.default_rng(3)
    for _ in range(5):
        prompt = rng.integers(0, pipe.tokenizer.vocab_size, int(rng.integers(1, 30))).tolist()
        ar = [e.token for e in pipe.generate_tokens(prompt, 40, draft=False, eos_token_ids=[])]
        assert [e.token for e in pipe.generate_tokens(prompt, 40, eos_token_ids=[])] == ar


def test_compaction_keeps_results_exact(pipe):
    target = pipe.target
    rng = np.random.default_rng(1)
    vocab = pipe.tokenizer.vocab_size
    seq = rng.integers(0, vocab, 30)
    target.reset()
    target.forward(seq[:10], all_logits=False)
    target.commit(10)
    for k in range(10, 20):  # each step: the real token plus 3 rejected ones
        target.forward(np.r_[seq[k], rng.integers(0, vocab, 3)], all_logits=True)
        target.commit(1)
    assert target.garbage == 30
    reads = target.state_reads
    target.compact()
    assert target.physical == target.committed == 20 and target.garbage == 0
    assert target.state_reads - reads == len(target.request.query_state()) > 0
    logits, _ = target.forward(seq[20:], all_logits=True)
    compacted = np.array(logits)
    target.commit(10)
    target.reset()
    fresh, _ = target.forward(seq, all_logits=True)
    np.testing.assert_allclose(compacted, fresh[20:], atol=1e-4)
    target.commit(30)


def test_rounds_never_touch_the_kv_state(pipe):
    target = pipe.target
    counting = CountingRequest(target.request)
    target.request = counting
    old_min = target.compact_min_garbage
    prompt = list(range(1, 20))
    try:
        target.compact_min_garbage = 10 ** 9  # no compaction: rounds alone
        reads, writes = target.state_reads, target.state_writes
        assert len(list(pipe.generate_tokens(prompt, 80, eos_token_ids=[]))) == 80
        assert target.garbage > 20  # drafts were rejected and rolled back...
        assert counting.query_state_calls == 0  # ...without reading or writing any state
        assert (target.state_reads, target.state_writes) == (reads, writes)
        target_calls = counting.infer_calls

        # with compaction on, the state is touched only by compactions: one pass each
        target.compact_min_garbage = 16
        before = target.num_compactions
        assert len(list(pipe.generate_tokens(prompt, 80, eos_token_ids=[]))) == 80
        compactions = target.num_compactions - before
        assert compactions >= 1
        assert counting.query_state_calls == compactions
        num_states = len(counting._request.query_state())
        assert target.state_reads - reads == target.state_writes - writes == compactions * num_states
        assert counting.infer_calls == 2 * target_calls  # the same rounds as before
    finally:
        target.request = counting._request
        target.compact_min_garbage = old_min
