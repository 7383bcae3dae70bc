"""Reading, adapting and compiling an exported pair for the runners (everything before the first inference).

Contract:
- `compile_runners(model_dir, manifest, device, config, with_drafter)` reads the saved IRs,
  applies the drafter's runtime graph for the manifest's drafter kind (`runtime_drafter_graph`:
  `graphs.drafter_for_runtime`, `dflash2.selector_for_runtime` or `dspark.dspark_for_runtime`, whose
  heads `drafter/dspark_heads.npz` are attached to the compiled drafter) and `graphs.target_for_runtime`,
  compiles with CACHE_DIR set (except for a target with fp16 weights: `FP16_UNCACHED`), and returns
  (OVPagedTarget | OVTarget | HybridTarget, OVDrafter | None). The drafter gets `DRAFTER_DEFAULTS`
  under `config` (a key set in `config` wins), and every model compiled for the CPU `cpu_defaults`
  (a bounded runtime cache, and oneDNN's primitive cache bounded through its environment variable
  unless the environment sets it). When `drafter/draft_vocab.json` exists (and `use_draft_vocab`), the
  drafter's head is restricted to that draft vocabulary; otherwise a whole fp16 head is applied in int8
  (`graphs.with_int8_head`) and the drafter gets `INT8_HEAD_DRAFTER_DEFAULTS` instead.
- `compile_runners(..., target_runner=)` picks the target runner (`ovdflash.TARGET_RUNNERS`):
  "paged" (the default) applies openvino's paged-attention transformation before the runtime
  graph edits (`runtime_target_graph`) and returns an `OVPagedTarget`, with an f32-weight copy
  for wide calls where `ov.wide_target` wants one and `skip_wide` (the loader's stored
  calibration) does not rule it out before it is compiled (the copy's file pages dropped once it
  is compiled); "stateful" keeps the exported IR: `OVTarget`; "hybrid" exactly when the manifest
  names it (`ov.hybrid`).
- `read_ir(core, xml, role)`: `core.read_model` with a one-line error naming the file.
"""
from __future__ import annotations

import os
from pathlib import Path

import openvino as ov

from ..manifest import (DEFAULT_TARGET_RUNNER, DRAFT_VOCAB, DRAFTER_XML, DSPARK_HEADS, TARGET_XML, drafter_kind, parse_target_runner,
                        runners_for)
from . import dflash2, dspark, graphs
from . import wide_target as wide_weights
from .memory import release_mapped_files
from .paged import OVPagedTarget
from .runners import OVDrafter, OVTarget, kv_seq_axes

# Drafter-only compile defaults. No dynamic quantization: the drafter's FullyConnected layers see
# 1-8 rows a call, where quantizing the activations costs more than it saves (SmolLM2's int8
# drafter, 2 cores, 300-token context: 2.78 against 3.11 ms a call with 1 draft, 3.38 against 3.60
# with 3). Only the proposals can change, never the output: the target verifies every draft.
DRAFTER_DEFAULTS = {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
# A drafter with the whole vocabulary's head in int8 (graphs.with_int8_head): the head dominates, and
# quantizing its few rows of activations halves its time (docs/BENCHMARKS.md, "Drafter head").
INT8_HEAD_DRAFTER_DEFAULTS = {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "32"}


# Every model compiled for the CPU keeps at most this many executors per kind of node (the plugin's
# LRU of per-shape kernels): its default of 5000 let varied traffic grow a server by GBs
# (docs/SERVING.md, Memory). Speed is unchanged at 32 entries.
RUNTIME_CACHE_CAPACITY = 32


# oneDNN's process-wide primitive cache (1024 by default) kept ~250 MB of one-off shapes under
# varied traffic; 128 left speed unchanged (docs/SERVING.md, Memory). A value in the environment wins.
ONEDNN_CACHE_CAPACITY = 128
ONEDNN_CACHE_VARIABLE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def cpu_defaults(device: str, config: dict | None) -> dict:
    """`config` with the runtime cache bound added for the CPU plugin (a key set in `config` wins);
    also bounds oneDNN's primitive cache, which it sizes once, before its first primitive."""
    if device.upper() != "CPU":
        return dict(config or {})
    os.environ.setdefault(ONEDNN_CACHE_VARIABLE, str(ONEDNN_CACHE_CAPACITY))
    return {"CPU_RUNTIME_CACHE_CAPACITY": str(RUNTIME_CACHE_CAPACITY), **(config or {})}


# A target with fp16 weights is compiled without CACHE_DIR: the CPU plugin (2026.4) runs an fp16 model
# imported from its compile cache much slower than the freshly compiled one (SmolLM2-135M, 2 cores:
# a 1-token step 45 against 28 ms, a 4-token verify 55 against 43 ms, and 950 against 720 MB
# resident; CACHE_MODE=OPTIMIZE_SIZE the same). int8 and fp32 targets keep the cache (same speed).
FP16_UNCACHED = "fp16"


# the runtime graph of each drafter kind (manifest.DRAFTER_KINDS); OVDrafter picks the proposer that reads it
DRAFTER_GRAPHS = {"dflash": graphs.drafter_for_runtime, "dflash2": dflash2.selector_for_runtime,
                  "dspark": dspark.dspark_for_runtime}


def runtime_drafter_graph(drafter: ov.Model, target: ov.Model, draft_vocab=None, kind: str = "dflash") -> ov.Model:
    """The drafter's runtime graph for its kind, grafted onto the target's embedding and head. In place."""
    return DRAFTER_GRAPHS[kind](drafter, target, draft_vocab)


def read_ir(core: ov.Core, xml: Path, role: str) -> ov.Model:
    """`core.read_model`, with a one-line error that names the model and the file that failed."""
    for path in (xml, xml.with_suffix(".bin")):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: the {role} IR file is missing; re-export the model directory")
    try:
        return core.read_model(xml)
    except Exception as exc:  # the plugin's message is many lines; keep its first
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise RuntimeError(f"{xml}: the {role} IR could not be read ({first.strip()[:200]}); "
                           "re-export the model directory") from None


def runtime_target_graph(target_model: ov.Model, manifest: dict, target_runner: str = DEFAULT_TARGET_RUNNER) -> ov.Model:
    """The runtime's edits of a read target IR, in place (and returned): openvino's paged-attention
    transformation for the "paged" runner, then `graphs.target_for_runtime`. The feature pass
    (ovdflash_export.training.features) builds its graph with this too, so it runs what the runtime runs."""
    if parse_target_runner(target_runner) == "paged":
        from openvino._offline_transformations import paged_attention_transformation

        from .hybrid import has_linear_states, linear_states_as_variables

        if has_linear_states(target_model):
            linear_states_as_variables(target_model)
        paged_attention_transformation(target_model)
    return graphs.target_for_runtime(target_model, manifest["target_layer_ids"])


def compile_runners(model_dir: str | Path, manifest: dict, device: str = "CPU", config: dict | None = None,
                    with_drafter: bool = True, core: ov.Core | None = None, use_draft_vocab: bool = True,
                    target_runner: str = DEFAULT_TARGET_RUNNER, wide_target: bool | None = None,
                    skip_wide=None, **target_options) -> tuple[OVTarget | OVPagedTarget, OVDrafter | None]:
    """Read, adapt and compile the pair. `config` goes to compile_model (CACHE_DIR included).
    `target_runner` (`TARGET_RUNNERS`): "stateful" (OVTarget) or "paged" (OVPagedTarget); "hybrid"
    (ovdflash.ov.hybrid.HybridTarget) exactly when the manifest names it (a linear-attention target).
    `wide_target` (None: auto): a paged target with f16 weights under f32 inference is compiled a
    second time from f32 weights for its wide calls (`OVPagedTarget`'s `wide`, ovdflash.ov.wide_target),
    unless `skip_wide(target, wide_xml)` (called with the narrow target built) says it never pays here."""
    target_runner = parse_target_runner(target_runner)
    if target_runner not in runners_for(manifest):
        raise ValueError(f"target runner {target_runner!r} does not fit this target "
                         f"(its manifest names {manifest.get('target_runner')!r})")
    model_dir = Path(model_dir)
    core = core or ov.Core()
    target_model = read_ir(core, model_dir / TARGET_XML, "target")
    seq_axes = kv_seq_axes(target_model)
    drafter = None
    if with_drafter:
        drafter_model = read_ir(core, model_dir / DRAFTER_XML, "drafter")
        drafter_seq_axes = kv_seq_axes(drafter_model)
        # graft before the target is edited: the drafter reuses the target's embedding and lm_head nodes
        vocab_path = model_dir / DRAFT_VOCAB
        draft_vocab = graphs.read_draft_vocab(vocab_path) if use_draft_vocab and vocab_path.exists() else None
        runtime_drafter_graph(drafter_model, target_model, draft_vocab, drafter_kind(manifest))
        graphs.with_draft_rows(drafter_model)
        int8_head = draft_vocab is None and graphs.with_int8_head(drafter_model, target_model)
        if int8_head:  # the fp16 head's pages it read would otherwise stay through the compiles below
            release_mapped_files([(model_dir / TARGET_XML).with_suffix(".bin")])
    max_length = int(manifest["max_position_embeddings"])
    config = cpu_defaults(device, config)
    target_config = dict(config)
    if manifest.get("target", {}).get("weight_format") == FP16_UNCACHED:
        target_config.pop("CACHE_DIR", None)
    if target_runner == "hybrid":
        from .hybrid import compile_hybrid_target

        target = compile_hybrid_target(core, target_model, manifest, device, target_config, seq_axes,
                                       **target_options)
    else:
        runtime_target_graph(target_model, manifest, target_runner)
        compiled_target = core.compile_model(target_model, device, target_config)
        if target_runner == "paged":
            target = OVPagedTarget(compiled_target, max_length, **target_options)
            if target_config.get("INFERENCE_PRECISION_HINT", "f32") in ("f32", "fp32") \
                    and graphs.f16_weight_converts(target_model) \
                    and wide_weights.wanted((model_dir / TARGET_XML).with_suffix(".bin"), wide_target):
                wide_xml = wide_weights.f32_weights_ir(model_dir / TARGET_XML, (config or {}).get("CACHE_DIR"))
                if skip_wide is None or not skip_wide(target, wide_xml):
                    wide_model = runtime_target_graph(read_ir(core, wide_xml, "f32-weight target"), manifest, "paged")
                    target.attach_wide(core.compile_model(wide_model, device, target_config))
                    # compiling copied its weights: drop the f32 file's pages now, not after both targets ran
                    release_mapped_files([wide_xml.with_suffix(".bin")])
                    target.wide_xml = wide_xml
                    # for recompile_narrow after the calibration
                    target.narrow_compiler = lambda: core.compile_model(target_model, device, target_config)
        else:
            target = OVTarget(compiled_target, max_length, seq_axes, **target_options)
    if with_drafter:
        drafter_defaults = INT8_HEAD_DRAFTER_DEFAULTS if int8_head else DRAFTER_DEFAULTS
        compiled_drafter = core.compile_model(drafter_model, device, {**drafter_defaults, **config})
        if drafter_kind(manifest) == "dspark":
            if not (model_dir / DSPARK_HEADS).is_file():
                raise FileNotFoundError(f"{model_dir / DSPARK_HEADS}: the DSpark drafter's heads are missing; "
                                        "re-export the model directory")
            dspark.attach_heads(compiled_drafter, dspark.read_heads(model_dir / DSPARK_HEADS, draft_vocab))
        drafter = OVDrafter(compiled_drafter,
                            int(manifest["block_size"]), int(manifest["mask_token_id"]), max_length,
                            exact_passes=manifest.get("draft_pass") == "exact", seq_axes=drafter_seq_axes)
    return target, drafter

