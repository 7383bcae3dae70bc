"""Distill a DFlash drafter for any Hugging Face causal LM (CPU or CUDA).

Contract:
- `train(cfg: TrainConfig) -> Path` trains `ovdflash_export.drafter.DFlashDrafter` on sequences
  stored by `ovdflash_export.training.data` (token ids: chat prompt + target-regenerated response) and
  writes a z-lab checkpoint (config.json + model.safetensors, no embedding / lm_head) to
  `cfg.out_dir`, loadable with `DFlashDrafter.from_pretrained` and by `ovdflash export`.
- The target is frozen and never saved. Its embedding embeds the blocks, its lm_head scores them.
  Target features (HF `hidden_states[id+1]` = output of decoder layer id, before the final norm)
  are recomputed by the target itself, one sequence at a time, running only the layers up to the
  deepest id; `feature_cache_gb` keeps them (fp16) in memory so later epochs skip the target.
- Objective (dflash.md §5): per sequence, random anchors p in the response; block
  `[x_p, MASK*(B-1)]` at positions p..p+B-1; a block sees context features j < p and its own
  block (bidirectional); slot k labels x_{p+k}; CE weighted by exp(-(k-1)/gamma) / sum.
  With `short_blocks` f, a fraction f of the blocks is cut to a random length L in 2..B-1 (the
  block sees only its first L tokens, slots >= L are unlabelled), as a runtime verifying L-1
  drafts would run it; the saved config then carries `ovdflash_short_blocks` = f.
- Warm start (`init_from`): a checkpoint of the same geometry, or of fewer layers, whose added
  layers start as no-ops (`grown_state_dict`).
- Distillation (`kd_weight` > 0): the loss becomes
  (1 - kd_weight) * that CE + kd_weight * the same slot-weighted cross-entropy against the
  target's own next-token distribution (its top-k: stored with precomputed features made with
  --topk, else computed by the torch target in the features' forward, `kd_topk`; renormalised
  over the ids scored), on
  every slot that has a greedy-chain label (there the stored context is the chain's, so the
  target's distribution at that position is the one verification samples from).
- Two deviations that keep the saved checkpoint standard (drafter_feasibility.md §2):
  * the CE softmax runs over the token ids that occur in the training data plus
    `num_negatives` random other ids per step (keeps the rest of the vocabulary pushed down, so
    the full-vocabulary argmax used at inference stays safe); with `ce_vocab_size` N, over the
    N ids the target's responses use most and nothing else: exactly the draft vocabulary the
    runtime's head applies (labels outside it are skipped: no draft can be them);
  * each target layer's features are divided by their median token RMS before `fc`; the scale
    is folded into `fc.weight` when saving, so the checkpoint takes raw features.
- Resumable and deterministic: batches and anchors at step t come from RNG seeded (seed, t), and
  `train_state.pt` holds model, optimizer, step, elapsed time, scales and the vocab subset. A run
  resumed from a checkpoint reproduces the uninterrupted run's losses.
- Precision: f32 by default; `autocast="bf16"` runs each step's forward, loss and backward under
  torch.autocast (master weights, optimizer and evaluation stay f32): ~1.3x a step on an AMX CPU.
- Validation split: whole prompts, drawn with `val_seed` (recorded in the saved config as
  `ovdflash_val_seed` and inherited by a warm start from it), not with `seed`.
- Validation: loss, per-slot top-1 accuracy (full vocabulary argmax) and a teacher-forced
  acceptance estimate tau = 1 + mean number of leading correct slots per full block, per domain
  (`evaluate(block_len=L)`, `ovdflash train --evaluate-only --eval-block-len L`: of blocks of L).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ovdflash.manifest import DRAFT_VOCAB_FILE

from .data import Sequence, load_sequences
from ..drafter import CONFIG_NAME, SHORT_BLOCKS_KEY, VAL_SEED_KEY, DFlashDrafter, DrafterConfig, build_target_layer_ids, drafter_num_params
from .prompts import root_prompt_id

STATE_NAME = "train_state.pt"
LOG_NAME = "train_log.jsonl"


@dataclass
class TrainConfig:
    target: str                      # HF model directory of the target
    data_dirs: list[str]             # directories written by ovdflash_export.training.data
    out_dir: str
    eval_dirs: list[str] = field(default_factory=list)  # held-out prompts' sequences: tau per domain
    state_dir: str | None = None     # where train_state.pt goes (None: out_dir); it is ~12x the checkpoint
    num_layers: int = 1
    block_size: int = 8
    target_layer_ids: list[int] | None = None   # None: build_target_layer_ids(L, 5)
    num_features: int = 5
    mask_token_id: int | None = None             # None: the last row of the embedding table
    anchors_per_seq: int = 48
    batch_seqs: int = 8
    max_len: int = 768
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 48
    max_steps: int | None = None     # the schedule's length in steps ...
    minutes: float | None = None     # ... or in wall-clock minutes (then steps are open-ended)
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float = 4.0
    vocab_subset: bool = True
    num_negatives: int = 1024
    feature_scaling: bool = True
    # final norm scale at init; None: 1 / median target embedding norm, so initial logits are O(1)
    # (with 1.0, SmolLM2 starts at logits of +-60 and a loss near 58 that takes ~100 steps to leave)
    final_norm_init: float | None = None
    val_fraction: float = 0.05
    val_every: int = 100
    max_val_seqs: int = 48
    # sequences whose features are new to a step (None: the whole batch is drawn at random). The rest
    # of the batch re-reads cached features of earlier sequences; on a CPU the frozen target's forward
    # costs ~6x the drafter's step, so this is what makes data reuse cheap (like stored features).
    new_per_step: int | None = None
    reload_every: int = 0            # steps between re-reading data_dirs (0: never); for data still growing
    val_anchors: int = 16
    save_every_s: float = 180.0
    feature_cache_gb: float = 4.0
    seed: int = 0
    # the seed of the validation split (which whole prompts are held back), kept apart from `seed`
    # so that a continuation with another seed validates on the same prompts. None: the split its
    # `init_from` checkpoint recorded (config key `ovdflash_val_seed`), else `seed`. A warm start
    # that validated on other prompts would score sequences its parent trained on (TRAINING.md, run 10).
    val_seed: int | None = None
    stop_after_steps: int | None = None  # end this invocation early (schedule unchanged), as a kill would
    # labels = the target's own greedy chain (see build_batch); needed for teacher-forced text data
    relabel: bool = True
    # precomputed OpenVINO target features (ovdflash_export.training.features): root with one sub-directory
    # per data directory's name; sequences found there never run the torch target
    features_root: str | None = None
    # weight of the soft-label term (the target's top-k distributions: stored with precomputed
    # features made with --topk, else computed by the torch target, `kd_topk` of them); 0: off
    kd_weight: float = 0.0
    kd_topk: int = 32
    # the fraction of training blocks cut to a random length 2..B-1 (build_batch): a drafter that
    # only ever saw full blocks drafts the first slots of a shorter block worse (TRAINING.md, run 9)
    short_blocks: float = 0.0
    # the draft vocabulary written with the checkpoint (draft_vocab.json, the drafter head's rows at
    # run time): the N ids the target's train responses use most; None: every CE id. The CE still
    # trains over the whole subset. Measured on run 4 (TRAINING.md): 3,000 of its 10,781 ids, and
    # the full 49,152, accept the same tokens; a smaller head makes every draft call cheaper.
    draft_vocab_size: int | None = None
    # the CE subset itself: the N most used ids of the train responses (recomputed when the data
    # grows), no negatives, and the draft vocabulary written is this set. Trains the head the
    # runtime applies, and the head GEMM, ~1/3 of a step's FLOPs over 12k ids, shrinks with it.
    ce_vocab_size: int | None = None
    init_from: str | None = None     # warm start: a z-lab checkpoint directory (weights only, new optimizer)
    device: str = "auto"
    threads: int | None = None
    # mixed precision for the drafter's training forward/backward ("bf16": torch.autocast; weights,
    # optimizer and evaluation stay f32). Measured only on an AMX CPU: ~1.3x a step (TRAINING.md, run 11)
    autocast: str | None = None
    # sequences per torch-target forward for features not precomputed (0: 32 on CUDA, 1 on a CPU,
    # the behaviour before batching; whether batches pay on a CPU, against their padding, is unmeasured)
    target_batch: int = 0
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------ target side
class FrozenTarget:
    """The frozen target: embedding, lm_head weight, per-sequence layer features and (with
    `predictions`) its greedy next-token prediction at every position."""

    def __init__(self, path, layer_ids, device, dtype=torch.float32, predictions: bool = False):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        model.eval().requires_grad_(False)
        self.config = model.config
        self.layer_ids = list(layer_ids)
        deepest = max(self.layer_ids)
        base = model.model
        self.predictions = predictions
        if not predictions:  # only the layers up to the deepest feature layer ever run
            base.layers = base.layers[: deepest + 1]
        self.base = base.to(device)
        self.embed = base.embed_tokens
        self.lm_head_weight = model.get_output_embeddings().weight.detach().to(device)
        self.device = device
        self._captured = {}
        for i in self.layer_ids:
            base.layers[i].register_forward_hook(self._hook(i))

    def _hook(self, i):
        def fn(module, args, output):
            self._captured[i] = output[0] if isinstance(output, tuple) else output
        return fn

    @torch.no_grad()
    def features(self, ids: torch.Tensor, topk: int = 0):
        """[S] token ids -> ([S, n*Ht] f32 decoder-layer outputs at layer_ids, concatenated;
        [S] int64 greedy prediction for position s+1, or None without `predictions`). With `topk`
        K (needs `predictions`) a third value: the K most likely next tokens after every position
        and their log-probabilities over the whole vocabulary ([S, K] int64, [S, K] f32, on the
        CPU), the soft labels that `ovdflash_export.training.features --topk` stores."""
        self._check_topk(topk)
        self._captured.clear()
        out = self.base(input_ids=ids[None].to(self.device), use_cache=False)
        return self._result(0, ids.numel(), out, topk)

    @torch.no_grad()
    def features_batch(self, seqs: list[torch.Tensor], topk: int = 0) -> list[tuple]:
        """`features` of several sequences in one right-padded forward (a GPU runs one sequence
        at a time far below its capacity). Causal attention never lets a real position see the
        padding after it, so each result equals `features` up to float rounding."""
        self._check_topk(topk)
        lengths = [int(t.numel()) for t in seqs]
        ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, t in enumerate(seqs):
            ids[r, : lengths[r]], mask[r, : lengths[r]] = t, 1
        self._captured.clear()
        out = self.base(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False)
        return [self._result(r, L, out, topk) for r, L in enumerate(lengths)]

    def _check_topk(self, topk: int) -> None:
        if topk and not self.predictions:  # refused before the forward, not after it
            raise ValueError("top-k soft labels need the whole target: FrozenTarget(predictions=True)")

    def _result(self, row: int, length: int, out, topk: int) -> tuple:
        """`features`' return value for batch row `row` (its first `length` positions) of the
        forward just run (`out`, and the layer outputs the hooks captured)."""
        feats = torch.cat([self._captured[i][row, :length] for i in self.layer_ids], dim=-1).float()
        if not self.predictions:
            return feats, None
        final = out.last_hidden_state[row, :length]  # after the final norm
        preds, top_ids, top_logp = [], [], []
        for c in final.split(256):
            logits = (c @ self.lm_head_weight.T).float()
            preds.append(logits.argmax(-1))
            if topk:
                top = torch.log_softmax(logits, -1).topk(topk, dim=-1)
                top_ids.append(top.indices)
                top_logp.append(top.values)
        pred = torch.cat(preds).cpu()
        if not topk:
            return feats, pred
        return feats, pred, (torch.cat(top_ids).cpu(), torch.cat(top_logp).cpu())


class FeatureStore:
    """Per-sequence features, computed by the target once and kept (fp16) within a memory cap.
    With `topk` K, also the target's top-K soft labels (`soft`), computed in the same forward: the
    distillation needs no precomputed features then (on a GPU the forward is cheap)."""

    def __init__(self, target: FrozenTarget, cap_gb: float, topk: int = 0):
        self.target = target
        self.topk = topk
        self.cap = int(cap_gb * 2**30)
        self.used = 0
        self.cache: dict[int, tuple] = {}
        self.last: tuple = (None, None)  # (idx, soft labels) of the latest forward, cached or not
        self.computed_tokens = 0
        self.fetched: dict[int, tuple] = {}  # prefetch results not taken by `get` yet

    def prefetch(self, items: list[tuple[int, torch.Tensor]], batch: int) -> None:
        """Compute the features of the (idx, ids) not cached yet, `batch` sequences a forward
        (FrozenTarget.features_batch); the next `get` of each takes them from here."""
        todo = [(i, t) for i, t in items if i not in self.cache and i not in self.fetched]
        for k in range(0, len(todo), batch):
            chunk = todo[k:k + batch]
            for (i, t), res in zip(chunk, self.target.features_batch([t for _, t in chunk], self.topk)):
                self.fetched[i] = (t.numel(), res)

    def get(self, idx: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        hit = self.cache.get(idx)
        if hit is not None:
            return hit[0].float(), hit[1]
        fetched = self.fetched.pop(idx, None)
        if fetched is not None and fetched[0] == ids.numel():
            res = fetched[1]
        else:
            res = self.target.features(ids, self.topk)
        if self.topk:
            feats, pred, (top_ids, top_logp) = res
            soft = (top_ids.to(torch.int32), top_logp.to(torch.float16))
        else:
            (feats, pred), soft = res, None
        self.computed_tokens += ids.numel()
        nbytes = feats.numel() * 2 + (0 if pred is None else pred.numel() * 4)
        nbytes += 0 if soft is None else soft[0].numel() * 6
        half = feats.to(torch.float16)  # cached and fresh calls give identical (f16-rounded) values
        if pred is not None:
            pred = pred.to(torch.int32)
        if self.used + nbytes <= self.cap:
            self.cache[idx] = (half, pred, soft)
            self.used += nbytes
        self.last = (idx, soft)
        return half.float(), pred

    def soft(self, idx: int, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The torch target's top-k (ids int64 [length, K], log-probs f32 [length, K]) of a sequence
        `get` just computed or kept, with `topk`; else None."""
        hit = self.cache.get(idx)
        soft = hit[2] if hit is not None else (self.last[1] if self.last[0] == idx else None)
        if soft is None or soft[0].shape[0] != length:
            return None
        return soft[0].long(), soft[1].float()


class PrecomputedStore:
    """Features and greedy predictions precomputed by the deployed OpenVINO target
    (`ovdflash_export.training.features`), looked up by (data directory, offset); a sequence that has none
    (data that grew since, or a directory never precomputed) falls back to `fallback`, the frozen
    torch target. Same interface as FeatureStore."""

    def __init__(self, feature_dirs: dict[str, str], fallback: FeatureStore):
        from .features import FeatureFile

        self.files = {Path(d).resolve().name: FeatureFile(f) for d, f in feature_dirs.items()}
        self.fallback = fallback
        self.seqs: list[Sequence] = []
        self.hits = 0

    @property
    def computed_tokens(self) -> int:
        return self.fallback.computed_tokens

    def bind(self, seqs: list[Sequence]) -> None:
        self.seqs = seqs
        for f in self.files.values():
            f.refresh()

    def _file_for(self, idx: int):
        s = self.seqs[idx] if idx < len(self.seqs) else None
        f = self.files.get(Path(s.data_dir).name) if s is not None and s.data_dir else None
        return (None, None) if f is None else (f, s.offset)

    def prefetch(self, items: list[tuple[int, torch.Tensor]], batch: int) -> None:
        """FeatureStore.prefetch for the sequences that have no precomputed features."""
        missing = []
        for i, t in items:
            f, offset = self._file_for(i)
            if f is None or f.lookup(offset, t.numel()) is None:   # as `get` decides
                missing.append((i, t))
        self.fallback.prefetch(missing, batch)

    def get(self, idx: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        f, offset = self._file_for(idx)
        hit = None if f is None else f.lookup(offset, ids.numel())
        if hit is None:
            return self.fallback.get(idx, ids)
        self.hits += 1
        feats, preds = hit
        pred = torch.from_numpy(preds.astype(np.int32)) if self.fallback.target.predictions else None
        return torch.from_numpy(np.asarray(feats, dtype=np.float32)), pred

    def soft(self, idx: int, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The target's stored top-k (ids int64 [length, K], log-probs f32 [length, K]); for a
        sequence with none stored, the fallback's (the torch target's, when it computes them) or None."""
        f, offset = self._file_for(idx)
        hit = None if f is None else f.lookup_topk(offset, length)
        if hit is None:
            return self.fallback.soft(idx, length)
        return torch.from_numpy(hit[0].astype(np.int64)), torch.from_numpy(np.asarray(hit[1], dtype=np.float32))


def feature_dirs_for(root, data_dirs) -> dict[str, str]:
    """data dir -> root/<its name> for each data dir that has precomputed features there."""
    out = {}
    for d in data_dirs:
        sub = Path(root) / Path(d).resolve().name
        if (sub / "meta.json").is_file():
            out[str(d)] = str(sub)
    return out


def precomputed_store(root, data_dirs, fallback: FeatureStore, seqs: list[Sequence]) -> PrecomputedStore:
    """A PrecomputedStore over root's features for `data_dirs`, bound to `seqs`; an error when
    root has features for none of them."""
    found = feature_dirs_for(root, data_dirs)
    if not found:
        raise ValueError(f"--features {root}: no precomputed features for any of {list(data_dirs)}")
    store = PrecomputedStore(found, fallback)
    store.bind(seqs)
    return store


# ------------------------------------------------------------------ batch building
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


# ------------------------------------------------------------------ loss
def slot_weights(B: int, gamma: float, device) -> torch.Tensor:
    k = torch.arange(1, B, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    return w / w.sum()


def drafter_logits(hidden, head_weight, vocab_ids=None):
    """hidden [..., H] -> logits over vocab_ids (or the whole vocabulary)."""
    w = head_weight if vocab_ids is None else head_weight[vocab_ids]
    # one 2-D GEMM: a 4-D, non-contiguous `hidden @ w.T` becomes a batched matmul over a broadcast
    # weight, measured 4x slower on 2 CPU cores (1.7 s vs 0.41 s for a step's 2,688 x 8,227 logits)
    return (hidden.reshape(-1, hidden.shape[-1]) @ w.T).reshape(*hidden.shape[:-1], w.shape[0])


def blocks_forward(drafter: DFlashDrafter, batch: dict) -> torch.Tensor:
    h, _ = drafter(batch["block_embeds"], batch["target_hidden"], batch["position_ids"],
                   attention_mask=batch["mask"])
    b, N, B = h.shape[0], batch["N"], batch["B"]
    return h.reshape(b, N, B, -1)[:, :, 1:]  # slots 1..B-1: [b,N,B-1,H]


def weighted_ce(h, labels, head_weight, weights, vocab_ids=None, remap=None):
    """Position-decayed CE; labels [b,N,B-1] in full-vocab ids (-100 = none)."""
    logits = drafter_logits(h, head_weight, vocab_ids).float()
    tgt = labels if remap is None else torch.where(labels >= 0, remap[labels.clamp(min=0)], labels)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100,
                         reduction="none").reshape(labels.shape)
    valid = (tgt >= 0).float()
    w = weights.view(1, 1, -1) * valid
    return (ce * w).sum() / w.sum().clamp(min=1e-8), logits


def soft_ce(logits, soft_ids, soft_logp, weights, remap=None):
    """Slot-weighted cross-entropy of the drafter's distribution (logits [b,N,B-1,V] over the
    scored ids) against the target's top-k (full-vocab ids [b,N,B-1,K], -100 = none), renormalised
    over the top-k ids that are scored. Returns (loss, number of slots that had a distribution)."""
    idx = soft_ids if remap is None else torch.where(soft_ids >= 0, remap[soft_ids.clamp(min=0)], soft_ids)
    kept = idx >= 0
    q = torch.where(kept, soft_logp.exp(), torch.zeros_like(soft_logp))
    mass = q.sum(-1, keepdim=True)
    q = q / mass.clamp(min=1e-12)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, idx.clamp(min=0))
    ce = -(q * logp).sum(-1)                                   # [b,N,B-1]
    has = (mass[..., 0] > 0).float()
    w = weights.view(1, 1, -1) * has
    return (ce * w).sum() / w.sum().clamp(min=1e-8), int(has.sum().item())


# ------------------------------------------------------------------ helpers
def mixed_precision(kind: str | None, device: torch.device):
    """The autocast context of a training step: bf16 matmuls for kind "bf16", nothing for None."""
    if kind in (None, "none", "f32"):
        return contextlib.nullcontext()
    if kind != "bf16":
        raise ValueError(f"autocast {kind!r}: choose bf16 or none")
    return torch.autocast(device.type, dtype=torch.bfloat16)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def split_train_val(seqs: list[Sequence], fraction: float, seed: int):
    """Validation = whole prompts (every mode/rep of a prompt stays on one side), a follow-up on
    its root prompt's side: it carries that prompt's reply in its context."""
    import zlib

    roots = [root_prompt_id(s.prompt_id) for s in seqs]
    val_ids = {p for p in set(roots) if (zlib.crc32(f"{seed}:{p}".encode()) % 10_000) < fraction * 10_000}
    train = [i for i, r in enumerate(roots) if r not in val_ids]
    val = [i for i, r in enumerate(roots) if r in val_ids]
    return train, val


def inherited_val_seed(init_from: str | None, seed: int, log) -> int:
    """The validation-split seed of a run that gave none: its warm start's recorded one, else `seed`."""
    if not init_from:
        return seed
    recorded = json.loads((Path(init_from) / CONFIG_NAME).read_text()).get(VAL_SEED_KEY)
    if recorded is None:
        log(f"warning: --init-from {init_from} records no validation split ({VAL_SEED_KEY}); validating with "
            f"seed {seed}, whose prompts it may have trained on (give --val-seed to choose)")
        return seed
    return int(recorded)


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


def lr_at(cfg: TrainConfig, step: int, progress: float) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    p = min(max(progress, 0.0), 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def layer_scales(store: FeatureStore, seqs, idxs, n_feat: int, hidden: int, max_len: int) -> torch.Tensor:
    """Median token RMS of each feature layer over a few sequences (skipping position 0)."""
    rms = [[] for _ in range(n_feat)]
    for i in idxs:
        f = store.get(i, torch.from_numpy(seqs[i].tokens[:max_len]))[0][1:]
        for l in range(n_feat):
            rms[l].append(f[:, l * hidden:(l + 1) * hidden].pow(2).mean(-1).sqrt())
    return torch.tensor([torch.cat(r).median().item() for r in rms])




def most_used_ids(responses, size: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The `size` token ids used most often in `responses` (arrays of ids), among `allowed` when
    given; ties go to the smaller id. Returned sorted."""
    tokens = [np.asarray(r, dtype=np.int64) for r in responses]
    counts = np.bincount(np.concatenate(tokens)) if tokens else np.zeros(0, dtype=np.int64)
    ids = np.nonzero(counts)[0]
    if allowed is not None:
        ids = np.intersect1d(ids, allowed.cpu().numpy())
    ranked = ids[np.lexsort((ids, -counts[ids]))][:size]
    return torch.from_numpy(np.sort(ranked))


def save_folded(drafter: DFlashDrafter, inv_scale: torch.Tensor | None, out_dir, dtype=torch.float32,
                draft_vocab: torch.Tensor | None = None):
    """Save a z-lab checkpoint that takes raw features: the per-layer scale is folded into fc.

    `draft_vocab` (the ids the CE was trained over) is written as draft_vocab.json."""
    import copy

    out = copy.deepcopy(drafter).to("cpu", torch.float32)
    if inv_scale is not None:
        with torch.no_grad():
            out.fc.weight.mul_(inv_scale.to("cpu")[None, :])
    out = out.to(dtype)
    tmp = Path(str(out_dir) + ".tmp")
    out.save_pretrained(tmp)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        os.replace(tmp / name, Path(out_dir) / name)
    tmp.rmdir()
    if draft_vocab is not None:
        (Path(out_dir) / DRAFT_VOCAB_FILE).write_text(json.dumps(sorted(int(i) for i in draft_vocab.tolist())))


# ------------------------------------------------------------------ validation
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


def grown_state_dict(sd: dict, have_layers: int, want_layers: int) -> dict:
    """A `have_layers` drafter's weights as a `want_layers` one that computes the same function.

    Each added layer starts as a copy of the last trained layer with its two residual writers
    (`o_proj`, `down_proj`) zeroed, so it adds nothing until training moves them, and the grown
    drafter drafts exactly what the smaller one did (a warm start loses nothing). The copy, rather
    than a random init, gives the new layer's attention and MLP inputs that already mean something.
    """
    sd = dict(sd)
    last = f"layers.{have_layers - 1}."
    for new in range(have_layers, want_layers):
        for k in [k for k in sd if k.startswith(last)]:
            name = k[len(last):]
            w = sd[k].clone()
            if name in ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight"):
                w.zero_()
            sd[f"layers.{new}.{name}"] = w
    return sd


# ------------------------------------------------------------------ main loop
def train(cfg: TrainConfig, log=print) -> Path:
    if cfg.kd_weight > 0 and cfg.kd_topk < 1:
        raise ValueError(f"kd_topk {cfg.kd_topk}: distillation needs at least the target's top-1")
    if cfg.ce_vocab_size and not cfg.vocab_subset:
        raise ValueError("ce_vocab_size needs vocab_subset: it chooses the subset's size")
    device = pick_device(cfg.device)
    target_batch = cfg.target_batch or (32 if device.type == "cuda" else 1)
    mixed_precision(cfg.autocast, device)  # an unknown kind fails here, not after the data has loaded
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state_path = Path(cfg.state_dir or out_dir) / STATE_NAME
    state_path.parent.mkdir(parents=True, exist_ok=True)
    resume = torch.load(state_path, map_location="cpu", weights_only=False) if state_path.exists() else None
    if resume is not None:
        # the run's identity (geometry, data, schedule) comes from the checkpoint
        saved = resume["train_config"]
        for k in ("num_layers", "block_size", "target_layer_ids", "num_features", "mask_token_id",
                  "anchors_per_seq", "batch_seqs", "max_len", "seed", "gamma", "vocab_subset", "feature_scaling",
                  "ce_vocab_size", "short_blocks"):
            setattr(cfg, k, saved.get(k, getattr(cfg, k)))
        cfg.val_seed = saved.get("val_seed", saved.get("seed"))

    tcfg = json.loads((Path(cfg.target) / "config.json").read_text())
    n_target = int(tcfg["num_hidden_layers"])
    if cfg.target_layer_ids is None:
        cfg.target_layer_ids = build_target_layer_ids(n_target, cfg.num_features)
    vocab = int(tcfg["vocab_size"])
    if cfg.mask_token_id is None:
        cfg.mask_token_id = vocab - 1
    if not 0 <= cfg.mask_token_id < vocab:
        raise ValueError(f"mask_token_id {cfg.mask_token_id} is outside the embedding table ({vocab} rows)")

    # distillation without stored top-k runs the whole target (its lm_head) for the soft labels
    target = FrozenTarget(cfg.target, cfg.target_layer_ids, device, predictions=cfg.relabel or cfg.kd_weight > 0)
    H = int(tcfg["hidden_size"])
    heads = int(tcfg["num_attention_heads"])
    rope_theta = tcfg.get("rope_theta") or (tcfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    dcfg = DrafterConfig(
        hidden_size=H, intermediate_size=int(tcfg["intermediate_size"]), num_hidden_layers=cfg.num_layers,
        num_attention_heads=heads, num_key_value_heads=int(tcfg.get("num_key_value_heads") or heads),
        head_dim=int(tcfg.get("head_dim") or H // heads), rms_norm_eps=float(tcfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta), max_position_embeddings=int(tcfg.get("max_position_embeddings", 4096)),
        vocab_size=vocab, block_size=cfg.block_size, target_layer_ids=list(cfg.target_layer_ids),
        mask_token_id=cfg.mask_token_id, num_target_layers=n_target)
    if cfg.short_blocks > 0:
        dcfg.extra[SHORT_BLOCKS_KEY] = cfg.short_blocks  # the exporter reads it (manifest "draft_pass")
    if cfg.val_seed is None:
        cfg.val_seed = inherited_val_seed(cfg.init_from, cfg.seed, log)
    dcfg.extra[VAL_SEED_KEY] = cfg.val_seed
    drafter = DFlashDrafter(dcfg).init_weights(cfg.seed)
    with torch.no_grad():
        init = cfg.final_norm_init
        if init is None:
            init = 1.0 / target.lm_head_weight.norm(dim=-1).median().item()
        drafter.norm.weight.fill_(init)
    drafter.to(device).train()

    # Sequences are only ever appended (to `all_seqs`, whatever directory grew), so an index names
    # the same sequence for the whole run and the feature cache stays valid across reloads. New
    # training sequences join the end of the walk order; with several sources they are dealt
    # round-robin (each shuffled), so every source is consumed at the same rate. (A resumed run
    # deals everything at once: with data that grew during the run, its walk differs from the
    # uninterrupted one.)
    all_seqs, source, loaded_counts, walk = [], [], [0] * len(cfg.data_dirs), []

    def load_data():
        new = []
        for k, d in enumerate(cfg.data_dirs):
            loaded = load_sequences(d)
            for s in loaded[loaded_counts[k]:]:
                new.append(len(all_seqs))
                all_seqs.append(s)
                source.append(k)
            loaded_counts[k] = len(loaded)
        if not all_seqs:
            raise ValueError(f"no training sequences in {cfg.data_dirs}")
        tr, va = split_train_val(all_seqs, cfg.val_fraction, cfg.val_seed)
        if not tr:
            raise ValueError("validation split took every sequence")
        is_train = set(tr)
        fresh = [i for i in new if i in is_train]
        walk.extend(interleave_sources(fresh, source, cfg.seed + len(walk)) if len(cfg.data_dirs) > 1 else fresh)
        va = [i for i in va if all_seqs[i].mode != "text"]  # validate on the target's own responses only
        return all_seqs, list(walk), va[: cfg.max_val_seqs]

    def own_responses(seqs, idxs):
        # the target's own responses define the CE subset (and the draft vocabulary): foreign text
        # brings rare ids the target seldom emits, which would only widen the drafter's head
        return (seqs[i].tokens[seqs[i].prompt_len:] for i in idxs if seqs[i].mode != "text")

    def used_vocab(seqs, idxs):
        used = np.zeros(vocab, dtype=bool)
        for response in own_responses(seqs, idxs):
            used[response] = True
        return torch.from_numpy(np.nonzero(used)[0])

    def ce_subset(seqs, idxs, keep=None):
        # it holds no parameters, only which logits are scored: a fixed-size subset is recounted
        # from the data, an open one is every used id and only grows (keeps `keep`)
        if cfg.ce_vocab_size:
            return most_used_ids(own_responses(seqs, idxs), cfg.ce_vocab_size)
        used = used_vocab(seqs, idxs)
        return used if keep is None else torch.unique(torch.cat([keep.cpu(), used]))

    def vocab_tables(ids):
        remap = torch.full((vocab,), -100, dtype=torch.long, device=device)
        remap[ids] = torch.arange(ids.numel(), device=device)
        outside = torch.ones(vocab, dtype=torch.bool)
        outside[ids.cpu()] = False
        return remap, torch.nonzero(outside)[:, 0]

    seqs, train_idx, val_idx = load_data()
    store = FeatureStore(target, cfg.feature_cache_gb, topk=cfg.kd_topk if cfg.kd_weight > 0 else 0)
    eval_seqs = [s for d in cfg.eval_dirs for s in load_sequences(d)]
    eval_store = FeatureStore(target, 0.5)
    if cfg.features_root:
        dirs = list(cfg.data_dirs) + list(cfg.eval_dirs)
        store = precomputed_store(cfg.features_root, dirs, store, seqs)
        eval_store = precomputed_store(cfg.features_root, dirs, eval_store, eval_seqs)
        log(f"precomputed features for {sorted(store.files)} (in {cfg.features_root})")

    if resume is not None:
        vocab_ids = resume["vocab_ids"]
        inv_scale = resume["inv_scale"]
    else:
        vocab_ids = None
        if cfg.vocab_subset:
            init_vocab = Path(cfg.init_from or "") / DRAFT_VOCAB_FILE
            keep = (torch.tensor(json.loads(init_vocab.read_text())) if cfg.init_from and init_vocab.is_file()
                    else None)
            vocab_ids = ce_subset(seqs, train_idx, keep)
        inv_scale = None
        if cfg.feature_scaling:
            probe = train_idx[: min(16, len(train_idx))]
            scales = layer_scales(store, seqs, probe, len(cfg.target_layer_ids), H, cfg.max_len)
            inv_scale = (1.0 / scales).repeat_interleave(H)
    feat_scale = inv_scale.to(device) if inv_scale is not None else None
    remap = None
    if vocab_ids is not None:
        vocab_ids = vocab_ids.to(device)
        remap, outside_ids = vocab_tables(vocab_ids)

    decay, no_decay = [], []
    for n, p in drafter.named_parameters():
        (no_decay if p.dim() < 2 else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    step, elapsed_before = 0, 0.0
    if resume is None and cfg.init_from:
        init = DFlashDrafter.from_pretrained(cfg.init_from)
        ic = init.config
        if (ic.block_size, list(ic.target_layer_ids), ic.mask_token_id, ic.hidden_size) != (
                cfg.block_size, list(cfg.target_layer_ids), cfg.mask_token_id, H) or ic.num_hidden_layers > cfg.num_layers:
            raise ValueError(f"--init-from {cfg.init_from}: its geometry (layers {ic.num_hidden_layers}, block "
                             f"{ic.block_size}, ids {ic.target_layer_ids}, mask {ic.mask_token_id}) differs from this run's"
                             f" (layers {cfg.num_layers}, block {cfg.block_size}, ids {list(cfg.target_layer_ids)}, "
                             f"mask {cfg.mask_token_id}); only the layer count may grow")
        sd = grown_state_dict(init.state_dict(), ic.num_hidden_layers, cfg.num_layers)
        if inv_scale is not None:  # saved checkpoints take raw features: unfold this run's scale
            sd["fc.weight"] = sd["fc.weight"] / inv_scale[None, :]
        drafter.load_state_dict(sd)
        grown = f", grown from {ic.num_hidden_layers} to {cfg.num_layers} layers" if ic.num_hidden_layers < cfg.num_layers else ""
        log(f"warm start from {cfg.init_from}{grown}")
    if resume is not None:
        drafter.load_state_dict(resume["model"])
        opt.load_state_dict(resume["optimizer"])
        step, elapsed_before = resume["step"], resume["elapsed"]
        log(f"resumed at step {step} ({elapsed_before / 60:.1f} min trained)")
    weights = slot_weights(cfg.block_size, cfg.gamma, device)
    n_train_resp = sum(len(seqs[i].tokens) - seqs[i].prompt_len for i in train_idx)
    log(f"drafter {drafter_num_params(drafter) / 1e6:.2f}M params, layers {cfg.target_layer_ids}, block "
        f"{cfg.block_size}, mask {cfg.mask_token_id}; {len(train_idx)} train seqs ({n_train_resp} response "
        f"tokens), {len(val_idx)} val seqs; vocab subset {None if vocab_ids is None else vocab_ids.numel()}; "
        f"device {device}")

    def save(final=False):
        state = {"model": drafter.state_dict(), "optimizer": opt.state_dict(), "step": step,
                 "elapsed": elapsed_before + (time.time() - t_start), "vocab_ids": None if vocab_ids is None
                 else vocab_ids.cpu(), "inv_scale": inv_scale, "train_config": asdict(cfg)}
        tmp = state_path.with_name(STATE_NAME + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, state_path)
        draft_vocab = vocab_ids
        if vocab_ids is not None and cfg.draft_vocab_size:
            draft_vocab = most_used_ids(own_responses(seqs, train_idx), cfg.draft_vocab_size, vocab_ids)
        save_folded(drafter, inv_scale, out_dir, draft_vocab=draft_vocab)

    log_f = open(out_dir / LOG_NAME, "a")
    t_start = time.time()
    last_save = time.time()
    ema = None
    acc_ema = None
    while True:
        elapsed = elapsed_before + (time.time() - t_start)
        if cfg.max_steps is not None:
            if step >= cfg.max_steps:
                break
            progress = (step - cfg.warmup_steps) / max(cfg.max_steps - cfg.warmup_steps, 1)
        elif cfg.minutes is not None:
            if elapsed >= cfg.minutes * 60:
                break
            progress = elapsed / (cfg.minutes * 60)
        else:
            raise ValueError("set max_steps or minutes")
        if cfg.stop_after_steps is not None and step >= cfg.stop_after_steps:
            break
        if cfg.reload_every and step and step % cfg.reload_every == 0:
            n_before = len(seqs)
            seqs, train_idx, val_idx = load_data()
            if isinstance(store, PrecomputedStore):
                store.bind(seqs)
            if vocab_ids is not None:
                vocab_ids = ce_subset(seqs, train_idx, vocab_ids).to(device)
                remap, outside_ids = vocab_tables(vocab_ids)
            if len(seqs) != n_before:
                log(f"reloaded data: {len(seqs)} sequences ({len(train_idx)} train), vocab subset "
                    f"{None if vocab_ids is None else vocab_ids.numel()}")
        lr = lr_at(cfg, step, progress)
        for g in opt.param_groups:
            g["lr"] = lr
        rng = np.random.default_rng([cfg.seed, step])
        idxs = pick_batch(rng, train_idx, step, cfg.batch_seqs, cfg.new_per_step)
        batch = build_batch(seqs, idxs, store, target.embed, rng, block_size=cfg.block_size,
                            n_anchors=cfg.anchors_per_seq, max_len=cfg.max_len, mask_token_id=cfg.mask_token_id,
                            feat_scale=feat_scale, device=device, soft=cfg.kd_weight > 0,
                            short_blocks=cfg.short_blocks, target_batch=target_batch)
        ids = vocab_ids
        step_remap = remap
        if vocab_ids is not None and cfg.num_negatives and not cfg.ce_vocab_size and outside_ids.numel():
            neg = outside_ids[torch.from_numpy(rng.choice(outside_ids.numel(), size=min(cfg.num_negatives,
                                                          outside_ids.numel()), replace=False))].to(device)
            ids = torch.cat([vocab_ids, neg])
        with mixed_precision(cfg.autocast, device):
            h = blocks_forward(drafter, batch)
            loss, logits = weighted_ce(h, batch["labels"], target.lm_head_weight, weights, ids, step_remap)
            hard_loss, kd_slots = loss, 0
            if batch["soft_ids"] is not None:
                kd_loss, kd_slots = soft_ce(logits, batch["soft_ids"], batch["soft_logp"], weights, step_remap)
                if kd_slots:
                    loss = (1 - cfg.kd_weight) * hard_loss + cfg.kd_weight * kd_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        with torch.no_grad():
            lab = batch["labels"] if remap is None else torch.where(
                batch["labels"] >= 0, remap[batch["labels"].clamp(min=0)], batch["labels"])
            valid = lab >= 0
            acc = ((logits.argmax(-1) == lab) & valid).sum((0, 1)).float() / valid.sum((0, 1)).clamp(min=1)
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        acc_ema = acc.cpu().numpy() if acc_ema is None else 0.95 * acc_ema + 0.05 * acc.cpu().numpy()
        rec = {"step": step, "loss": round(loss.item(), 5), "loss_ema": round(ema, 4), "lr": lr,
               **({"hard_loss": round(hard_loss.item(), 5), "kd_slots": kd_slots} if cfg.kd_weight > 0 else {}),
               "grad_norm": round(float(gnorm), 3), "acc": [round(float(a), 3) for a in acc_ema],
               "min": round((elapsed_before + time.time() - t_start) / 60, 2),
               "target_tokens": store.computed_tokens}
        if val_idx and (step % cfg.val_every == 0):
            rec.update(evaluate(drafter, seqs, val_idx, store, target, cfg, feat_scale, vocab_ids, remap,
                                weights, device))
            if eval_seqs:
                ev = evaluate(drafter, eval_seqs, list(range(len(eval_seqs))), eval_store, target, cfg, feat_scale,
                              vocab_ids, remap, weights, device, n_anchors=64)
                rec.update({k.replace("val_", "eval_"): v for k, v in ev.items()})
        log_f.write(json.dumps(rec) + "\n")
        log_f.flush()
        if step % 10 == 0 or "val_loss" in rec or step == 1:
            log(" ".join(f"{k}={v}" for k, v in rec.items()))
        if time.time() - last_save >= cfg.save_every_s:
            save()
            last_save = time.time()
    save(final=True)
    if val_idx or eval_seqs:
        final = {} if not val_idx else evaluate(drafter, seqs, val_idx, store, target, cfg, feat_scale, vocab_ids, remap, weights, device)
        final["step"] = step
        if eval_seqs:
            ev = evaluate(drafter, eval_seqs, list(range(len(eval_seqs))), eval_store, target, cfg, feat_scale,
                          vocab_ids, remap, weights, device, n_anchors=10_000)
            final.update({k.replace("val_", "eval_"): v for k, v in ev.items()})
        log_f.write(json.dumps({"final": final}) + "\n")
        log("final " + json.dumps(final))
    log_f.close()
    return out_dir


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
