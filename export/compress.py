"""Data-free weight compression of an IR (NNCF), one format per model.

Formats: ``fp32`` (as is), ``fp16`` (weights stored as f16 at save time: pass
``compress_to_fp16=True`` to ``ov.save_model``), ``int8`` (NNCF INT8_ASYM per channel),
``int4`` (NNCF INT4_SYM, group 128, ratio 1.0; a layer whose input dim is not divisible by
128 gets an adjusted smaller group, and failing that stays int8). Embedding and lm_head keep
NNCF's int8 backup in int4 mode. Compression only inserts decompression subgraphs in front of
weights, so the friendly names the layer locators point to stay valid.
"""
from __future__ import annotations

import openvino as ov

WEIGHT_FORMATS = ("fp32", "fp16", "int8", "int4")
INT4_GROUP_SIZE = 128


def compress_model(model: ov.Model, weight_format: str) -> ov.Model:
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight format must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")
    if weight_format in ("fp32", "fp16"):
        return model
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedCompressionParameters, GroupSizeFallbackMode

    if weight_format == "int8":
        return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    return nncf.compress_weights(
        model,
        mode=nncf.CompressWeightsMode.INT4_SYM,
        group_size=INT4_GROUP_SIZE,
        ratio=1.0,
        advanced_parameters=AdvancedCompressionParameters(group_size_fallback_mode=GroupSizeFallbackMode.ADJUST),
    )
