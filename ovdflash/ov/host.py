"""This host's facts: CPU model, ISA flags, cores, memory, package versions, and a model's compile precisions.

Contract: `collect(model_dir=None, precision=None, target_runner=None) -> dict` gathers them (from
/proc/cpuinfo, /proc/meminfo, the installed packages and OpenVINO's CPU plugin); `render(facts)`
formats them for `ovdflash env`; `built_default_model_dir()` is the embedded model's directory when
it was exported already. Every benchmark JSON carries `collect()` as its `host`.
"""
from __future__ import annotations

import json
import os
import platform
from importlib import metadata
from pathlib import Path

from ..manifest import DRAFT_VOCAB, load_manifest, parse_target_runner
from .precision import compile_config, host_precisions

ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_fp16")


PACKAGES = ("ovdflash", "openvino", "openvino-genai", "openvino-tokenizers", "numpy", "tokenizers")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpuinfo_values(text: str, key: str) -> list[str]:
    """Every value of `key: value` lines in /proc/cpuinfo text, in order (one per logical CPU)."""
    out = []
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == key:
            out.append(value.strip())
    return out


def isa_flags(cpuinfo: str) -> dict[str, bool]:
    """Each of ISA_FLAGS: listed in the first CPU's `flags` line."""
    flags = _cpuinfo_values(cpuinfo, "flags")
    listed = set(flags[0].split()) if flags else set()
    return {flag: flag in listed for flag in ISA_FLAGS}


def cpu_facts(cpuinfo: str) -> dict:
    import openvino as ov

    core = ov.Core()
    models = _cpuinfo_values(cpuinfo, "model name")
    return {"model": models[0] if models else platform.processor() or None,
            "openvino_device_name": core.get_property("CPU", "FULL_DEVICE_NAME"),
            "optimization_capabilities": list(core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")),
            "inference_precisions": list(host_precisions(core)),
            "isa": isa_flags(cpuinfo)}


def core_facts(cpuinfo: str) -> dict:
    pairs = set(zip(_cpuinfo_values(cpuinfo, "physical id"), _cpuinfo_values(cpuinfo, "core id")))
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return {"logical_cpus": os.cpu_count(), "usable_cpus": len(affinity) if affinity is not None else None,
            "physical_cores": len(pairs) or None}


def memory_facts() -> dict:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        text = ""
    kib = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name in ("MemTotal", "MemAvailable") and value.split():
            kib[name] = int(value.split()[0])
    return {"total_mib": kib["MemTotal"] // 1024 if "MemTotal" in kib else None,
            "available_mib": kib["MemAvailable"] // 1024 if "MemAvailable" in kib else None}


def package_versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def model_facts(model_dir: str | Path, precision: str | None = None, target_runner: str | None = None) -> dict:
    """What `DFlashPipeline.from_pretrained(model_dir, precision=, target_runner=)` would compile with."""
    model_dir = Path(model_dir)
    manifest = load_manifest(model_dir)
    runner = parse_target_runner(target_runner or manifest["target_runner"])
    config, numerics = compile_config(manifest, {}, precision, runner)
    return {"model_dir": str(model_dir), "target_runner": runner,
            "requested_precision": numerics.requested, "inference_precision": numerics.inference,
            "kv_cache_precision": numerics.kv_cache, "compile_config": config,
            "block_size": manifest["block_size"], "default_block_size": manifest["default_block_size"],
            "draft_vocab": (model_dir / DRAFT_VOCAB).is_file()}


def collect(model_dir: str | Path | None = None, precision: str | None = None,
            target_runner: str | None = None) -> dict:
    cpuinfo = _cpuinfo()
    facts = {"cpu": cpu_facts(cpuinfo), "cores": core_facts(cpuinfo), "memory": memory_facts(),
             "python": platform.python_version(), "platform": platform.platform(),
             "packages": package_versions()}
    if model_dir is not None:
        facts["model"] = model_facts(model_dir, precision, target_runner)
    return facts


def built_default_model_dir() -> Path | None:
    """The embedded default model's directory when it is already exported, else None (never builds it)."""
    try:
        from ovdflash_models.default import default_model_dir
    except ImportError:
        return None
    path = default_model_dir()
    return path if (path / "manifest.json").is_file() else None


def render(facts: dict) -> str:
    """`section:` headings, then `  key: value` lines (nested objects as compact JSON)."""
    lines = []
    for section, value in facts.items():
        if not isinstance(value, dict):
            lines.append(f"{section}: {value}")
            continue
        lines.append(f"{section}:")
        for key, item in value.items():
            text = json.dumps(item) if isinstance(item, (dict, list)) else item
            lines.append(f"  {key}: {text}")
    return "\n".join(lines)

