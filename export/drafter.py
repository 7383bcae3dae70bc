"""The DFlash drafter as a PyTorch module, in the z-lab checkpoint format.

Contract (docs/DESIGN.md; the DFlash paper, arXiv 2602.06036, and z-lab's checkpoint format):

* Checkpoint directory: ``config.json`` (``architectures: ["DFlashDraftModel"]``,
  ``model_type: "qwen3"``, Qwen3 geometry, top-level ``block_size`` and
  ``num_target_layers``, ``dflash_config.{target_layer_ids, mask_token_id}``) and
  ``model.safetensors`` with ``layers.N.*``, ``fc.weight``, ``hidden_norm.weight``,
  ``norm.weight``. No embedding, no lm_head: both come from the target.
* The kind (``DrafterConfig.kind``, the manifest's ``drafter.kind``): "dflash" for
  ``DFlashDraftModel``; "dflash2" for ``DFlash2DraftModel`` (named by ``architectures``, or by its
  ``dflash_config`` fields when it names none), whose settings are ``DrafterConfig.dflash2``
  (``DFlash2Settings``) and whose module is ``ovdflash_export.dflash2``; "dspark" for DeepSpec's
  ``Qwen3DSparkModel`` (by ``architectures``, else by its ``markov_rank`` field), whose settings are
  ``DrafterConfig.dspark`` (``DSparkSettings``) and whose module is ``ovdflash_export.dspark``. Its
  ``block_size`` counts the drafts (slot i predicts the token after it); ``DrafterConfig.block_size``
  is ovdflash's block, the anchor plus the drafts: one more. A DFlash 2 or DSpark config that lacks a
  setting or has one out of range is a one-line ValueError.
* ``DFlashDrafter.forward(block_embeds, target_hidden, position_ids, past_key_values,
  attention_mask)``: the target features of C context tokens are projected
  (``c = hidden_norm(fc(target_hidden))``); in every layer the keys/values are
  ``[past; k/v_proj(c); k/v_proj(x)]`` with ``k_norm`` and RoPE applied to all new keys,
  queries come from the Q block tokens only, attention is non-causal (an explicit boolean
  mask may restrict it, as training does). Returns the block's hidden states after the
  final norm and, per layer, the past K/V with the C context entries appended (the block's
  own K/V are never kept).

The module is also what ``drafter_export`` converts to OpenVINO IR and what the trainer
optimises, so it avoids anything TorchScript tracing cannot follow.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# config.json key (kept in DrafterConfig.extra): the fraction of training blocks cut short
# (`ovdflash train --short-blocks`); the exporter then lets the runtime draft exact-length blocks
SHORT_BLOCKS_KEY = "ovdflash_short_blocks"
# config.json key (kept in DrafterConfig.extra): the seed of the validation split its training
# held back (train.py); a warm start from the checkpoint validates on the same prompts
VAL_SEED_KEY = "ovdflash_val_seed"


# architectures[0] of a z-lab config -> the drafter kind recorded in the manifest
DRAFTER_KINDS = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2", "Qwen3DSparkModel": "dspark"}
# dflash_config fields only a DFlash 2 drafter has: they name the kind when `architectures` is absent
DFLASH2_REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass
class DFlash2Settings:
    """A DFlash 2 drafter's extra settings (z-lab ``dflash_config``): the grouped dynamic causal
    convolutions around each layer's attention and MLP, and the candidate selector."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    output_multiplier: float = 1.0  # scales the target head's logits before the top-k
    final_logit_softcapping: float | None = None  # tanh cap on those logits (None or <= 0: none)
    input_embedding_scale: float = 1.0  # scales the block's embeddings

    @classmethod
    def from_dict(cls, dflash: dict, top: dict, hidden_size: int, vocab_size: int) -> "DFlash2Settings":
        """Read from dflash_config (else the top level, as z-lab's `_draft_value` does); check ranges."""
        def value(name, default=None):
            return dflash.get(name, top.get(name, default))

        missing = [name for name in DFLASH2_REQUIRED if value(name) is None]
        if missing:
            raise ValueError(f"DFlash 2 drafter config lacks dflash_config.{missing[0]}")
        softcap = value("final_logit_softcapping")
        settings = cls(int(value("conv_kernel_size")), int(value("conv_group_size")), int(value("selector_rank")),
                       int(value("selector_top_k")), float(value("output_multiplier", 1.0)),
                       None if softcap is None else float(softcap), float(value("input_embedding_scale", 1.0)))
        for name in DFLASH2_REQUIRED:
            if getattr(settings, name) < 1:
                raise ValueError(f"DFlash 2 dflash_config.{name} must be >= 1, got {getattr(settings, name)}")
        if hidden_size % settings.conv_group_size:
            raise ValueError(f"DFlash 2 conv_group_size {settings.conv_group_size} does not divide "
                             f"hidden_size {hidden_size}")
        if settings.selector_top_k > vocab_size:
            raise ValueError(f"DFlash 2 selector_top_k {settings.selector_top_k} exceeds vocab_size {vocab_size}")
        return settings

    def to_dict(self) -> dict:
        d = {name: getattr(self, name) for name in DFLASH2_REQUIRED}
        d.update(output_multiplier=self.output_multiplier, input_embedding_scale=self.input_embedding_scale)
        if self.final_logit_softcapping is not None:
            d["final_logit_softcapping"] = self.final_logit_softcapping
        return d


# DeepSpec's Markov head types; ovdflash runs the low-rank "vanilla" one (the published checkpoints')
DSPARK_MARKOV_TYPES = ("vanilla",)


@dataclass
class DSparkSettings:
    """A DSpark drafter's heads (DeepSpec ``Qwen3DSparkModel``'s top-level config fields): the Markov
    head's rank (0: none) and type, and whether it has a confidence head, fed the Markov embedding too."""

    markov_rank: int
    markov_head_type: str | None = None
    confidence_head: bool = False
    confidence_with_markov: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> "DSparkSettings":
        if "markov_rank" not in d:
            raise ValueError("DSpark drafter config lacks markov_rank")
        rank = int(d["markov_rank"])
        if rank < 0:
            raise ValueError(f"DSpark markov_rank must be >= 0, got {rank}")
        head_type = d.get("markov_head_type")
        if rank and head_type is None:
            raise ValueError("DSpark drafter config lacks markov_head_type (markov_rank > 0)")
        if rank and str(head_type).lower() not in DSPARK_MARKOV_TYPES:
            raise ValueError(f"DSpark markov_head_type {head_type!r} is not supported (only "
                             f"{', '.join(map(repr, DSPARK_MARKOV_TYPES))})")
        confidence = bool(d.get("enable_confidence_head", False))
        with_markov = confidence and bool(d.get("confidence_head_with_markov", False))
        if with_markov and not rank:
            raise ValueError("DSpark confidence_head_with_markov needs a Markov head (markov_rank > 0)")
        return cls(rank, str(head_type).lower() if rank else None, confidence, with_markov)

    def to_dict(self) -> dict:
        d = {"markov_rank": self.markov_rank, "enable_confidence_head": self.confidence_head}
        if self.markov_rank:
            d["markov_head_type"] = self.markov_head_type
        if self.confidence_head:
            d["confidence_head_with_markov"] = self.confidence_with_markov
        return d


def drafter_kind(d: dict) -> str:
    """The kind of a drafter config dict: by `architectures`, else by its DFlash 2 or DSpark fields."""
    archs = d.get("architectures") or []
    if archs:
        if archs[0] not in DRAFTER_KINDS:
            raise ValueError(f"not a DFlash drafter config: architectures={archs}")
        return DRAFTER_KINDS[archs[0]]
    fields = {**d, **(d.get("dflash_config") or {})}
    if "markov_rank" in fields:
        return "dspark"
    return "dflash2" if any(name in fields for name in DFLASH2_REQUIRED) else "dflash"


def build_target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """z-lab's default feature layers: n points spread over [1, L-3] (one feature: L // 2)."""
    if n < 1:
        raise ValueError(f"need at least one target layer, got n={n}")
    if n == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (n - 1)) for i in range(n)]


@dataclass
class DrafterConfig:
    """Geometry and DFlash settings of a drafter (the z-lab config.json, flattened)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_target_layers: int
    target_hidden_size: int | None = None  # None: equal to hidden_size (all z-lab drafters)
    attention_bias: bool = False
    kind: str = "dflash"  # a DRAFTER_KINDS value
    dflash2: DFlash2Settings | None = None  # set exactly when kind == "dflash2"
    dspark: DSparkSettings | None = None  # set exactly when kind == "dspark"
    extra: dict = field(default_factory=dict, repr=False)  # unknown z-lab keys, kept on save

    def __post_init__(self):
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def fc_in_features(self) -> int:
        return self.num_features * self.target_hidden_size

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        """Read a z-lab drafter config.json dict. Rejects variants this module does not implement."""
        kind = drafter_kind(d)
        dflash = d.get("dflash_config") or {}
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"drafter rope type {rope_type!r} is not supported (only default RoPE)")
        if d.get("layer_types") and any(t != "full_attention" for t in d["layer_types"]):
            raise ValueError("sliding-window drafter layers are not supported")
        if dflash.get("causal") or d.get("is_causal"):
            raise ValueError("causal DFlash drafters are not supported")
        rope_theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        n_layers = int(d["num_hidden_layers"])
        num_target_layers = int(d.get("num_target_layers", 0))
        ids = dflash.get("target_layer_ids", d.get("target_layer_ids"))
        if ids is None:
            ids = build_target_layer_ids(num_target_layers, n_layers)
        mask = dflash.get("mask_token_id", d.get("mask_token_id"))
        if mask is None:
            raise ValueError("drafter config has no dflash_config.mask_token_id")
        known = {
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
            "vocab_size", "block_size", "num_target_layers", "target_hidden_size", "attention_bias",
            "dflash_config", "architectures", "model_type", "rope_parameters", "rope_scaling",
        }
        heads = int(d["num_attention_heads"])
        dflash2 = None
        if kind == "dflash2":
            dflash2 = DFlash2Settings.from_dict(dflash, d, int(d["hidden_size"]), int(d["vocab_size"]))
            known |= set(DFLASH2_REQUIRED) | {"output_multiplier", "final_logit_softcapping", "input_embedding_scale"}
        dspark = None
        block_size = int(dflash.get("block_size", d.get("block_size", 16)))
        if kind == "dspark":
            dspark = DSparkSettings.from_dict(d)
            known |= {"markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                      "target_layer_ids", "mask_token_id"}
            block_size += 1  # DSpark's block counts the drafts; ovdflash's adds the anchor
        return cls(
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            vocab_size=int(d["vocab_size"]),
            block_size=block_size,
            target_layer_ids=list(ids),
            mask_token_id=int(mask),
            num_target_layers=num_target_layers,
            target_hidden_size=d.get("target_hidden_size"),
            attention_bias=bool(d.get("attention_bias", False)),
            kind=kind,
            dflash2=dflash2,
            dspark=dspark,
            extra={k: v for k, v in d.items() if k not in known},
        )

    def to_dict(self) -> dict:
        """The z-lab config.json dict (loadable by the dflash reference and optimum-intel)."""
        d = dict(self.extra)
        d.update(
            architectures=[next(arch for arch, kind in DRAFTER_KINDS.items() if kind == self.kind)],
            model_type="qwen3",
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            max_position_embeddings=self.max_position_embeddings,
            vocab_size=self.vocab_size,
            attention_bias=self.attention_bias,
            attention_dropout=0.0,
            tie_word_embeddings=False,
            use_sliding_window=False,
            block_size=self.block_size,
            num_target_layers=self.num_target_layers,
            dflash_config={"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
                           **(self.dflash2.to_dict() if self.dflash2 is not None else {})},
        )
        if self.target_hidden_size != self.hidden_size:
            d["target_hidden_size"] = self.target_hidden_size
        if self.dspark is not None:  # DeepSpec's layout: top-level fields, a block of drafts
            del d["dflash_config"]
            d.update(self.dspark.to_dict(), block_size=self.block_size - 1, mask_token_id=self.mask_token_id,
                     target_layer_ids=list(self.target_layer_ids))
        return d


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in f32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x, cos, sin):
    """x [b, heads, L, hd]; cos/sin [b, L, hd]."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.num_heads, self.num_kv_heads = hd, nh, nkv
        self.scaling = hd ** -0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, nh * hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, nkv * hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, nkv * hd, bias=bias)
        self.o_proj = nn.Linear(nh * hd, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def _kv(self, x, cos, sin):
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return _rope(k, cos, sin), v

    def forward(self, x, ctx, cos_ctx, sin_ctx, cos_blk, sin_blk, past, mask):
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        q = _rope(q, cos_blk, sin_blk)
        k_ctx, v_ctx = self._kv(ctx, cos_ctx, sin_ctx)
        k_blk, v_blk = self._kv(x, cos_blk, sin_blk)
        if past is not None:
            k_ctx = torch.cat([past[0], k_ctx], dim=2)
            v_ctx = torch.cat([past[1], v_ctx], dim=2)
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            # GQA without copying K/V: the `groups` query heads that share a kv head (the HF
            # layout: head h uses kv head h // groups) become extra query rows of that kv head,
            # [b, nkv, groups*Q, hd]; the mask's query rows repeat with them. A broadcast K/V
            # copy of the whole context each draft call was the drafter IR's largest attention cost.
            q = q.reshape(b, self.num_kv_heads, groups * q_len, self.head_dim)
            if mask is not None and mask.shape[-2] > 1:
                mask = mask.repeat(1, 1, groups, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
        out = out.reshape(b, self.num_heads, q_len, self.head_dim)
        out = self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))
        return out, (k_ctx, v_ctx)


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = DrafterMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # DFlash 2 (ovdflash_export.dflash2) sets these: a causal convolution over the block around
        # each sub-layer, with a per-token kernel for its input (prepare) and its output (finish)
        self.attention_conv = None
        self.mlp_conv = None

    def forward(self, x, ctx, rope, past, mask):
        # the context c is not normalised by input_layernorm: only the block tokens are
        h = self.input_layernorm(x)
        if self.attention_conv is not None:
            h, kernel = self.attention_conv.prepare(h)
        attn, present = self.self_attn(h, ctx, *rope, past, mask)
        if self.attention_conv is not None:
            attn = self.attention_conv.finish(attn, kernel)
        x = x + attn
        h = self.post_attention_layernorm(x)
        if self.mlp_conv is not None:
            h, kernel = self.mlp_conv.prepare(h)
        h = self.mlp(h)
        if self.mlp_conv is not None:
            h = self.mlp_conv.finish(h, kernel)
        return x + h, present


class DFlashDrafter(nn.Module):
    """Block-diffusion drafter: Qwen3 layers whose K/V also carry the projected target features."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([DrafterLayer(config) for _ in range(config.num_hidden_layers)])
        self.fc = nn.Linear(config.fc_in_features, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        hd = config.head_dim
        # HF's default RoPE frequencies, computed the same way so f32 results match bit for bit
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    # -- weights -----------------------------------------------------------------------
    def init_weights(self, seed: int = 0, std: float = 0.02):
        """Random init (normal std for linears, ones for norms), deterministic given the seed."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        return self

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype = torch.float32) -> "DFlashDrafter":
        from safetensors.torch import load_file

        path = Path(path)
        cfg = DrafterConfig.from_dict(json.loads((path / CONFIG_NAME).read_text()))
        model = cls(cfg)
        state = cls.module_state(load_file(str(path / WEIGHTS_NAME)))
        missing, unexpected = model.load_state_dict(state, strict=False)
        unexpected = [k for k in unexpected if not k.startswith(("embed_tokens", "lm_head"))]
        if missing or unexpected:
            raise ValueError(f"drafter weights do not match its config: missing={missing} unexpected={unexpected}")
        return model.to(dtype).eval()

    @staticmethod
    def module_state(checkpoint: dict) -> dict:
        """Checkpoint tensors under this module's parameter names."""
        # tolerate a "model." prefix (vLLM-style re-saves)
        return {k[len("model."):] if k.startswith("model.") else k: v for k, v in checkpoint.items()}

    def checkpoint_state(self) -> dict:
        """This module's tensors under the checkpoint's names (the inverse of `module_state`)."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()}

    def save_pretrained(self, path) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        cfg = self.config.to_dict()
        cfg["torch_dtype"] = str(next(self.parameters()).dtype).replace("torch.", "")
        (path / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
        state = self.checkpoint_state()
        save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt"})

    # -- forward -----------------------------------------------------------------------
    def rope_tables(self, position_ids):
        """cos/sin [b, L, head_dim] for integer positions [b, L]."""
        freqs = position_ids[..., None].to(torch.float32) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, block_embeds, target_hidden, position_ids, past_key_values=None, attention_mask=None):
        """Run one drafting step (or a training forward over many blocks).

        block_embeds [b,Q,H]; target_hidden [b,C,n*Ht]; position_ids [b,C+Q] (context then
        block); past_key_values: per layer (K, V) [b,kv,P,hd] with RoPE applied, or None;
        attention_mask: bool [b,1,Q,P+C+Q] (True = may attend) or None (all visible).
        Returns (hidden [b,Q,H] after the final norm, per-layer (K, V) of past + context).
        """
        ctx_len = target_hidden.shape[1]
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rope_tables(position_ids)
        rope = (cos[:, :ctx_len], sin[:, :ctx_len], cos[:, ctx_len:], sin[:, ctx_len:])
        h = block_embeds
        presents = []
        for i, layer in enumerate(self.layers):
            past = past_key_values[i] if past_key_values is not None else None
            h, present = layer(h, ctx, rope, past, attention_mask)
            presents.append(present)
        return self.norm(h), presents


def random_drafter(config: DrafterConfig, seed: int = 0) -> DFlashDrafter:
    """A randomly initialised drafter (tests, benchmarks, the start of training)."""
    return DFlashDrafter(config).init_weights(seed).eval()


def drafter_num_params(model: DFlashDrafter) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "DrafterConfig", "DFlash2Settings", "DSparkSettings", "DFlashDrafter", "DRAFTER_KINDS", "drafter_kind", "build_target_layer_ids",
    "random_drafter", "drafter_num_params", "CONFIG_NAME", "WEIGHTS_NAME",
]
