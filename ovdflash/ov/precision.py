"""Numerics: the inference and KV-cache precisions both runners compile with, on every CPU.

Contract:
- `PRECISIONS` are the user's choices (`--precision`, `from_pretrained(precision=)`):
  "f32" (the default): f32 inference and an f32 KV cache on every host. Greedy DFlash equals
  greedy AR token for token, because a verify row and an AR step see the same numerics.
  "bf16": bf16 inference and a bf16 KV cache where the CPU lists BF16 (AVX-512 BF16, AMX):
  a verify of many tokens costs little more than one AR step, but K-row verifies and one-row
  steps round differently, so greedy DFlash can part from greedy AR at near-ties (agreement
  measured per model in docs/BENCHMARKS.md). On a CPU without BF16 it runs as "f32".
- `host_precisions(core)`: the inference precisions this CPU offers ("f32" always; "bf16",
  "f16" where OPTIMIZATION_CAPABILITIES lists them).
- `compile_config(manifest, overrides, precision, runner)` -> (compile options, Numerics), through
  `resolve(options, precision, runner, offered)`. Precedence: the caller's explicit
  INFERENCE_PRECISION_HINT / KV_CACHE_PRECISION (`-c`) > the caller's `precision` > the pair the
  manifest recorded at export (`ovdflash export -c`) > "f32". A precision the host does not
  offer runs as f32. The KV cache follows the effective inference precision unless given:
  the paged runner's attention accepts an f32 cache only with f32 inference and a bf16 cache
  only with bf16 inference (checked here, one line, before the plugin fails deep inside).
"""
from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("f32", "bf16")
DEFAULT_PRECISION = "f32"
_ALIASES = {"f32": "f32", "fp32": "f32", "float32": "f32", "bf16": "bf16", "bfloat16": "bf16",
            "f16": "f16", "fp16": "f16", "float16": "f16"}
_CAPABILITY = {"bf16": "BF16", "f16": "FP16"}
# paged attention on CPU: KV element types it refuses beside an inference precision
_PAGED_REFUSES = {"f32": {"bf16"}, "bf16": {"f32"}, "f16": {"f32", "bf16"}}


@dataclass(frozen=True)
class Numerics:
    requested: str   # what the caller or manifest asked for
    inference: str   # what the target computes in on this host
    kv_cache: str    # the target's KV cache element type

    def describe(self) -> str:
        note = "" if self.requested == self.inference else f" (asked {self.requested}: not offered by this CPU)"
        return f"inference {self.inference}, KV cache {self.kv_cache}{note}"


def normalize(value) -> str:
    """An element-type name as this module spells it (f32, bf16, f16, u8, i8), from OpenVINO's spellings too."""
    text = str(value).strip().lower()
    text = {"<type: 'float32'>": "f32", "<type: 'bfloat16'>": "bf16", "<type: 'float16'>": "f16",
            "<type: 'uint8_t'>": "u8", "uint8": "u8", "int8": "i8"}.get(text, text)
    return _ALIASES.get(text, text)


def parse_precision(value) -> str:
    text = normalize(value)
    if text not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {value!r}")
    return text


def host_precisions(core=None) -> tuple[str, ...]:
    """Inference precisions the CPU plugin offers here, from OPTIMIZATION_CAPABILITIES."""
    if core is None:
        import openvino as ov

        core = ov.Core()
    caps = set(core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
    return ("f32",) + tuple(p for p, cap in _CAPABILITY.items() if cap in caps)


def resolve(options: dict, precision: str | None, runner: str, offered: tuple[str, ...]) -> tuple[dict, Numerics]:
    """Compile options with INFERENCE_PRECISION_HINT and KV_CACHE_PRECISION set as a pair (module doc)."""
    config = dict(options)
    hint = config.get("INFERENCE_PRECISION_HINT")
    requested = normalize(hint) if hint is not None else parse_precision(precision or DEFAULT_PRECISION)
    if requested not in _ALIASES.values():
        raise ValueError(f"INFERENCE_PRECISION_HINT must be f32, bf16 or f16, got {hint!r}")
    inference = requested if requested in offered else "f32"
    kv = normalize(config.get("KV_CACHE_PRECISION", inference))
    if runner == "paged" and kv in _PAGED_REFUSES.get(inference, ()):
        raise ValueError(f"the paged target runner cannot keep a {kv} KV cache with {inference} inference on this CPU; "
                         f"drop KV_CACHE_PRECISION, or use --target-runner stateful")
    config["INFERENCE_PRECISION_HINT"] = inference
    config["KV_CACHE_PRECISION"] = kv
    return config, Numerics(requested, inference, kv)


def compile_config(manifest: dict, overrides: dict | None = None, precision: str | None = None,
                   runner: str = "paged", offered: tuple[str, ...] | None = None) -> tuple[dict, Numerics]:
    """The runtime's compile options for a model: the manifest's recorded options, then the
    caller's `precision` and `overrides`, CPU pinning off unless set (on a small VM shared with other jobs pinned
    threads ran slower: docs/BENCHMARKS.md, Knobs), and the precision pair (`resolve`)."""
    from ..manifest import manifest_compile_options

    config = manifest_compile_options(manifest)
    if precision is not None:  # the caller's precision outranks the pair recorded at export
        config.pop("INFERENCE_PRECISION_HINT", None)
        config.pop("KV_CACHE_PRECISION", None)
    config.update(overrides or {})
    config.setdefault("ENABLE_CPU_PINNING", False)
    return resolve(config, precision, runner, host_precisions() if offered is None else offered)
