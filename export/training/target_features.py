"""The frozen target's side of training: its features, greedy labels and soft labels.

Contract:
- `FrozenTarget(path, layer_ids, device, predictions=False)`: the HF target, frozen. Its embedding
  embeds the blocks, its lm_head scores them. Features (HF `hidden_states[id+1]` = output of
  decoder layer id, before the final norm) are computed one sequence at a time (`features`) or
  several in one right-padded forward (`features_batch`), running only the layers up to the deepest
  id unless `predictions` (its greedy next token, and with `topk` its top-k distribution) is asked.
- `FeatureStore(target, cap_gb, topk=0)`: features computed once and kept (fp16) within a memory
  cap, so later epochs skip the target.
- `PrecomputedStore` / `precomputed_store(root, data_dirs, fallback, seqs)`: features precomputed
  by the deployed OpenVINO target (`features.py`), looked up by (data directory name, offset); a
  sequence without them falls back to a FeatureStore. Both stores share `get`, `soft`, `prefetch`.
- `pick_device(name)`: "auto" is CUDA when there is one, else the CPU.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .data import Sequence


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


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
