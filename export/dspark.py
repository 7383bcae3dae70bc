"""The DSpark drafter (DeepSpec's ``Qwen3DSparkModel``) as a PyTorch module for the IR export.

Contract (docs/DESIGN.md, "DSpark drafters"):

* Checkpoint: DeepSpec's ``save_pretrained`` output: ``config.json`` (``architectures:
  ["Qwen3DSparkModel"]``, the target's Qwen3 geometry with the drafter's depth, top-level
  ``block_size`` (drafts per block), ``target_layer_ids``, ``mask_token_id``, ``markov_rank``,
  ``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``;
  ``DrafterConfig.dspark``) and ``model.safetensors`` with the DFlash backbone's tensors
  (``layers.N.*``, ``fc``, ``hidden_norm``, ``norm``), ``embed_tokens`` and ``lm_head`` (copies of
  the target's, frozen in training: the runtime uses the target's), the Markov head
  ``markov_head.markov_w1.weight [V,r]`` (an embedding) and ``markov_head.markov_w2.weight [V,r]``
  (a linear map r -> V), and, with the confidence head, ``confidence_head.proj.{weight [1,H(+r)],bias [1]}``.
* ``DSparkDrafter.forward`` is the DFlash backbone; its block is ``[anchor, mask*(n-1)]`` and slot i
  (0-based) predicts the token i + 1 after the anchor, so n block tokens give n drafts.
* The heads (``heads()``, numpy f32, written next to the IR as ``drafter/dspark_heads.npz``):
  ``markov_w1``, ``markov_w2`` (absent at rank 0), ``confidence_weight [H(+r)]``, ``confidence_bias
  [1]`` (absent without a confidence head). Slot i's logits are ``lm_head(h_i) + markov_w2 @
  markov_w1[prev_i]``, prev_0 the anchor and prev_i slot i-1's draft; its predicted acceptance is
  ``sigmoid(confidence_weight . [h_i; markov_w1[prev_i]] + confidence_bias)``.
* ``check_checkpoint(drafter_dir, cfg)``: the head tensors exist with the config's shapes, else a
  one-line ValueError naming the first that does not.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from ovdflash.manifest import DSPARK_HEADS_FILE

from .drafter import WEIGHTS_NAME, DFlashDrafter, DrafterConfig

MARKOV_W1, MARKOV_W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"
CONFIDENCE_W, CONFIDENCE_B = "confidence_head.proj.weight", "confidence_head.proj.bias"


class MarkovHead(nn.Module):
    """DeepSpec's vanilla Markov head: a rank-r bias on the logits from the previous token."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)


class DSparkDrafter(DFlashDrafter):
    """The DFlash backbone plus DSpark's Markov and confidence heads (applied by the runtime)."""

    def __init__(self, config: DrafterConfig):
        if config.dspark is None:
            raise ValueError("a DSpark drafter needs DrafterConfig.dspark settings")
        super().__init__(config)
        s = config.dspark
        self.markov_head = MarkovHead(config.vocab_size, s.markov_rank) if s.markov_rank else None
        self.confidence_head = ConfidenceHead(config.hidden_size + (s.markov_rank if s.confidence_with_markov else 0)) \
            if s.confidence_head else None

    def heads(self) -> dict[str, np.ndarray]:
        """The head weights the runtime applies, as f32 arrays (module contract)."""
        out = {}
        if self.markov_head is not None:
            out["markov_w1"] = self.markov_head.markov_w1.weight
            out["markov_w2"] = self.markov_head.markov_w2.weight
        if self.confidence_head is not None:
            out["confidence_weight"] = self.confidence_head.proj.weight[0]
            out["confidence_bias"] = self.confidence_head.proj.bias
        return {k: v.detach().to(torch.float32).numpy().copy() for k, v in out.items()}


def save_heads(drafter: DSparkDrafter, out_dir) -> Path:
    path = Path(out_dir) / DSPARK_HEADS_FILE
    np.savez(path, **drafter.heads())
    return path


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """The DSpark head tensors a checkpoint must hold and their shapes."""
    s, shapes = cfg.dspark, {}
    if s.markov_rank:
        shapes[MARKOV_W1] = shapes[MARKOV_W2] = (cfg.vocab_size, s.markov_rank)
    if s.confidence_head:
        shapes[CONFIDENCE_W] = (1, cfg.hidden_size + (s.markov_rank if s.confidence_with_markov else 0))
        shapes[CONFIDENCE_B] = (1,)
    return shapes


def check_checkpoint(drafter_dir, cfg: DrafterConfig) -> None:
    """Raise a one-line ValueError when a DSpark head tensor is missing or its shape disagrees with the config."""
    from safetensors import safe_open

    with safe_open(str(Path(drafter_dir) / WEIGHTS_NAME), framework="np") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    shapes = DFlashDrafter.module_state(shapes)
    s = cfg.dspark
    for name, want in expected_shapes(cfg).items():
        if name not in shapes:
            raise ValueError(f"DSpark drafter checkpoint has no {name}")
        if shapes[name] != want:
            raise ValueError(f"DSpark drafter tensor {name} has shape {list(shapes[name])}, its config (vocab_size "
                             f"{cfg.vocab_size}, markov_rank {s.markov_rank}, hidden_size {cfg.hidden_size}) "
                             f"wants {list(want)}")
    for name in ("embed_tokens.weight", "lm_head.weight"):  # copies of the target's: only their shape matters
        if name in shapes and shapes[name] != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"DSpark drafter tensor {name} has shape {list(shapes[name])}, not the target's "
                             f"[{cfg.vocab_size}, {cfg.hidden_size}]")
