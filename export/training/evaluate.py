"""Validation of a drafter: loss, per-slot accuracy and a teacher-forced acceptance estimate.

Contract:
- `evaluate(drafter, seqs, idxs, store, target, cfg, ...)`: loss (subset CE), per-slot top-1
  accuracy (full-vocabulary argmax, or one restricted to a draft vocabulary) and tau = 1 + mean
  number of leading correct slots per full block, overall and per domain; with `block_len` L, of
  blocks of L tokens, as a runtime verifying L-1 drafts runs them.
- `evaluate_checkpoint(drafter_dir, target_dir, data_dirs, ...)`: the same for a saved checkpoint
  (`ovdflash train --evaluate-only`), also with its draft vocabulary when it has one.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ovdflash.manifest import DRAFT_VOCAB_FILE

from ..drafter import DFlashDrafter
from .batch import build_batch
from .config import TrainConfig
from .data import load_sequences
from .loss import blocks_forward, drafter_logits, slot_weights, weighted_ce
from .target_features import FeatureStore, FrozenTarget, pick_device, precomputed_store


@torch.no_grad()
def evaluate(drafter, seqs, idxs, store, target, cfg, feat_scale, vocab_ids, remap, weights, device,
             n_anchors=None, seed=12345, draft_vocab: torch.Tensor | None = None,
             block_len: int | None = None) -> dict:
    """Val loss (subset CE), per-slot accuracy and tau estimate, with full-vocabulary argmax
    (or an argmax restricted to `draft_vocab`, as a runtime with a draft vocabulary does); with
    `block_len` L, of blocks of L tokens (L-1 drafts), as a runtime verifying L-1 drafts runs them."""
    drafter.eval()
    rng = np.random.default_rng(seed)
    B = cfg.block_size
    tot_loss, n_batches = 0.0, 0
    correct = np.zeros(B - 1)
    counted = np.zeros(B - 1)
    tau_sum: dict[str, float] = {}
    tau_n: dict[str, int] = {}
    for start in range(0, len(idxs), cfg.batch_seqs):
        chunk = idxs[start:start + cfg.batch_seqs]
        batch = build_batch(seqs, chunk, store, target.embed, rng, block_size=B,
                            n_anchors=n_anchors or cfg.val_anchors, max_len=cfg.max_len,
                            mask_token_id=cfg.mask_token_id, feat_scale=feat_scale, device=device,
                            block_len=block_len)
        h = blocks_forward(drafter, batch)
        loss, _ = weighted_ce(h, batch["labels"], target.lm_head_weight, weights, vocab_ids, remap)
        tot_loss += loss.item()
        n_batches += 1
        if draft_vocab is None:
            pred = drafter_logits(h, target.lm_head_weight).argmax(-1)  # full vocabulary, as at inference
        else:
            pred = draft_vocab[drafter_logits(h, target.lm_head_weight, draft_vocab).argmax(-1)]
        drafts = (block_len or B) - 1
        lab, pred = batch["labels"][..., :drafts], pred[..., :drafts]
        ok = (pred == lab) & (lab >= 0)
        valid = lab >= 0
        correct[:drafts] += ok.sum((0, 1)).cpu().numpy()
        counted[:drafts] += valid.sum((0, 1)).cpu().numpy()
        full = valid.all(-1)  # blocks with all their labels inside the sequence
        lead = torch.cumprod(ok.long(), dim=-1).sum(-1)  # leading correct slots
        for j, i in enumerate(chunk):
            d = seqs[i].domain
            sel = full[j]
            tau_sum[d] = tau_sum.get(d, 0.0) + float((1 + lead[j][sel]).sum())
            tau_n[d] = tau_n.get(d, 0) + int(sel.sum())
    drafter.train()
    res = {"val_loss": tot_loss / max(n_batches, 1),
           "val_acc": [round(float(c / max(n, 1)), 4) for c, n in zip(correct[:drafts], counted[:drafts])]}
    all_n = sum(tau_n.values())
    res["val_tau"] = round(sum(tau_sum.values()) / max(all_n, 1), 4)
    for d in sorted(tau_n):
        res[f"val_tau_{d}"] = round(tau_sum[d] / max(tau_n[d], 1), 4)
    return res


def evaluate_checkpoint(drafter_dir, target_dir, data_dirs, n_anchors: int = 10_000, batch_seqs: int = 4,
                        device: str = "auto", features_root: str | None = None, block_len: int | None = None) -> dict:
    """Teacher-forced acceptance estimate of a saved checkpoint (raw features, full-vocab argmax).
    Labels are the stored tokens; with `features_root` (precomputed OpenVINO features), features
    and labels (its greedy chain) come from the deployed target instead."""
    device = pick_device(device)
    drafter = DFlashDrafter.from_pretrained(drafter_dir).to(device)
    c = drafter.config
    target = FrozenTarget(target_dir, c.target_layer_ids, device, predictions=bool(features_root))
    seqs = [s for d in data_dirs for s in load_sequences(d)]
    cfg = TrainConfig(target=str(target_dir), data_dirs=[], out_dir="", block_size=c.block_size,
                      mask_token_id=c.mask_token_id, batch_seqs=batch_seqs)
    weights = slot_weights(c.block_size, cfg.gamma, device)
    store = FeatureStore(target, 2.0)
    if features_root:
        store = precomputed_store(features_root, data_dirs, store, seqs)
    res = evaluate(drafter, seqs, list(range(len(seqs))), store, target, cfg, None, None, None,
                   weights, device, n_anchors=n_anchors, block_len=block_len)
    out = {k.replace("val_", "eval_"): v for k, v in res.items()} | {"sequences": len(seqs)}
    vocab_path = Path(drafter_dir) / DRAFT_VOCAB_FILE
    if vocab_path.is_file():
        dv = torch.tensor(sorted(json.loads(vocab_path.read_text())), dtype=torch.long, device=device)
        res = evaluate(drafter, seqs, list(range(len(seqs))), store, target, cfg, None, None, None,
                       weights, device, n_anchors=n_anchors, draft_vocab=dv, block_len=block_len)
        out["with_draft_vocab"] = {k.replace("val_", "eval_"): v for k, v in res.items() if "loss" not in k}
    return out
