"""A target and DFlash drafter exported by optimum-intel -> one ovdflash model directory.

Contract:
- Input: the two directories openvino.genai's DFlash pipeline reads. The target is what
  `optimum-cli export openvino --task text-generation-with-past` writes: a stateful
  `openvino_model.xml|bin`, `config.json`, `generation_config.json` and the HF tokenizer files,
  perhaps `openvino_(de)tokenizer.xml` too. The drafter is what optimum-intel's DFlash export
  writes: `openvino_model.xml|bin` with rt_info `dflash_mode`, `dflash/mask_token_id` and
  `dflash/target_layer_ids`, and the drafter's z-lab `config.json`.
- `is_openvino_export(path)`: a directory with `openvino_model.xml` and no safetensors weights;
  `openvino_pair(target, drafter)`: both are (one line when only one is).
- `validate_openvino_pair(target, drafter, block_size) -> PairInfo`: the same pair checks as the
  export of checkpoints, made on the configs and the IR shapes.
- `import_openvino_pair(target, drafter, out_dir, ...)` writes the directory `export_pair` writes
  (docs/DESIGN.md). The weights stay as they were exported: the manifest's `weight_format` is read
  from the IR. The target gets the layer locators optimum writes only for Qwen3 (llama and qwen2
  are located as in our own export). Both IRs lose optimum's `KV_CACHE_PRECISION` runtime hint, and
  the drafter gets `dflash/block_size`. The block size is `block_size`, else the drafter config's.
- Refused in one line: a Qwen3.5 hybrid target, whose linear-attention state optimum keeps inside
  the IR (ovdflash's hybrid runner holds it on the host: export the HF checkpoint instead); a
  drafter IR without `dflash_mode`; rt_info that disagrees with the drafter's config.json; weight
  format options (the IRs keep the weights they were exported with).
"""
from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from .errors import ExportError, PairMismatchError
from .model_dir import (PairInfo, _eos_bos, _source_eos_ids, check_compile_options, check_default_block_size,
                        copy_tokenizer, move_into_place, pair_manifest, source_record, write_ov_tokenizer)
from .target_config import HYBRID_ARCHS, SUPPORTED_ARCHS, load_target_config

IR_NAME = "openvino_model.xml"
OV_TOKENIZER_FILES = ("openvino_tokenizer.xml", "openvino_tokenizer.bin",
                      "openvino_detokenizer.xml", "openvino_detokenizer.bin")
TARGET_CONFIG_FILES = ("config.json", "generation_config.json")
MIN_WEIGHT_ELEMENTS = 1024  # smaller constants are shapes, scales and indices, not weights


def openvino_pair(target: Path, drafter: Path) -> bool:
    """Whether both are optimum-intel IR directories; one line when only one of them is."""
    kinds = is_openvino_export(target), is_openvino_export(drafter)
    if kinds[0] != kinds[1]:
        ir, other = ("target", "drafter") if kinds[0] else ("drafter", "target")
        raise ExportError(f"the {ir} is an OpenVINO IR directory but the {other} is not: pass both as "
                          "checkpoints, or both as optimum-intel exports")
    return kinds[0]


def is_openvino_export(path) -> bool:
    """A directory holding an OpenVINO IR (as optimum-intel writes it) rather than HF weights."""
    path = Path(path)
    return path.is_dir() and (path / IR_NAME).is_file() and not any(path.glob("*.safetensors"))


def _read_ir(path: Path, role: str):
    import openvino as ov

    try:
        return ov.Core().read_model(str(path / IR_NAME))
    except Exception as exc:  # a damaged or partial IR
        raise ExportError(f"cannot read the {role} IR {path / IR_NAME}: {str(exc).splitlines()[0]}") from None


def _rt(model, *keys) -> str | None:
    return model.get_rt_info(list(keys)).astype(str) if model.has_rt_info(list(keys)) else None


def _dflash_rt_info(drafter_ir, drafter: Path) -> tuple[list[int], int]:
    if (_rt(drafter_ir, "dflash_mode") or "").lower() != "true":
        raise ExportError(f"drafter IR has no rt_info dflash_mode=True: not an optimum-intel DFlash export: {drafter}")
    ids, mask = _rt(drafter_ir, "dflash", "target_layer_ids"), _rt(drafter_ir, "dflash", "mask_token_id")
    if ids is None or mask is None:
        raise ExportError(f"drafter IR lacks rt_info dflash/target_layer_ids or dflash/mask_token_id: {drafter}")
    return [int(i) for i in ids.split(",") if i.strip()], int(mask)


def _last_dim(model, name: str, role: str) -> int:
    for port in model.inputs:
        if name in port.get_names():
            dim = port.get_partial_shape()[-1]
            if dim.is_static:
                return dim.get_length()
    raise ExportError(f"the {role} IR has no input {name!r} with a static last dimension")


def validate_openvino_pair(target, drafter, block_size: int | None = None) -> PairInfo:
    """The pair checks of `validate_pair` on an optimum-intel target and DFlash drafter export."""
    from .drafter import DrafterConfig

    target, drafter = Path(target), Path(drafter)
    if not (target / "config.json").is_file():
        raise ExportError(f"the target IR directory has no config.json: {target}")
    if not (drafter / "config.json").is_file():
        raise ExportError(f"the drafter IR directory has no config.json: {drafter}")
    tcfg = load_target_config(target)
    arch = tcfg.get("model_type")
    if arch in HYBRID_ARCHS:
        raise PairMismatchError(f"an optimum-intel {arch} IR keeps its linear-attention state inside the IR; "
                                "ovdflash's hybrid runner needs its own export: pass the HF checkpoint as --target")
    if arch not in SUPPORTED_ARCHS:
        raise PairMismatchError(f"target architecture {arch!r} is not supported "
                                f"(supported: {', '.join(a for a in SUPPORTED_ARCHS if a not in HYBRID_ARCHS)})")
    try:
        dcfg = DrafterConfig.from_dict(json.loads((drafter / "config.json").read_text()))
    except (KeyError, TypeError, ValueError) as exc:
        raise PairMismatchError(f"drafter config is not a usable DFlash config: {exc}") from exc
    if dcfg.kind != "dflash":
        raise PairMismatchError(f"an optimum-intel drafter IR of kind {dcfg.kind!r} is not supported: "
                                "pass the drafter checkpoint as --drafter")
    ids, mask = _dflash_rt_info(_read_ir(drafter, "drafter"), drafter)
    if ids != dcfg.target_layer_ids or mask != dcfg.mask_token_id:
        raise PairMismatchError(f"the drafter IR's rt_info (target_layer_ids {ids}, mask_token_id {mask}) disagrees "
                                f"with its config.json ({dcfg.target_layer_ids}, {dcfg.mask_token_id})")
    if block_size is not None:
        dcfg.block_size = int(block_size)
    vocab, hidden, layers = int(tcfg["vocab_size"]), int(tcfg["hidden_size"]), int(tcfg["num_hidden_layers"])
    if dcfg.vocab_size != vocab:
        raise PairMismatchError(f"vocab size mismatch: target has {vocab}, drafter expects {dcfg.vocab_size}")
    if dcfg.hidden_size != hidden:
        raise PairMismatchError(f"hidden size mismatch: target has {hidden}, drafter has {dcfg.hidden_size} "
                                "(the drafter uses the target's embedding and lm_head)")
    features = _last_dim(_read_ir(drafter, "drafter"), "hidden_states", "drafter")
    if features != len(ids) * hidden:
        raise PairMismatchError(f"drafter IR takes {features} features, but {len(ids)} target layers x hidden "
                                f"{hidden} = {len(ids) * hidden}")
    bad = [i for i in ids if not 0 <= i < layers]
    if bad:
        raise PairMismatchError(f"target_layer_ids {bad} are outside the target's {layers} layers")
    if not 0 <= mask < vocab:
        raise PairMismatchError(f"mask_token_id {mask} is outside the vocab (0..{vocab - 1})")
    if mask in (_source_eos_ids(target, tcfg) or ()):
        raise PairMismatchError(f"mask_token_id {mask} is an eos token of the target")
    if not int(tcfg.get("max_position_embeddings") or 0):
        raise ExportError(f"the target's config.json names no max_position_embeddings (its context length): {target}")
    return PairInfo(tcfg, dcfg, arch, vocab, hidden, layers)


def ir_weight_format(model) -> str:
    """The weight format an IR was exported with, from the element types of its weight constants."""
    kinds = {op.get_element_type().get_type_name() for op in model.get_ops()
             if op.get_type_name() == "Constant" and math.prod(op.get_output_shape(0)) >= MIN_WEIGHT_ELEMENTS}
    if kinds & {"u4", "i4", "nf4"}:
        return "int4"
    if kinds & {"u8", "i8"}:
        return "int8"
    if kinds & {"f16", "bf16"}:
        return "fp16"
    return "fp32"


def import_openvino_pair(target, drafter, out_dir, target_weight_format: str = "fp32",
                         drafter_weight_format: str = "fp32", block_size: int | None = None,
                         progress: Callable[[str], None] | None = None, default_block_size: int | str = "auto",
                         compile_options: dict | None = None) -> Path:
    """Write an ovdflash model directory from an optimum-intel target and DFlash drafter export
    (`export_pair` calls it, having checked the options and `out_dir`)."""
    if (target_weight_format, drafter_weight_format) != ("fp32", "fp32"):
        raise ExportError("OpenVINO IRs keep the weights they were exported with: the weight format options "
                          "apply to checkpoints (give optimum-cli its --weight-format instead)")
    import openvino as ov

    from ovdflash.ov.graphs import LOCATOR_KEY, drafter_for_runtime, target_for_runtime

    from .target import _drop_runtime_kv_hint, annotate_layers

    target, drafter, out_dir = Path(target), Path(drafter), Path(out_dir)
    step = progress or (lambda msg: None)
    step("validating the pair (optimum-intel IRs)")
    info = validate_openvino_pair(target, drafter, block_size)
    dcfg = info.drafter_config
    default_block_size = check_default_block_size(default_block_size, dcfg.block_size)
    compile_options = check_compile_options(compile_options)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        step("reading the target IR")
        t_ir = _read_ir(target, "target")
        if not t_ir.has_rt_info(LOCATOR_KEY):  # optimum-intel locates Qwen3's layers only
            try:
                annotate_layers(t_ir, info.num_layers, info.hidden_size)
            except ValueError as exc:
                raise ExportError(f"target IR: {exc}") from None
        _drop_runtime_kv_hint(t_ir)
        t_format = ir_weight_format(t_ir)
        (work / "target").mkdir()
        ov.save_model(t_ir, str(work / "target" / IR_NAME), compress_to_fp16=False)
        for name in TARGET_CONFIG_FILES + OV_TOKENIZER_FILES:
            if (target / name).is_file():
                shutil.copyfile(target / name, work / "target" / name)

        step("reading the drafter IR")
        d_ir = _read_ir(drafter, "drafter")
        _drop_runtime_kv_hint(d_ir)
        d_ir.set_rt_info(str(dcfg.block_size), ["dflash", "block_size"])
        d_format = ir_weight_format(d_ir)
        (work / "drafter").mkdir()
        ov.save_model(d_ir, str(work / "drafter" / IR_NAME), compress_to_fp16=False)
        (work / "drafter" / "config.json").write_text(json.dumps(dcfg.to_dict(), indent=2) + "\n")

        step("checking the runtime graphs")
        core = ov.Core()
        t_check = core.read_model(str(work / "target" / IR_NAME))
        try:
            target_for_runtime(t_check, dcfg.target_layer_ids)
            drafter_for_runtime(core.read_model(str(work / "drafter" / IR_NAME)), t_check, None)
        except Exception as exc:
            raise ExportError(f"the IRs do not form a runtime pair: {str(exc).splitlines()[0]}") from None
        del t_check, t_ir, d_ir

        step("writing the tokenizer and the manifest")
        tok_cfg = copy_tokenizer(target, work)
        if not (work / "target" / OV_TOKENIZER_FILES[0]).is_file():
            write_ov_tokenizer(work, work / "target")
        eos, bos = _eos_bos(target, info.target_config, tok_cfg, json.loads((work / "tokenizer.json").read_text()))
        manifest = pair_manifest(
            info, dcfg.block_size, default_block_size, eos, bos,
            source_record(target, t_format, exported_by="optimum-intel"),
            source_record(drafter, d_format, exported_by="optimum-intel"),
            None, compile_options)
        move_into_place(work, out_dir, manifest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    step("done")
    return out_dir
