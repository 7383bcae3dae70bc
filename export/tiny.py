"""Tiny random models for tests: built in code, no downloads, exported in seconds.

* ``make_tiny_target(arch, out_dir, vocab_size=512, seed=0, **overrides)``: a random HF
  causal LM (``arch`` in llama / qwen2 / qwen3 / qwen3_5_text; hidden 64, 4 layers by default; any config
  field can be overridden) saved with ``save_pretrained``, plus a byte-level BPE tokenizer
  trained here on a small built-in corpus, with a ChatML ``chat_template`` and eos
  ``<|im_end|>``. The tokenizer uses fewer ids than ``vocab_size`` so the top rows of the
  embedding are free (the last one is the default mask token).
* ``make_tiny_drafter(target_dir, out_dir, num_layers=1, block_size=4, ..., kind="dflash")``: a
  random z-lab format DFlash drafter matching the target's geometry. ``kind="dflash2"``: a DFlash 2
  drafter built with z-lab's own ``dflash.model.DFlash2DraftModel`` (the test-only reference package),
  every parameter random (convolution kernels, codebooks and norms too, which HF starts at constants),
  with ``TINY_DFLASH2`` settings unless ``dflash2=`` names others; saved in z-lab's checkpoint layout.
  ``kind="dspark"``: a DSpark drafter in DeepSpec's ``Qwen3DSparkModel`` layout (the config's ``block_size``
  counts the drafts, one less than ``block_size`` here, which is ovdflash's block as for the other kinds):
  the random DFlash backbone, ``embed_tokens`` and ``lm_head`` copied from the target as DeepSpec saves them,
  and random Markov and confidence heads with ``TINY_DSPARK`` settings unless ``dspark=`` names others.
"""
from __future__ import annotations

import json
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Byte-level BPE needs the 256 byte symbols plus the special tokens.
MIN_VOCAB = 256 + len(SPECIAL_TOKENS) + 1

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts several tokens and verifies them with the target model in one pass.",
    "OpenVINO compiles the model for the CPU; the drafter proposes a block of tokens.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "What is the capital of France? The capital of France is Paris.",
    "A user asks a question and the assistant answers it politely and briefly.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 3.14159 2.71828",
    "Lossless means the output equals what the target alone would produce, token for token.",
    "Hello! How are you today? I am fine, thank you. Let's write some code together.",
    "The rain in Spain stays mainly in the plain. Emoji: \U0001F600 \u00e9\u00e8\u00e0 \u4f60\u597d",
]

_ARCH_DEFAULTS = {
    # tie_word_embeddings as in the real family members we target (SmolLM2, small Qwen2.5 tie; Qwen3-8B does not)
    "llama": dict(tie_word_embeddings=True, rope_theta=100000.0),
    "qwen2": dict(tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": dict(tie_word_embeddings=False, rope_theta=1000000.0, head_dim=16),
    # Qwen3.5 hybrid: layers 0-2 Gated DeltaNet, 3 full attention (every 4th, as in Qwen3.5-9B)
    "qwen3_5_text": dict(tie_word_embeddings=False, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                          "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                                          "mrope_interleaved": True}),
}


def train_tiny_tokenizer(vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` with ChatML special tokens and < vocab_size ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB} for a byte-level tokenizer, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # leave the last rows of the embedding unused: room for a mask token, like real vocabularies
    bpe_size = max(MIN_VOCAB - 1, min(vocab_size - 8, vocab_size * 7 // 8))
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    assert tok.get_vocab_size() < vocab_size
    return tok


def save_tiny_tokenizer(out_dir, vocab_size: int):
    """Write tokenizer.json / tokenizer_config.json / chat_template.jinja; returns the HF tokenizer."""
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=train_tiny_tokenizer(vocab_size),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
    )
    hf_tok.chat_template = CHATML_TEMPLATE
    hf_tok.save_pretrained(str(out_dir))
    # transformers 5 writes the template to chat_template.jinja; keep it in tokenizer_config too
    cfg_path = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("chat_template", CHATML_TEMPLATE)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (Path(out_dir) / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    return hf_tok


def make_tiny_target(arch: str, out_dir, vocab_size: int = 512, seed: int = 0, **overrides) -> Path:
    """Build and save a random tiny HF causal LM with its tokenizer; returns out_dir."""
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3_5ForCausalLM,
                              Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM)

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "qwen3_5_text": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
    }
    if arch not in classes:
        raise ValueError(f"arch must be one of {sorted(classes)}, got {arch!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_tok = save_tiny_tokenizer(out_dir, vocab_size)
    eos = hf_tok.convert_tokens_to_ids("<|im_end|>")
    pad = hf_tok.convert_tokens_to_ids("<|endoftext|>")
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        eos_token_id=eos,
        bos_token_id=None,
        pad_token_id=pad,
        attention_dropout=0.0,
    )
    fields.update(_ARCH_DEFAULTS[arch])
    fields.update(overrides)
    config_cls, model_cls = classes[arch]
    config = config_cls(**fields)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # larger-than-default init so logits are not all near-ties (argmax tests need clear winners)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
            elif arch == "qwen3_5_text":  # HF starts A_log, dt_bias and the norms at constants: vary them
                p.copy_(p + torch.randn(p.shape, generator=gen) * 0.3)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    model.generation_config.bos_token_id = None
    model.save_pretrained(str(out_dir))
    return out_dir


# DFlash 2 settings of the tiny drafters: every optional transform active, the logits capped
# near their range so the cap changes the selector's unary scores
TINY_DFLASH2 = dict(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=4,
                    output_multiplier=0.9, final_logit_softcapping=3.0, input_embedding_scale=1.3)


# DSpark settings of the tiny drafters: both heads, the confidence head reading the Markov embedding too
TINY_DSPARK = dict(markov_rank=8, markov_head_type="vanilla", confidence_head=True, confidence_with_markov=True)


def make_tiny_drafter(target_dir, out_dir, num_layers: int = 1, block_size: int = 4, target_layer_ids=None,
                      mask_token_id=None, seed: int = 0, kind: str = "dflash", dflash2: dict | None = None,
                      dspark: dict | None = None, **overrides) -> Path:
    """Build and save a random z-lab format drafter for the target in target_dir; returns out_dir."""
    from .drafter import DFlash2Settings, DrafterConfig, DSparkSettings, build_target_layer_ids, random_drafter

    t = json.loads((Path(target_dir) / "config.json").read_text())
    n_target = int(t["num_hidden_layers"])
    heads = int(t["num_attention_heads"])
    fields = dict(
        hidden_size=int(t["hidden_size"]),
        intermediate_size=int(t["intermediate_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(t.get("num_key_value_heads") or heads),
        head_dim=int(t.get("head_dim") or int(t["hidden_size"]) // heads),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=float(t.get("rope_theta") or (t.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        max_position_embeddings=int(t.get("max_position_embeddings", 2048)),
        vocab_size=int(t["vocab_size"]),
        block_size=block_size,
        target_layer_ids=list(target_layer_ids) if target_layer_ids is not None
        else build_target_layer_ids(n_target, num_layers),
        mask_token_id=int(t["vocab_size"]) - 1 if mask_token_id is None else int(mask_token_id),
        num_target_layers=n_target,
    )
    fields.update(overrides)
    if kind == "dflash2":
        settings = DFlash2Settings(**{**TINY_DFLASH2, **(dflash2 or {})})
        return _save_reference_dflash2(DrafterConfig(**fields, kind=kind, dflash2=settings), out_dir, seed)
    if kind == "dspark":
        settings = DSparkSettings(**{**TINY_DSPARK, **(dspark or {})})
        return _save_dspark(DrafterConfig(**fields, kind=kind, dspark=settings), target_dir, out_dir, seed)
    if kind != "dflash":
        raise ValueError(f"kind must be 'dflash', 'dflash2' or 'dspark', got {kind!r}")
    cfg = DrafterConfig(**fields)
    model = random_drafter(cfg, seed=seed)
    # a random drafter with std 0.02 is nearly constant; a larger scale exercises the numerics
    model.init_weights(seed, std=0.08)
    model.save_pretrained(out_dir)
    return Path(out_dir)


def _save_reference_dflash2(cfg, out_dir, seed: int) -> Path:
    """A random DFlash2DraftModel of z-lab's package, saved as z-lab checkpoints are (bare codebooks)."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    from .dflash2 import CODEBOOKS
    from .drafter import CONFIG_NAME, WEIGHTS_NAME

    try:
        from dflash.model import DFlash2DraftModel
    except ImportError as exc:
        raise ImportError("tiny DFlash 2 drafters are built with z-lab's reference package: "
                          "pip install --no-deps dflash==0.1.0") from exc
    config = cfg.to_dict()
    reference = DFlash2DraftModel(Qwen3Config(**config)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith("norm.weight"):  # HF starts norms at one: vary them around it
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)
            elif "codebook" in name:  # transition scores comparable to the logits' spread
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
    state = {k: v for k, v in reference.state_dict().items() if "rotary" not in k}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config["torch_dtype"] = "float32"
    (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    # the codebooks under z-lab's bare names, which its from_pretrained maps onto nn.Embedding.weight
    state = {k.removesuffix(".weight") if k.removesuffix(".weight") in CODEBOOKS else k: v.contiguous()
             for k, v in state.items()}
    save_file(state, str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    return out_dir


def _save_dspark(cfg, target_dir, out_dir, seed: int) -> Path:
    """A random DSpark checkpoint as DeepSpec's save_pretrained writes it (config via DrafterConfig.to_dict)."""
    import torch
    from safetensors.torch import load_file, save_file

    from .drafter import CONFIG_NAME, WEIGHTS_NAME, random_drafter
    from .dspark import CONFIDENCE_B, CONFIDENCE_W, MARKOV_W1, MARKOV_W2

    backbone = random_drafter(cfg, seed=seed).init_weights(seed, std=0.08)
    state = {k: v.contiguous() for k, v in backbone.state_dict().items()}
    target = load_file(str(Path(target_dir) / "model.safetensors"))
    embed = target["model.embed_tokens.weight"]
    # copies: a tied target's head is its embedding, and safetensors refuses tensors sharing memory
    state["embed_tokens.weight"] = embed.to(torch.float32, copy=True).contiguous()
    state["lm_head.weight"] = target.get("lm_head.weight", embed).to(torch.float32, copy=True).contiguous()
    s, gen = cfg.dspark, torch.Generator().manual_seed(seed)
    if s.markov_rank:
        state[MARKOV_W1] = torch.randn(cfg.vocab_size, s.markov_rank, generator=gen)
        # a bias smaller than the logits' spread: it changes some greedy choices, not all
        state[MARKOV_W2] = torch.randn(cfg.vocab_size, s.markov_rank, generator=gen) * 0.05
    if s.confidence_head:
        width = cfg.hidden_size + (s.markov_rank if s.confidence_with_markov else 0)
        state[CONFIDENCE_W] = torch.randn(1, width, generator=gen)
        state[CONFIDENCE_B] = torch.randn(1, generator=gen)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_NAME).write_text(json.dumps({**cfg.to_dict(), "torch_dtype": "float32"}, indent=2) + "\n")
    save_file(state, str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    return out_dir
