"""Export a (target, drafter) pair into one self-describing model directory.

Contract (docs/DESIGN.md, "Exported model directory"): ``export_pair(target, drafter,
out_dir, target_weight_format, drafter_weight_format, block_size)`` writes ``target/``
(stateful IR + locators + config.json, and openvino_tokenizer/detokenizer.xml for
openvino.genai when openvino-tokenizers can convert the tokenizer), ``drafter/`` (stateful DFlash IR + z-lab
config.json, and ``draft_vocab.json`` when the drafter checkpoint ships one: the sorted
target ids it may propose; ``manifest.json["draft_vocab_size"]`` is its length, else null),
``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja`` (from
the target) and ``manifest.json``.

The pair is validated from the configs (and the drafter's ``fc`` weight shape) BEFORE any
conversion: a mismatch raises ``PairMismatchError`` (a ``ValueError``) with a one-line
message and nothing is written. The directory is assembled in a temporary sibling and
renamed into place at the end, so a failed export leaves no half-written ``out_dir``.
A hub id is resolved first (`hub`); a pair of optimum-intel IRs goes to `optimum_import`. The
pieces of the directory both paths write (tokenizer, EOS/BOS, manifest) are `model_dir`'s, the
errors `errors`' (`ExportError` and `PairMismatchError` are importable from here too).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from ovdflash.manifest import DRAFT_VOCAB_FILE, MANIFEST_FILE

from .compress import WEIGHT_FORMATS
from .errors import ExportError, PairMismatchError
from .hub import resolve_pair  # a hub id becomes its cached snapshot; a local path stays as it is
from .model_dir import (PairInfo, _eos_bos, _source_eos_ids, check_compile_options, check_default_block_size,
                        copy_tokenizer, move_into_place, pair_manifest, source_record, write_ov_tokenizer)
from .optimum_import import import_openvino_pair, openvino_pair, validate_openvino_pair
from .target_config import SUPPORTED_ARCHS, load_target_config


def _read_draft_vocab(drafter_dir: Path):
    from ovdflash.ov.graphs import read_draft_vocab  # sorted, unique; raises on a malformed file

    try:
        return read_draft_vocab(drafter_dir / DRAFT_VOCAB_FILE)
    except ValueError as exc:
        raise PairMismatchError(str(exc)) from exc


def _target_config(target: Path) -> dict:
    if target.suffix == ".gguf":
        if not target.is_file():
            raise ExportError(f"target GGUF file not found: {target}")
        from .gguf_tokenizer import check_gguf_tokenizer
        try:
            check_gguf_tokenizer(target)
        except ValueError as exc:
            raise ExportError(str(exc)) from None
    elif not (target / "config.json").is_file():
        raise ExportError(f"target is not a HF model directory (no config.json): {target}")
    try:
        return load_target_config(target)
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read the target config: {exc}") from exc


def _drafter_fc_shape(drafter: Path):
    from safetensors import safe_open

    path = drafter / "model.safetensors"
    if not path.is_file():
        raise ExportError(f"drafter has no model.safetensors: {drafter}")
    with safe_open(str(path), framework="np") as f:
        if "fc.weight" not in f.keys():
            raise PairMismatchError("drafter checkpoint has no fc.weight: not a DFlash drafter")
        return tuple(f.get_slice("fc.weight").get_shape())


def validate_pair(target, drafter, block_size: int | None = None) -> PairInfo:
    """Check that the drafter fits the target; raise PairMismatchError (one line) if not."""
    from .drafter import DrafterConfig

    target, drafter = resolve_pair(target, drafter)
    if openvino_pair(target, drafter):  # both exported by optimum-intel already: checked on their IRs
        return validate_openvino_pair(target, drafter, block_size)
    tcfg = _target_config(target)
    arch = tcfg.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        raise PairMismatchError(f"target architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    if not (drafter / "config.json").is_file():
        raise ExportError(f"drafter is not a checkpoint directory (no config.json): {drafter}")
    try:
        dcfg = DrafterConfig.from_dict(json.loads((drafter / "config.json").read_text()))
    except (KeyError, ValueError, TypeError) as exc:
        raise PairMismatchError(f"drafter config is not a usable DFlash config: {exc}") from exc

    vocab, hidden, layers = int(tcfg["vocab_size"]), int(tcfg["hidden_size"]), int(tcfg["num_hidden_layers"])
    n = len(dcfg.target_layer_ids)
    if dcfg.vocab_size != vocab:
        raise PairMismatchError(f"vocab size mismatch: target has {vocab}, drafter expects {dcfg.vocab_size}")
    if dcfg.hidden_size != hidden:
        raise PairMismatchError(f"hidden size mismatch: target has {hidden}, drafter has {dcfg.hidden_size} "
                                "(the drafter uses the target's embedding and lm_head)")
    fc_shape = _drafter_fc_shape(drafter)
    if fc_shape != (dcfg.hidden_size, n * hidden):
        raise PairMismatchError(f"drafter fc takes {fc_shape[1] if len(fc_shape) == 2 else fc_shape} features, "
                                f"but {n} target layers x hidden {hidden} = {n * hidden}")
    bad = [i for i in dcfg.target_layer_ids if not 0 <= i < layers]
    if bad:
        raise PairMismatchError(f"target_layer_ids {bad} are outside the target's {layers} layers")
    if dcfg.num_target_layers and dcfg.num_target_layers != layers:
        raise PairMismatchError(f"drafter was built for {dcfg.num_target_layers} target layers, target has {layers}")
    if not 0 <= dcfg.mask_token_id < vocab:
        raise PairMismatchError(f"mask_token_id {dcfg.mask_token_id} is outside the vocab (size {vocab})")
    if dcfg.mask_token_id in (_source_eos_ids(target, tcfg) or ()):  # checked again once converted
        raise PairMismatchError(f"mask_token_id {dcfg.mask_token_id} is an eos token of the target")
    bs = dcfg.block_size if block_size is None else int(block_size)
    if (Path(drafter) / DRAFT_VOCAB_FILE).is_file():  # optional: the target ids the drafter may propose
        draft_vocab = _read_draft_vocab(Path(drafter))
        if draft_vocab[-1] >= vocab:
            raise PairMismatchError(f"{DRAFT_VOCAB_FILE} has id {int(draft_vocab[-1])} >= the target's "
                                    f"vocab_size {vocab}")
    if bs < 2:
        raise PairMismatchError(f"block size must be at least 2, got {bs}")
    if dcfg.kind == "dflash2":
        from .dflash2 import check_checkpoint
        try:
            check_checkpoint(drafter, dcfg)
        except ValueError as exc:
            raise PairMismatchError(str(exc)) from None
        if (Path(drafter) / DRAFT_VOCAB_FILE).is_file() and dcfg.dflash2.selector_top_k > len(draft_vocab):
            raise PairMismatchError(f"selector_top_k {dcfg.dflash2.selector_top_k} exceeds the {len(draft_vocab)} ids "
                                    f"of {DRAFT_VOCAB_FILE}")
    if dcfg.kind == "dspark":
        from .dspark import check_checkpoint as check_dspark
        try:
            check_dspark(drafter, dcfg)
        except ValueError as exc:
            raise PairMismatchError(str(exc)) from None
    return PairInfo(tcfg, dcfg, arch, vocab, hidden, layers)


def export_pair(target, drafter, out_dir, target_weight_format: str = "fp32", drafter_weight_format: str = "fp32",
                block_size: int | None = None, progress: Callable[[str], None] | None = None,
                default_block_size: int | str = "auto", compile_options: dict | None = None) -> Path:
    """Validate, convert, compress and write the model directory; returns out_dir.
    `default_block_size` ("auto" or 1..block size) goes to the manifest: the block size the
    runtime uses when a call names none. `compile_options` (OpenVINO properties, e.g. a model's
    INFERENCE_PRECISION_HINT) go to the manifest's `compile_options`, applied at every load."""
    target, drafter, out_dir = Path(target), Path(drafter), Path(out_dir)
    step = progress or (lambda msg: None)
    for name, fmt in (("target", target_weight_format), ("drafter", drafter_weight_format)):
        if fmt not in WEIGHT_FORMATS:
            raise ExportError(f"{name} weight format must be one of {', '.join(WEIGHT_FORMATS)}, got {fmt!r}")
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / MANIFEST_FILE).is_file():
        raise ExportError(f"output directory exists and is not an ovdflash export: {out_dir}")

    target, drafter = resolve_pair(target, drafter)
    if openvino_pair(target, drafter):  # both exported by optimum-intel already: their IRs are kept
        return import_openvino_pair(target, drafter, out_dir, target_weight_format, drafter_weight_format,
                                    block_size, progress, default_block_size, compile_options)
    step("validating the pair")
    info = validate_pair(target, drafter, block_size)
    if not int(info.target_config.get("max_position_embeddings") or 0):
        raise ExportError("the target's config.json names no max_position_embeddings (its context length); "
                          "add it to the config before exporting")
    dcfg = info.drafter_config
    bs = dcfg.block_size if block_size is None else int(block_size)
    default_block_size = check_default_block_size(default_block_size, bs)
    compile_options = check_compile_options(compile_options)
    draft_vocab = _read_draft_vocab(drafter) if (drafter / DRAFT_VOCAB_FILE).is_file() else None

    import openvino as ov

    from ovdflash.ov.compile import runtime_drafter_graph
    from ovdflash.ov.graphs import read_layer_locators, target_for_runtime

    from .compress import compress_model
    from .drafter_export import export_drafter
    from .target import export_target_model, gguf_to_hf_dir, save_target

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        hf_dir = target
        if target.suffix == ".gguf":
            step("converting the GGUF target to a HF directory")
            hf_dir = gguf_to_hf_dir(target, work / "_gguf_hf")
        step(f"exporting the target ({info.arch}, {info.num_layers} layers) with optimum-intel")
        t_model, wrapped = export_target_model(hf_dir)
        if target_weight_format in ("int8", "int4"):
            step(f"compressing the target weights to {target_weight_format}")
        t_model = compress_model(t_model, target_weight_format)
        read_layer_locators(t_model)  # the locators must survive compression
        save_target(t_model, wrapped, work / "target", compress_to_fp16=target_weight_format == "fp16")
        del t_model, wrapped

        step(f"exporting the drafter ({dcfg.num_hidden_layers} layers, block {bs})")
        export_drafter(drafter, work / "drafter", drafter_weight_format, block_size=block_size)

        if draft_vocab is not None:
            (work / "drafter" / DRAFT_VOCAB_FILE).write_text(json.dumps(draft_vocab.tolist()))

        step("checking the runtime graphs")
        core = ov.Core()
        t_ir = core.read_model(str(work / "target" / "openvino_model.xml"))
        target_for_runtime(t_ir, dcfg.target_layer_ids)
        runtime_drafter_graph(core.read_model(str(work / "drafter" / "openvino_model.xml")), t_ir, draft_vocab,
                              dcfg.kind)
        del t_ir

        step("writing the tokenizer and the manifest")
        tok_cfg = copy_tokenizer(hf_dir, work)
        tok_json = json.loads((work / "tokenizer.json").read_text())
        why_not = write_ov_tokenizer(work, work / "target")
        if why_not:
            step(f"note: no OpenVINO tokenizer for openvino.genai ({why_not}); ovdflash does not need it")
        eos, bos = _eos_bos(hf_dir, info.target_config, tok_cfg, tok_json)
        manifest = pair_manifest(
            info, bs, default_block_size, eos, bos,
            source_record(target, target_weight_format), source_record(drafter, drafter_weight_format),
            None if draft_vocab is None else len(draft_vocab), compile_options)
        shutil.rmtree(work / "_gguf_hf", ignore_errors=True)
        move_into_place(work, out_dir, manifest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    step("done")
    return out_dir

