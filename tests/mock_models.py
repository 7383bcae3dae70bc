"""Mock target and drafter runners with controllable logits (nanochat style), no OpenVINO.

MockTarget keeps a physical slot list with a 0/1 mask, exactly like the OpenVINO runner's
mask-based rollback, and computes each row's logits from the LOGICAL history only (the unmasked
slots before it). A bookkeeping bug (a rejected token left visible, a wrong position) changes
the logits and breaks speculative == autoregressive. Features are (token, logical position), so
MockDrafter can check that the engine handed it exactly the committed tokens, in order.
"""
from __future__ import annotations

import numpy as np


class MockTarget:
    rewinds_exactly = False  # sequence.TargetRunner: `rewind` keeps only all committed tokens

    def __init__(self, vocab_size=32, max_length=4096, seed=0, sharpness=3.0, logits_fn=None,
                 compact_garbage=8):
        rng = np.random.default_rng(seed)
        self.vocab_size = vocab_size
        self.max_length = max_length
        self.w_last = sharpness * rng.standard_normal((vocab_size, vocab_size))
        self.w_prev = 0.5 * sharpness * rng.standard_normal((vocab_size, vocab_size))
        self.w_sum = 0.5 * sharpness * rng.standard_normal((vocab_size, vocab_size))
        self.logits_fn = logits_fn or self.default_logits
        self.compact_garbage = compact_garbage
        self.num_compactions = 0
        self.num_forward_calls = 0
        self.reset()

    def default_logits(self, seq):
        prev = seq[-2] if len(seq) > 1 else 0
        return self.w_last[seq[-1]] + self.w_prev[prev] + self.w_sum[sum(seq) % self.vocab_size]

    def reset(self):
        self.slots: list[int] = []      # physical token per slot
        self.positions: list[int] = []  # logical position per slot
        self.mask: list[int] = []
        self.committed = 0
        self.pending = 0

    def forward(self, token_ids, all_logits):
        assert self.pending == 0, "forward before commit of the previous forward"
        self.num_forward_calls += 1
        visible = [t for t, m in zip(self.slots, self.mask) if m]
        assert len(visible) == self.committed
        rows, feats = [], []
        for i, t in enumerate(np.asarray(token_ids).tolist()):
            self.slots.append(t)
            self.positions.append(self.committed + i)
            self.mask.append(1)
            visible.append(t)
            rows.append(self.logits_fn(visible))
            feats.append((t, self.committed + i))
        self.pending = len(token_ids)
        logits = np.array(rows, dtype=np.float32)
        return (logits if all_logits else logits[-1:]), np.array(feats, dtype=np.float32)

    def commit(self, num_kept):
        assert 0 < num_kept <= self.pending
        for j in range(len(self.mask) - self.pending + num_kept, len(self.mask)):
            self.mask[j] = 0
        self.committed += num_kept
        self.pending = 0
        if len(self.mask) - sum(self.mask) >= self.compact_garbage:
            keep = [j for j, m in enumerate(self.mask) if m]
            self.slots = [self.slots[j] for j in keep]
            self.positions = [self.positions[j] for j in keep]
            self.mask = [1] * len(keep)
            self.num_compactions += 1
        assert [p for p, m in zip(self.positions, self.mask) if m] == list(range(self.committed))

    def rewind(self, num_kept):
        if num_kept != self.committed:
            raise ValueError(f"MockTarget cannot rewind from {self.committed} to {num_kept} tokens")

    def logical_tokens(self):
        return [t for t, m in zip(self.slots, self.mask) if m]


class MockDrafter:
    """Proposes the target's greedy continuation, corrupted at rate `error_rate` (seeded)."""

    def __init__(self, target: MockTarget, block_size=4, error_rate=0.3, seed=1):
        self.target = target
        self.block_size = block_size
        self.error_rate = error_rate
        self.seed = seed
        self.num_propose_calls = 0
        self.reset()

    def reset(self):
        self.context: list[int] = []
        self.rng = np.random.default_rng(self.seed)  # same corruptions on every generation

    @property
    def context_len(self):
        return len(self.context)

    def rewind(self, num_kept):
        del self.context[num_kept:]

    def propose(self, last, ctx_feats, start, num_drafts):
        self.num_propose_calls += 1
        tokens, positions = ctx_feats[:, 0].astype(int).tolist(), ctx_feats[:, 1].astype(int).tolist()
        assert positions == list(range(len(self.context), len(self.context) + len(tokens))), positions
        assert len(self.context) + len(tokens) == start
        self.context += tokens
        assert self.context == self.target.logical_tokens(), "drafter context != committed tokens"
        seq = self.context + [int(last)]
        drafts = []
        for _ in range(num_drafts):
            d = int(np.argmax(self.target.logits_fn(seq)))
            if self.rng.random() < self.error_rate:
                d = (d + 1 + int(self.rng.integers(self.target.vocab_size - 1))) % self.target.vocab_size
            drafts.append(d)
            seq.append(d)
        return np.array(drafts, dtype=np.int64)


def byte_tokenizer(eos="<eos>"):
    """An ovdflash Tokenizer whose ids 0..255 are the raw bytes (byte-level BPE, no merges), then `eos`."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    from ovdflash.tokenizer import Tokenizer

    # GPT-2's bytes_to_unicode: printable bytes stand for themselves, the rest map to 256 + n
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | \
        set(range(ord("®"), ord("ÿ") + 1))
    byte_to_char, n = {}, 0
    for b in range(256):
        byte_to_char[b] = chr(b) if b in printable else chr(256 + n)
        n += b not in printable
    assert set(byte_to_char.values()) == set(ByteLevel.alphabet())
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([eos])
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    return Tokenizer(tok, chat_template=template, eos_token=eos)
