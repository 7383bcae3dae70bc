"""The DFlash 2 drafter (z-lab's ``DFlash2DraftModel``) as a PyTorch module for the IR export.

Contract (docs/DESIGN.md, "DFlash 2 drafters"):

* Checkpoint: a DFlash drafter checkpoint (``ovdflash_export.drafter``) whose config names
  ``DFlash2DraftModel`` (``DrafterConfig.dflash2`` holds its settings), plus per layer
  ``layers.N.{attention_conv,mlp_conv}.{base_kernel [2,K,H], kernel_projection.weight [2*K*G,H]}``
  (G = H / conv_group_size) and the selector ``candidate_selector.hidden_projection.weight [r,H]``,
  ``candidate_selector.{predecessor,successor}_codebook [V,r]`` (a trailing ``.weight`` accepted).
* ``DFlash2Drafter.forward`` is the DFlash forward (block embeddings scaled by
  ``input_embedding_scale``) with each layer's attention and MLP wrapped in a grouped dynamic causal
  convolution over the block: input ``x`` becomes ``sum_o (base[o] + dyn[o]) * x[t-o]`` (zero
  before the block's first token), with a per-token, per-group kernel ``dyn`` projected from x.
* ``DFlash2Drafter.transition_scores(hidden, candidate_ids, anchor_ids)``: for draft slot p with
  top-k candidates ``c[p]``, ``T[p,i,j] = <pred(i) * proj(h_p), successor[c[p,j]]>``, where pred(i)
  is the predecessor codebook row of ``c[p-1,i]`` (of the anchor for p = 0, every row alike). The
  z-lab walk picks ``argmax_j unary[p,j] + T[p, previous choice, j]`` from the anchor on; the runtime
  does that walk (ovdflash.ov.dflash2) on these scores and the target head's top-k.
* ``check_checkpoint(drafter_dir, cfg)``: the tensors above exist with these shapes, else a
  one-line ValueError naming the first that does not.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .drafter import WEIGHTS_NAME, DFlashDrafter, DrafterConfig

# codebooks are bare tensors in z-lab checkpoints (their loader maps them onto nn.Embedding.weight)
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


class GroupedDynamicCausalConv(nn.Module):
    """z-lab's convolution: static base kernels plus per-token, per-group dynamic ones, causal in the block."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def _convolve(self, x, dynamic, base):
        """x [b,L,H]; dynamic [b,L,K,G]; base [K,H]: sum over offsets o of (base[o] + dyn[o]) * x[t-o]."""
        length = x.shape[1]
        out = torch.zeros_like(x)
        for offset in range(self.kernel_size):
            # pad then cut: a block shorter than the kernel still gets zeros before its first token
            shifted = x if offset == 0 else F.pad(x, (0, 0, offset, 0))[:, :length]
            per_token = dynamic[:, :, offset, :, None].expand(-1, -1, -1, self.group_size).flatten(2)
            out = out + base[offset] * shifted + per_token * shifted
        return out

    def prepare(self, x):
        dynamic = self.kernel_projection(x).unflatten(-1, (2, self.kernel_size, self.groups))
        return self._convolve(x, dynamic[:, :, 0], self.base_kernel[0]), dynamic[:, :, 1]

    def finish(self, x, dynamic):
        return self._convolve(x, dynamic, self.base_kernel[1])


class CandidateSelector(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        rank = cfg.dflash2.selector_rank
        self.top_k = cfg.dflash2.selector_top_k
        self.predecessor_codebook = nn.Embedding(cfg.vocab_size, rank)
        self.successor_codebook = nn.Embedding(cfg.vocab_size, rank)
        self.hidden_projection = nn.Linear(cfg.hidden_size, rank, bias=False)


class DFlash2Drafter(DFlashDrafter):
    """DFlash drafter layers with convolutions, plus the candidate selector's transition scores."""

    def __init__(self, config: DrafterConfig):
        if config.dflash2 is None:
            raise ValueError("a DFlash 2 drafter needs DrafterConfig.dflash2 settings")
        super().__init__(config)
        s = config.dflash2
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicCausalConv(config.hidden_size, s.conv_kernel_size, s.conv_group_size)
            layer.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, s.conv_kernel_size, s.conv_group_size)
        self.candidate_selector = CandidateSelector(config)

    @staticmethod
    def module_state(checkpoint: dict) -> dict:
        state = DFlashDrafter.module_state(checkpoint)
        return {f"{k}.weight" if k in CODEBOOKS else k: v for k, v in state.items()}

    def checkpoint_state(self) -> dict:
        state = super().checkpoint_state()
        return {k[: -len(".weight")] if k[: -len(".weight")] in CODEBOOKS else k: v for k, v in state.items()}

    def forward(self, block_embeds, target_hidden, position_ids, past_key_values=None, attention_mask=None):
        scaled = block_embeds * self.config.dflash2.input_embedding_scale
        return super().forward(scaled, target_hidden, position_ids, past_key_values, attention_mask)

    def transition_scores(self, hidden, candidate_ids, anchor_ids):
        """hidden [b,P,H] (draft slots, after the final norm); candidate_ids [b,P,k]; anchor_ids [b]
        -> [b,P,k,k]: row i of slot p scores each candidate after candidate i of slot p-1 (the anchor at p = 0)."""
        sel = self.candidate_selector
        projected = sel.hidden_projection(hidden)
        anchors = anchor_ids[:, None, None].expand(-1, 1, candidate_ids.shape[-1])
        predecessors = torch.cat([anchors, candidate_ids[:, :-1]], dim=1)
        weighted = sel.predecessor_codebook(predecessors) * projected[:, :, None, :]
        return weighted @ sel.successor_codebook(candidate_ids).transpose(-1, -2)


def drafter_class(cfg: DrafterConfig) -> type[DFlashDrafter]:
    """The module class that reads a checkpoint of this config's kind."""
    return DFlash2Drafter if cfg.kind == "dflash2" else DFlashDrafter


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """The DFlash 2 tensors a checkpoint must hold (module names) and their shapes."""
    s, hidden = cfg.dflash2, cfg.hidden_size
    groups = hidden // s.conv_group_size
    shapes = {f"{c}.weight": (cfg.vocab_size, s.selector_rank) for c in CODEBOOKS}
    shapes["candidate_selector.hidden_projection.weight"] = (s.selector_rank, hidden)
    for i in range(cfg.num_hidden_layers):
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"layers.{i}.{conv}.base_kernel"] = (2, s.conv_kernel_size, hidden)
            shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * s.conv_kernel_size * groups, hidden)
    return shapes


def check_checkpoint(drafter_dir, cfg: DrafterConfig) -> None:
    """Raise a one-line ValueError when a DFlash 2 tensor is missing or its shape disagrees with the config."""
    from pathlib import Path

    from safetensors import safe_open

    with safe_open(str(Path(drafter_dir) / WEIGHTS_NAME), framework="np") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    shapes = DFlash2Drafter.module_state(shapes)
    for name, want in expected_shapes(cfg).items():
        if name not in shapes:
            raise ValueError(f"DFlash 2 drafter checkpoint has no {name.removesuffix('.weight')}")
        if shapes[name] != want:
            raise ValueError(f"DFlash 2 drafter tensor {name.removesuffix('.weight')} has shape {list(shapes[name])}, "
                             f"its config (selector_rank {cfg.dflash2.selector_rank}, conv_kernel_size "
                             f"{cfg.dflash2.conv_kernel_size}, conv_group_size {cfg.dflash2.conv_group_size}) "
                             f"wants {list(want)}")
