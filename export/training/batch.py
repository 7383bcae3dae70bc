"""Which sequences a step trains on, and the tensors of one drafter forward over them.

Contract:
- `split_train_val(seqs, fraction, seed)`: validation = whole prompts (a follow-up on its root
  prompt's side); `interleave_sources` deals several data directories round-robin;
  `pick_batch(rng, train_idx, step, batch, new_per_step)`: a step's sequences, deterministic.
- `build_batch(seqs, idxs, store, embed, rng, ...)`: per sequence, random anchors p in the response;
  block `[x_p, MASK*(B-1)]` at positions p..p+B-1; a block sees context features j < p and its own
  block (bidirectional); slot k labels x_{p+k}, or the target's greedy chain (`chain_labels`) when
  the store has predictions; shorter blocks as `short_blocks` / `block_len` ask.
"""
from __future__ import annotations

import numpy as np
import torch

from .data import Sequence
from .prompts import root_prompt_id
from .target_features import FeatureStore


def split_train_val(seqs: list[Sequence], fraction: float, seed: int):
    """Validation = whole prompts (every mode/rep of a prompt stays on one side), a follow-up on
    its root prompt's side: it carries that prompt's reply in its context."""
    import zlib

    roots = [root_prompt_id(s.prompt_id) for s in seqs]
    val_ids = {p for p in set(roots) if (zlib.crc32(f"{seed}:{p}".encode()) % 10_000) < fraction * 10_000}
    train = [i for i, r in enumerate(roots) if r not in val_ids]
    val = [i for i, r in enumerate(roots) if r in val_ids]
    return train, val


def interleave_sources(idxs: list[int], source: list[int], seed: int) -> list[int]:
    """`idxs` reordered: each source's items shuffled, then dealt round-robin across sources."""
    rng = np.random.default_rng(seed)
    per = [[i for i in idxs if source[i] == k] for k in sorted({source[i] for i in idxs})]
    per = [[p[j] for j in rng.permutation(len(p))] for p in per]
    return [p[j] for j in range(max(map(len, per), default=0)) for p in per if j < len(p)]


def pick_batch(rng: np.random.Generator, train_idx: list[int], step: int, batch: int, new_per_step: int | None):
    """Sequence indices for `step`; deterministic given (rng, step, train_idx).

    With new_per_step=k, the data is walked in stored order: step t takes the k sequences
    [f(t-1), f(t)) with f(t) = batch + k*t, plus batch-k drawn at random from the ones before.
    """
    n = len(train_idx)
    if new_per_step is None or n <= batch:
        return [train_idx[i] for i in rng.choice(n, size=min(batch, n), replace=False)]
    lo = min(n, batch + new_per_step * (step - 1)) if step else 0
    hi = min(n, batch + new_per_step * step)
    fresh = list(range(lo, hi))
    old = rng.choice(lo, size=min(batch - len(fresh), lo), replace=False).tolist() if lo else []
    return [train_idx[i] for i in fresh + old]


def _sample_anchors(rng: np.random.Generator, prompt_len: int, length: int, n: int) -> np.ndarray:
    lo, hi = prompt_len, length - 2  # anchor = a committed response token with at least one label after it
    if hi < lo:
        return np.zeros(0, dtype=np.int64)
    cands = np.arange(lo, hi + 1)
    if cands.size > n:
        cands = rng.choice(cands, size=n, replace=False)
    return np.sort(cands)


def chain_labels(tokens: torch.Tensor, pred: torch.Tensor, anchors: torch.Tensor, B: int) -> torch.Tensor:
    """Greedy-chain labels [n, B-1] for blocks anchored at `anchors` (-100 = no label).

    Slot k of the block at anchor p gets pred[p+k-1], the target's greedy token after the stored
    prefix x_0..x_{p+k-1}, but only while the stored tokens agree with the target's greedy chain,
    x_{p+j} == pred[p+j-1] for j < k: then that prefix *is* what greedy decoding would have
    produced from p, so the label is exactly the token verification accepts. For the target's own
    greedy responses this equals x_{p+k}; for sampled responses and foreign text it keeps the exact
    prefix of each block and drops the rest."""
    L = tokens.numel()
    agree = torch.zeros(L + B, dtype=torch.bool)
    agree[: L - 1] = tokens[1:] == pred[: L - 1]          # agree[q]: x_{q+1} is the greedy pick after q
    ks = torch.arange(1, B)
    pos = anchors[:, None] + ks[None, :]                  # [n, B-1] position each slot predicts
    lab = torch.where(pos < L, pred[(pos - 1).clamp(max=L - 1)].long(), torch.full_like(pos, -100))
    prev_ok = agree[(anchors[:, None] + ks[None, :-1]).clamp(max=L + B - 1) - 1]  # slot k needs agree[p..p+k-2]
    chain = torch.cumprod(torch.cat([torch.ones(len(anchors), 1, dtype=torch.long), prev_ok.long()], 1), 1)
    return torch.where(chain.bool(), lab, torch.full_like(lab, -100))


def build_batch(seqs: list[Sequence], idxs, store: FeatureStore, embed, rng: np.random.Generator, *,
                block_size: int, n_anchors: int, max_len: int, mask_token_id: int, feat_scale, device,
                soft: bool = False, short_blocks: float = 0.0, block_len: int | None = None,
                target_batch: int = 1):
    """Tensors for one drafter forward over len(idxs) sequences with up to n_anchors blocks each.
    Labels are the stored tokens, or the target's greedy chain when the store has predictions.
    With `soft`, also the target's top-k at each labelled slot (`soft_ids` [b,N,B-1,K], -100 where
    none, and `soft_logp`), from a store that has them (PrecomputedStore.soft).
    Shorter blocks, as a runtime that verifies fewer than B-1 drafts runs them: with `block_len` L
    every block, with `short_blocks` f a fraction f of the blocks (L uniform in 2..B-1), holds only
    its first L tokens: the other slots are hidden from it and unlabelled. With `target_batch` > 1
    the target computes missing features that many sequences a forward (store.prefetch)."""
    B = block_size
    toks, feats, preds, anchors, softs = [], [], [], [], []
    if target_batch > 1:
        store.prefetch([(i, torch.from_numpy(seqs[i].tokens[:max_len])) for i in idxs], target_batch)
    for i in idxs:
        s = seqs[i]
        t = torch.from_numpy(s.tokens[:max_len])
        toks.append(t)
        f, p = store.get(i, t)
        feats.append(f)
        preds.append(p)
        softs.append(store.soft(i, t.numel()) if soft else None)
        anchors.append(_sample_anchors(rng, s.prompt_len, t.numel(), n_anchors))
    b = len(idxs)
    S = max(t.numel() for t in toks)
    N = max(1, max(a.size for a in anchors))
    Ftot = feats[0].shape[-1]
    target_hidden = torch.zeros(b, S, Ftot)
    block_ids = torch.full((b, N, B), mask_token_id, dtype=torch.long)
    labels = torch.full((b, N, B - 1), -100, dtype=torch.long)
    anchor_pos = torch.zeros(b, N, dtype=torch.long)
    keep = torch.zeros(b, N, dtype=torch.bool)
    for j, (t, f, p, a) in enumerate(zip(toks, feats, preds, anchors)):
        L = t.numel()
        target_hidden[j, :L] = f
        n = a.size
        if n == 0:
            continue
        a_t = torch.from_numpy(a)
        anchor_pos[j, :n] = a_t
        keep[j, :n] = True
        block_ids[j, :n, 0] = t[a_t]
        if p is not None:
            labels[j, :n] = chain_labels(t, p, a_t, B)
            continue
        for k in range(1, B):
            pos = a_t + k
            ok = pos < L
            labels[j, :n, k - 1] = torch.where(ok, t[pos.clamp(max=L - 1)], torch.full_like(pos, -100))
    blk_len = torch.full((b, N), B, dtype=torch.long)
    if block_len is not None:
        blk_len.fill_(block_len)
    elif short_blocks > 0 and B > 2:
        short = torch.from_numpy(rng.random((b, N)) < short_blocks)
        blk_len[short] = torch.from_numpy(rng.integers(2, B, size=(b, N)))[short]
    labels[torch.arange(1, B)[None, None, :] >= blk_len[:, :, None]] = -100
    soft_ids = soft_logp = None
    K = next((sf[0].shape[1] for sf in softs if sf is not None), 0)
    if K:
        soft_ids = torch.full((b, N, B - 1, K), -100, dtype=torch.long)
        soft_logp = torch.zeros(b, N, B - 1, K)
        for j, (t, a, sf) in enumerate(zip(toks, anchors, softs)):
            if sf is None or a.size == 0:
                continue
            # slot k's label is the target's pick after position p+k-1: so is its distribution
            pos = (torch.from_numpy(a)[:, None] + torch.arange(B - 1)[None, :]).clamp(max=t.numel() - 1)
            ok = (labels[j, :a.size] >= 0)[..., None]
            ids_at = sf[0][pos]
            soft_ids[j, :a.size] = torch.where(ok, ids_at, torch.full_like(ids_at, -100))
            soft_logp[j, :a.size] = sf[1][pos]
    # positions: context 0..S-1, then each block p..p+B-1
    ctx_pos = torch.arange(S).expand(b, S)
    blk_pos = (anchor_pos[:, :, None] + torch.arange(B)).reshape(b, N * B)
    position_ids = torch.cat([ctx_pos, blk_pos], dim=1)
    # mask [b,1,N*B,S+N*B]: context j visible iff j < anchor; own block's first blk_len slots visible
    ctx_vis = torch.arange(S)[None, None, :] < anchor_pos[:, :, None]          # [b,N,S]
    ctx_vis = ctx_vis[:, :, None, :].expand(b, N, B, S).reshape(b, N * B, S)
    blk_id = torch.arange(N).repeat_interleave(B)
    in_len = (torch.arange(B)[None, None, :] < blk_len[:, :, None]).reshape(b, 1, N * B)
    blk_vis = (blk_id[:, None] == blk_id[None, :])[None] & in_len
    mask = torch.cat([ctx_vis, blk_vis], dim=-1)[:, None]
    labels[~keep] = -100
    with torch.no_grad():
        block_embeds = embed(block_ids.reshape(b, N * B).to(device)).float()
    th = target_hidden.to(device)
    if feat_scale is not None:
        th = th * feat_scale
    return dict(block_embeds=block_embeds, target_hidden=th, position_ids=position_ids.to(device),
                mask=mask.to(device), labels=labels.to(device), B=B, N=N,
                soft_ids=None if soft_ids is None else soft_ids.to(device),
                soft_logp=None if soft_logp is None else soft_logp.to(device))
