"""ovdflash: lossless DFlash speculative decoding on CPUs with OpenVINO.

The runtime package. It imports openvino, numpy and HF tokenizers only, never torch.
"""

__version__ = "0.1.0"

from .manifest import DEFAULT_TARGET_RUNNER, TARGET_RUNNERS  # noqa: E402,F401  (the model-directory format)

# Numerics that make outputs of different batch shapes agree exactly (strict lossless tests).
STRICT_F32 = {
    "INFERENCE_PRECISION_HINT": "f32",
    "KV_CACHE_PRECISION": "f32",
    "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0",
}

__all__ = ["DFlashPipeline", "STRICT_F32", "TARGET_RUNNERS"]


def __getattr__(name):
    # lazy: `ovdflash export` and the CLI start without loading the runtime
    if name == "DFlashPipeline":
        from .pipeline import DFlashPipeline
        return DFlashPipeline
    raise AttributeError(f"module 'ovdflash' has no attribute {name!r}")
