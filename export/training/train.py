"""Distill a DFlash drafter for any Hugging Face causal LM (CPU or CUDA).

Contract:
- `train(cfg: TrainConfig) -> Path` (options: `config.TrainConfig`) trains
  `ovdflash_export.drafter.DFlashDrafter` on sequences stored by `ovdflash_export.training.data`
  (token ids: chat prompt + target-regenerated response) and writes a z-lab checkpoint
  (config.json + model.safetensors, no embedding / lm_head) to `cfg.out_dir`, loadable with
  `DFlashDrafter.from_pretrained` and by `ovdflash export`.
- The target is frozen and never saved (`target_features.FrozenTarget`); `feature_cache_gb` keeps
  its features (fp16) in memory so later epochs skip the target, and `features_root` reads those
  the deployed OpenVINO target precomputed (`features.py`).
- A run is named steps: `TrainingRun` builds the drafter (`build_drafter`), loads the data
  (`TrainingData`), chooses the scored vocabulary and feature scales, makes the optimizer
  (`make_optimizer`) and starts it (warm start or resume); then `train_step` / `validate` / `save`
  until the schedule (`schedule_progress`) ends.
- Objective: per sequence, random anchors p in the response (`batch.build_batch`); block
  `[x_p, MASK*(B-1)]` at positions p..p+B-1; a block sees context features j < p and its own
  block (bidirectional); slot k labels x_{p+k}; CE weighted by exp(-(k-1)/gamma) / sum (`loss`).
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
- Two deviations that keep the saved checkpoint standard:
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

import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ovdflash.manifest import DRAFT_VOCAB_FILE

from ..drafter import (CONFIG_NAME, SHORT_BLOCKS_KEY, VAL_SEED_KEY, DFlashDrafter, DrafterConfig, build_target_layer_ids,
                       drafter_num_params)
from .batch import build_batch, interleave_sources, pick_batch, split_train_val
from .config import TrainConfig
from .data import load_sequences
from .evaluate import evaluate
from .loss import blocks_forward, mixed_precision, slot_weights, soft_ce, weighted_ce
from .target_features import FeatureStore, FrozenTarget, PrecomputedStore, pick_device, precomputed_store

STATE_NAME = "train_state.pt"
LOG_NAME = "train_log.jsonl"
# the fields that make a run what it is: a resumed run takes them from its checkpoint
RUN_IDENTITY = ("num_layers", "block_size", "target_layer_ids", "num_features", "mask_token_id", "anchors_per_seq",
                "batch_seqs", "max_len", "seed", "gamma", "vocab_subset", "feature_scaling", "ce_vocab_size",
                "short_blocks")


# ------------------------------------------------------------------ helpers
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


def schedule_progress(cfg: TrainConfig, step: int, elapsed: float) -> float | None:
    """Where `step` (after `elapsed` seconds) stands in the cosine schedule, None once the run ends."""
    if cfg.max_steps is not None:
        if step >= cfg.max_steps:
            return None
        progress = (step - cfg.warmup_steps) / max(cfg.max_steps - cfg.warmup_steps, 1)
    elif cfg.minutes is not None:
        if elapsed >= cfg.minutes * 60:
            return None
        progress = elapsed / (cfg.minutes * 60)
    else:
        raise ValueError("set max_steps or minutes")
    if cfg.stop_after_steps is not None and step >= cfg.stop_after_steps:
        return None
    return progress


# ------------------------------------------------------------------ the run's steps
def check_config(cfg: TrainConfig) -> None:
    """Refuse option combinations that cannot train, before anything is loaded or written."""
    if cfg.kd_weight > 0 and cfg.kd_topk < 1:
        raise ValueError(f"kd_topk {cfg.kd_topk}: distillation needs at least the target's top-1")
    if cfg.ce_vocab_size and not cfg.vocab_subset:
        raise ValueError("ce_vocab_size needs vocab_subset: it chooses the subset's size")


def load_resume_state(cfg: TrainConfig, state_path: Path) -> dict | None:
    """The saved state of an interrupted run at `state_path`, if any; its identity overrides `cfg`."""
    if not state_path.exists():
        return None
    resume = torch.load(state_path, map_location="cpu", weights_only=False)
    saved = resume["train_config"]
    for k in RUN_IDENTITY:
        setattr(cfg, k, saved.get(k, getattr(cfg, k)))
    cfg.val_seed = saved.get("val_seed", saved.get("seed"))
    return resume


def read_target_config(cfg: TrainConfig) -> dict:
    """The target's HF config.json; fills the target-dependent defaults of `cfg` (layer ids, mask id)."""
    tcfg = json.loads((Path(cfg.target) / "config.json").read_text())
    if cfg.target_layer_ids is None:
        cfg.target_layer_ids = build_target_layer_ids(int(tcfg["num_hidden_layers"]), cfg.num_features)
    vocab = int(tcfg["vocab_size"])
    if cfg.mask_token_id is None:
        cfg.mask_token_id = vocab - 1
    if not 0 <= cfg.mask_token_id < vocab:
        raise ValueError(f"mask_token_id {cfg.mask_token_id} is outside the embedding table ({vocab} rows)")
    return tcfg


def build_drafter(cfg: TrainConfig, tcfg: dict, target: FrozenTarget, log) -> DFlashDrafter:
    """A fresh drafter of the target's geometry, seeded with `cfg.seed`, its final norm scaled so
    the first logits are O(1); the config records short blocks and the validation split's seed."""
    H = int(tcfg["hidden_size"])
    heads = int(tcfg["num_attention_heads"])
    rope_theta = tcfg.get("rope_theta") or (tcfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    dcfg = DrafterConfig(
        hidden_size=H, intermediate_size=int(tcfg["intermediate_size"]), num_hidden_layers=cfg.num_layers,
        num_attention_heads=heads, num_key_value_heads=int(tcfg.get("num_key_value_heads") or heads),
        head_dim=int(tcfg.get("head_dim") or H // heads), rms_norm_eps=float(tcfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta), max_position_embeddings=int(tcfg.get("max_position_embeddings", 4096)),
        vocab_size=int(tcfg["vocab_size"]), block_size=cfg.block_size, target_layer_ids=list(cfg.target_layer_ids),
        mask_token_id=cfg.mask_token_id, num_target_layers=int(tcfg["num_hidden_layers"]))
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
    return drafter


def make_optimizer(drafter: DFlashDrafter, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only (norms and biases are not decayed)."""
    decay, no_decay = [], []
    for _, p in drafter.named_parameters():
        (no_decay if p.dim() < 2 else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


def warm_start(drafter: DFlashDrafter, cfg: TrainConfig, hidden: int, inv_scale: torch.Tensor | None, log) -> None:
    """Load `cfg.init_from`'s weights (grown to `cfg.num_layers`) into `drafter`; refuse another geometry."""
    init = DFlashDrafter.from_pretrained(cfg.init_from)
    ic = init.config
    if (ic.block_size, list(ic.target_layer_ids), ic.mask_token_id, ic.hidden_size) != (
            cfg.block_size, list(cfg.target_layer_ids), cfg.mask_token_id, hidden) or ic.num_hidden_layers > cfg.num_layers:
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


class TrainingData:
    """The sequences of `cfg.data_dirs` and their train / validation split, re-read by `load`.

    Sequences are only ever appended (whatever directory grew), so an index names the same
    sequence for the whole run and the feature cache stays valid across reloads. New training
    sequences join the end of the walk order; with several sources they are dealt round-robin
    (each shuffled), so every source is consumed at the same rate. (A resumed run deals
    everything at once: with data that grew during the run, its walk differs from the
    uninterrupted one.)"""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.seqs, self.source, self.walk = [], [], []
        self.loaded_counts = [0] * len(cfg.data_dirs)

    def load(self):
        """(all sequences, train indices in walk order, validation indices)."""
        cfg = self.cfg
        new = []
        for k, d in enumerate(cfg.data_dirs):
            loaded = load_sequences(d)
            for s in loaded[self.loaded_counts[k]:]:
                new.append(len(self.seqs))
                self.seqs.append(s)
                self.source.append(k)
            self.loaded_counts[k] = len(loaded)
        if not self.seqs:
            raise ValueError(f"no training sequences in {cfg.data_dirs}")
        tr, va = split_train_val(self.seqs, cfg.val_fraction, cfg.val_seed)
        if not tr:
            raise ValueError("validation split took every sequence")
        is_train = set(tr)
        fresh = [i for i in new if i in is_train]
        self.walk.extend(interleave_sources(fresh, self.source, cfg.seed + len(self.walk))
                         if len(cfg.data_dirs) > 1 else fresh)
        va = [i for i in va if self.seqs[i].mode != "text"]  # validate on the target's own responses only
        return self.seqs, list(self.walk), va[: cfg.max_val_seqs]


def own_responses(seqs, idxs):
    """The target's own responses among `idxs`: they define the CE subset and the draft vocabulary
    (foreign text brings rare ids the target seldom emits, which would only widen the head)."""
    return (seqs[i].tokens[seqs[i].prompt_len:] for i in idxs if seqs[i].mode != "text")


def ce_subset(cfg: TrainConfig, seqs, idxs, vocab: int, keep=None) -> torch.Tensor:
    """The ids the CE scores: a fixed-size subset is recounted from the data, an open one is every
    used id and only grows (keeps `keep`). It holds no parameters, only which logits are scored."""
    if cfg.ce_vocab_size:
        return most_used_ids(own_responses(seqs, idxs), cfg.ce_vocab_size)
    used = np.zeros(vocab, dtype=bool)
    for response in own_responses(seqs, idxs):
        used[response] = True
    used = torch.from_numpy(np.nonzero(used)[0])
    return used if keep is None else torch.unique(torch.cat([keep.cpu(), used]))


class ScoredVocab:
    """The CE subset (`ids`, None: the whole vocabulary), the full-vocab -> subset `remap` table
    (-100 outside) and the ids `outside` it, from which negatives are drawn."""

    def __init__(self, ids: torch.Tensor | None, vocab: int, device):
        self.vocab, self.device = vocab, device
        self.ids = self.remap = self.outside = None
        if ids is not None:
            self.update(ids)

    def update(self, ids: torch.Tensor) -> None:
        self.ids = ids.to(self.device)
        self.remap = torch.full((self.vocab,), -100, dtype=torch.long, device=self.device)
        self.remap[self.ids] = torch.arange(self.ids.numel(), device=self.device)
        outside = torch.ones(self.vocab, dtype=torch.bool)
        outside[self.ids.cpu()] = False
        self.outside = torch.nonzero(outside)[:, 0]

    @property
    def size(self) -> int | None:
        return None if self.ids is None else self.ids.numel()


class TrainingRun:
    """One training run of `cfg`, set up step by step; `run()` trains it to the schedule's end."""

    def __init__(self, cfg: TrainConfig, log=print):
        check_config(cfg)
        self.cfg, self.log = cfg, log
        self.device = device = pick_device(cfg.device)
        self.target_batch = cfg.target_batch or (32 if device.type == "cuda" else 1)
        mixed_precision(cfg.autocast, device)  # an unknown kind fails here, not after the data has loaded
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.out_dir = Path(cfg.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.state_path = Path(cfg.state_dir or self.out_dir) / STATE_NAME
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        resume = load_resume_state(cfg, self.state_path)
        tcfg = read_target_config(cfg)
        self.vocab_size, self.hidden = int(tcfg["vocab_size"]), int(tcfg["hidden_size"])
        # distillation without stored top-k runs the whole target (its lm_head) for the soft labels
        self.target = FrozenTarget(cfg.target, cfg.target_layer_ids, device,
                                   predictions=cfg.relabel or cfg.kd_weight > 0)
        self.drafter = build_drafter(cfg, tcfg, self.target, log).to(device).train()
        self.data = TrainingData(cfg)
        self.seqs, self.train_idx, self.val_idx = self.data.load()
        self.load_feature_stores()
        self.choose_vocab_and_scales(resume)
        self.opt = make_optimizer(self.drafter, cfg)
        self.step, self.elapsed_before = 0, 0.0
        if resume is None and cfg.init_from:
            warm_start(self.drafter, cfg, self.hidden, self.inv_scale, log)
        if resume is not None:
            self.drafter.load_state_dict(resume["model"])
            self.opt.load_state_dict(resume["optimizer"])
            self.step, self.elapsed_before = resume["step"], resume["elapsed"]
            log(f"resumed at step {self.step} ({self.elapsed_before / 60:.1f} min trained)")
        self.weights = slot_weights(cfg.block_size, cfg.gamma, device)
        n_train_resp = sum(len(self.seqs[i].tokens) - self.seqs[i].prompt_len for i in self.train_idx)
        log(f"drafter {drafter_num_params(self.drafter) / 1e6:.2f}M params, layers {cfg.target_layer_ids}, block "
            f"{cfg.block_size}, mask {cfg.mask_token_id}; {len(self.train_idx)} train seqs ({n_train_resp} response "
            f"tokens), {len(self.val_idx)} val seqs; vocab subset {self.vocab.size}; device {device}")

    # -------------------------------------------------------------- setup
    def load_feature_stores(self) -> None:
        """The train and held-out eval sequences' feature stores (precomputed ones where given)."""
        cfg = self.cfg
        self.store = FeatureStore(self.target, cfg.feature_cache_gb, topk=cfg.kd_topk if cfg.kd_weight > 0 else 0)
        self.eval_seqs = [s for d in cfg.eval_dirs for s in load_sequences(d)]
        self.eval_store = FeatureStore(self.target, 0.5)
        if cfg.features_root:
            dirs = list(cfg.data_dirs) + list(cfg.eval_dirs)
            self.store = precomputed_store(cfg.features_root, dirs, self.store, self.seqs)
            self.eval_store = precomputed_store(cfg.features_root, dirs, self.eval_store, self.eval_seqs)
            self.log(f"precomputed features for {sorted(self.store.files)} (in {cfg.features_root})")

    def choose_vocab_and_scales(self, resume: dict | None) -> None:
        """The CE subset and the per-layer feature scales: a resumed run's own, else from the data
        (an open subset keeps the draft vocabulary of the checkpoint it warm-starts from)."""
        cfg = self.cfg
        if resume is not None:
            vocab_ids, self.inv_scale = resume["vocab_ids"], resume["inv_scale"]
        else:
            vocab_ids = None
            if cfg.vocab_subset:
                init_vocab = Path(cfg.init_from or "") / DRAFT_VOCAB_FILE
                keep = (torch.tensor(json.loads(init_vocab.read_text())) if cfg.init_from and init_vocab.is_file()
                        else None)
                vocab_ids = ce_subset(cfg, self.seqs, self.train_idx, self.vocab_size, keep)
            self.inv_scale = None
            if cfg.feature_scaling:
                probe = self.train_idx[: min(16, len(self.train_idx))]
                scales = layer_scales(self.store, self.seqs, probe, len(cfg.target_layer_ids), self.hidden, cfg.max_len)
                self.inv_scale = (1.0 / scales).repeat_interleave(self.hidden)
        self.feat_scale = self.inv_scale.to(self.device) if self.inv_scale is not None else None
        self.vocab = ScoredVocab(vocab_ids, self.vocab_size, self.device)

    # -------------------------------------------------------------- steps
    def reload_data(self) -> None:
        """Re-read the data directories (they may have grown) and recount the CE subset."""
        n_before = len(self.seqs)
        self.seqs, self.train_idx, self.val_idx = self.data.load()
        if isinstance(self.store, PrecomputedStore):
            self.store.bind(self.seqs)
        if self.vocab.ids is not None:
            self.vocab.update(ce_subset(self.cfg, self.seqs, self.train_idx, self.vocab_size, self.vocab.ids))
        if len(self.seqs) != n_before:
            self.log(f"reloaded data: {len(self.seqs)} sequences ({len(self.train_idx)} train), vocab subset "
                     f"{self.vocab.size}")

    def scored_ids(self, rng: np.random.Generator) -> torch.Tensor | None:
        """The ids this step's CE scores: the subset, plus random negatives from outside an open one."""
        cfg, vocab = self.cfg, self.vocab
        if vocab.ids is None or not cfg.num_negatives or cfg.ce_vocab_size or not vocab.outside.numel():
            return vocab.ids
        neg = vocab.outside[torch.from_numpy(rng.choice(vocab.outside.numel(), size=min(
            cfg.num_negatives, vocab.outside.numel()), replace=False))].to(self.device)
        return torch.cat([vocab.ids, neg])

    def train_step(self, lr: float) -> dict:
        """One optimizer step at learning rate `lr`; returns its loss, hard loss, distilled slots,
        gradient norm and per-slot accuracy. Batch, anchors and negatives come from RNG (seed, step)."""
        cfg = self.cfg
        for g in self.opt.param_groups:
            g["lr"] = lr
        rng = np.random.default_rng([cfg.seed, self.step])
        idxs = pick_batch(rng, self.train_idx, self.step, cfg.batch_seqs, cfg.new_per_step)
        batch = build_batch(self.seqs, idxs, self.store, self.target.embed, rng, block_size=cfg.block_size,
                            n_anchors=cfg.anchors_per_seq, max_len=cfg.max_len, mask_token_id=cfg.mask_token_id,
                            feat_scale=self.feat_scale, device=self.device, soft=cfg.kd_weight > 0,
                            short_blocks=cfg.short_blocks, target_batch=self.target_batch)
        ids, remap = self.scored_ids(rng), self.vocab.remap
        with mixed_precision(cfg.autocast, self.device):
            h = blocks_forward(self.drafter, batch)
            loss, logits = weighted_ce(h, batch["labels"], self.target.lm_head_weight, self.weights, ids, remap)
            hard_loss, kd_slots = loss, 0
            if batch["soft_ids"] is not None:
                kd_loss, kd_slots = soft_ce(logits, batch["soft_ids"], batch["soft_logp"], self.weights, remap)
                if kd_slots:
                    loss = (1 - cfg.kd_weight) * hard_loss + cfg.kd_weight * kd_loss
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
        self.opt.step()
        self.step += 1
        with torch.no_grad():
            lab = batch["labels"] if remap is None else torch.where(
                batch["labels"] >= 0, remap[batch["labels"].clamp(min=0)], batch["labels"])
            valid = lab >= 0
            acc = ((logits.argmax(-1) == lab) & valid).sum((0, 1)).float() / valid.sum((0, 1)).clamp(min=1)
        return {"loss": loss, "hard_loss": hard_loss, "kd_slots": kd_slots, "grad_norm": gnorm, "acc": acc}

    def validate(self, eval_anchors: int) -> dict:
        """Validation on the held-back prompts (`val_*`) and, with eval data, on it (`eval_*`,
        `eval_anchors` blocks a sequence)."""
        res = {}
        if self.val_idx:
            res = evaluate(self.drafter, self.seqs, self.val_idx, self.store, self.target, self.cfg, self.feat_scale,
                           self.vocab.ids, self.vocab.remap, self.weights, self.device)
        if self.eval_seqs:
            ev = evaluate(self.drafter, self.eval_seqs, list(range(len(self.eval_seqs))), self.eval_store, self.target,
                          self.cfg, self.feat_scale, self.vocab.ids, self.vocab.remap, self.weights, self.device,
                          n_anchors=eval_anchors)
            res.update({k.replace("val_", "eval_"): v for k, v in ev.items()})
        return res

    def save(self) -> None:
        """The resumable state (atomically) and the checkpoint with its draft vocabulary."""
        cfg, vocab_ids = self.cfg, self.vocab.ids
        state = {"model": self.drafter.state_dict(), "optimizer": self.opt.state_dict(), "step": self.step,
                 "elapsed": self.elapsed(), "vocab_ids": None if vocab_ids is None else vocab_ids.cpu(),
                 "inv_scale": self.inv_scale, "train_config": asdict(cfg)}
        tmp = self.state_path.with_name(STATE_NAME + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.state_path)
        draft_vocab = vocab_ids
        if vocab_ids is not None and cfg.draft_vocab_size:
            draft_vocab = most_used_ids(own_responses(self.seqs, self.train_idx), cfg.draft_vocab_size, vocab_ids)
        save_folded(self.drafter, self.inv_scale, self.out_dir, draft_vocab=draft_vocab)

    def elapsed(self) -> float:
        """Seconds trained, earlier invocations included."""
        return self.elapsed_before + (time.time() - self.t_start)

    # -------------------------------------------------------------- the loop
    def run(self) -> Path:
        cfg, log = self.cfg, self.log
        log_f = open(self.out_dir / LOG_NAME, "a")
        self.t_start = last_save = time.time()
        ema = acc_ema = None
        while (progress := schedule_progress(cfg, self.step, self.elapsed())) is not None:
            if cfg.reload_every and self.step and self.step % cfg.reload_every == 0:
                self.reload_data()
            lr = lr_at(cfg, self.step, progress)
            out = self.train_step(lr)
            loss, acc = out["loss"].item(), out["acc"].cpu().numpy()
            ema = loss if ema is None else 0.95 * ema + 0.05 * loss
            acc_ema = acc if acc_ema is None else 0.95 * acc_ema + 0.05 * acc
            rec = {"step": self.step, "loss": round(loss, 5), "loss_ema": round(ema, 4), "lr": lr,
                   **({"hard_loss": round(out["hard_loss"].item(), 5), "kd_slots": out["kd_slots"]}
                      if cfg.kd_weight > 0 else {}),
                   "grad_norm": round(float(out["grad_norm"]), 3), "acc": [round(float(a), 3) for a in acc_ema],
                   "min": round(self.elapsed() / 60, 2), "target_tokens": self.store.computed_tokens}
            if self.val_idx and (self.step % cfg.val_every == 0):
                rec.update(self.validate(eval_anchors=64))
            log_f.write(json.dumps(rec) + "\n")
            log_f.flush()
            if self.step % 10 == 0 or "val_loss" in rec or self.step == 1:
                log(" ".join(f"{k}={v}" for k, v in rec.items()))
            if time.time() - last_save >= cfg.save_every_s:
                self.save()
                last_save = time.time()
        self.save()
        if self.val_idx or self.eval_seqs:
            final = self.validate(eval_anchors=10_000)
            final = {k: v for k, v in final.items() if not k.startswith("eval_")} | {"step": self.step} | {
                k: v for k, v in final.items() if k.startswith("eval_")}
            log_f.write(json.dumps({"final": final}) + "\n")
            log("final " + json.dumps(final))
        log_f.close()
        return self.out_dir


def train(cfg: TrainConfig, log=print) -> Path:
    """Train a drafter as `cfg` says (module docstring); returns the checkpoint directory."""
    return TrainingRun(cfg, log).run()
