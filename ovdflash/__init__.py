"""ovdflash: lossless DFlash speculative decoding on CPUs with OpenVINO.

The runtime package. It imports openvino, numpy and HF tokenizers only, never torch.
"""

__version__ = "0.1.0"

# Numerics that make outputs of different batch shapes agree exactly (strict lossless tests).
STRICT_F32 = {
    "INFERENCE_PRECISION_HINT": "f32",
    "KV_CACHE_PRECISION": "f32",
    "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0",
}

# how the target's attention and KV cache run (ov_models.compile_runners): "paged" (openvino's
# paged-attention transformation at load time: host-held block caches, rollback by past_lens;
# cheaper target calls than the stateful IR at every verify width measured, docs/BENCHMARKS.md
# session 10) or "stateful" (the IR as exported: KV in ReadValue/Assign states, SDPA, mask-based
# rollback). A model directory's manifest may set `target_runner`; a caller's choice wins over both.
TARGET_RUNNERS = ("paged", "stateful")
DEFAULT_TARGET_RUNNER = "paged"

__all__ = ["DFlashPipeline", "STRICT_F32", "TARGET_RUNNERS"]


def __getattr__(name):
    # lazy: `ovdflash export` and the CLI start without loading the runtime
    if name == "DFlashPipeline":
        from .pipeline import DFlashPipeline
        return DFlashPipeline
    raise AttributeError(f"module 'ovdflash' has no attribute {name!r}")
