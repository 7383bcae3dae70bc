"""Loading a DFlashPipeline: from a model directory to compiled runners, primed and lean.

Contract:
- `from_pretrained(cls, model_dir=None, device="CPU", draft=True, cache_dir=None, ...)` is
  `DFlashPipeline.from_pretrained` (the pipeline's contract says what each option does): it reads
  the manifest, compiles the pair with CACHE_DIR set (`DEFAULT_CACHE_DIR` unless given), times the
  paged target's f32-weight copy where it has one (then compiles its narrow target afresh:
  `OVPagedTarget.recompile_narrow`; the result is kept per `calibration_host`, so a later load
  on the same host reads it instead, and does not even compile a copy that never pays there),
  builds `cls(...)` and, with
  `release_weight_pages`, primes it and drops the mapped weight pages.
- `release_weight_pages(pipe) -> int` runs every kernel shape once (a prefill, a verify, an AR
  step), leaves the runners, the prefix cache and the stats as they were, then drops the resident
  pages of the mapped IR files (ovdflash.ov.memory); returns the bytes advised.
- `warm_up(pipe, num_tokens=4, block_size=None)`: one short generation, the stats left alone.
- `default_model_dir()`: the embedded default model's directory (ovdflash_models), fetched once.
- `wide_copy_ir(target)`: the IR file of a target's f32-weight copy, None without one;
  `weight_files(model_dir, target)`: every IR weight file the loaded pair maps.

Imports: decode/, ov/ (what loads openvino only inside the functions that need it), manifest,
tokenizer; never the pipeline (it gets the class or the instance as an argument), server/, bench/
or cli/.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from .decode.stats import GenerationStats
from .manifest import load_manifest, parse_target_runner
from .ov.precision import compile_config
from .tokenizer import Tokenizer

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "ovdflash" / "ov_cache"


def default_model_dir() -> Path:
    try:
        from ovdflash_models.default import ensure_default_model
    except ImportError as exc:
        raise RuntimeError("no model directory given and the embedded default model is not available "
                           f"({exc}); pass a directory made by `ovdflash export`") from exc
    return Path(ensure_default_model())


def wide_copy_ir(target) -> Path | None:
    """The IR file of the target's f32-weight copy (ovdflash.ov.wide_target), None without one. Every
    target runner declares `kind`; only the paged one (OVPagedTarget) has `wide_xml`."""
    return target.wide_xml if target.kind == "paged" else None


def cpu_model_name() -> str | None:
    """The first CPU's model name, family and model from /proc/cpuinfo (None where there is none)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip():
                    break  # the first processor's block ends here
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return None
    if "model name" not in fields:
        return None
    return f"{fields['model name']} family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"


def calibration_host(target, device: str, config: dict) -> str:
    """What a calibration of the f32-weight copy depends on besides the target file (ov.wide_target)."""
    import openvino as ov

    def read(get, name):
        try:
            value = get(name)
        except RuntimeError:  # a device without the property
            return "?"
        return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)

    core = ov.Core()
    device_name = read(lambda p: core.get_property(device, p), "FULL_DEVICE_NAME")
    capabilities = read(lambda p: core.get_property(device, p), "OPTIMIZATION_CAPABILITIES")
    name = f"{cpu_model_name() or device_name} ({capabilities})"
    threads = read(target.compiled.get_property, "INFERENCE_NUM_THREADS")
    settings = ",".join(f"{k}={v}" for k, v in sorted(config.items()) if k != "CACHE_DIR")
    sizes = ",".join(map(str, target.calibration_sizes()))
    return f"{name}; {device}; {threads} threads; openvino {ov.get_version()}; sizes {sizes}; {settings}"


def from_pretrained(cls, model_dir: str | Path | None = None, device: str = "CPU", draft: bool = True,
                    cache_dir: str | Path | None = None, use_draft_vocab: bool = True,
                    target_runner: str | None = None, prompt_lookup: bool = True,
                    precision: str | None = None, release_weight_pages: bool = True,
                    prefix_cache: bool = True, wide_target: bool | None = None,
                    **compile_options):
    from .ov.compile import compile_runners  # openvino is only needed from here on
    from .ov import wide_target as wide_weights
    from .ov.memory import release_mapped_files

    if isinstance(model_dir, str) and not model_dir.strip():  # Path("") would quietly mean "."
        raise ValueError("model_dir is empty: give an ovdflash model directory, or None for the embedded default")
    model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
    manifest = load_manifest(model_dir)
    # the caller's runner, else the model directory's (load_manifest fills in the default)
    target_runner = parse_target_runner(target_runner or manifest["target_runner"])
    config, numerics = compile_config(manifest, compile_options, precision, target_runner)
    config.setdefault("CACHE_DIR", str(cache_dir or DEFAULT_CACHE_DIR))

    def keep_checkpoints(target) -> None:
        linear = getattr(target, "linear", None)
        if linear is not None:  # a verify of a whole block must keep a linear-attention state per token
            linear.max_checkpoints = max(linear.max_checkpoints, int(manifest["block_size"]))

    stored = {}  # the host key and its stored calibration, read once, before the copy would be compiled

    def copy_never_pays(target, wide_xml) -> bool:  # this host's stored calibration says so: compile no copy
        keep_checkpoints(target)  # the calibration's sizes depend on it
        stored["host"] = calibration_host(target, device, config)
        stored["found"], stored["wide_from"] = wide_weights.cached_wide_from(wide_xml, stored["host"])
        return stored["found"] and stored["wide_from"] is None

    target, drafter = compile_runners(model_dir, manifest, device, config, with_drafter=draft,
                                      use_draft_vocab=use_draft_vocab, target_runner=target_runner,
                                      wide_target=wide_target, skip_wide=copy_never_pays)
    keep_checkpoints(target)
    wide_xml = wide_copy_ir(target)
    # the IR pages go as each shape's repacking read them
    release = (lambda: release_mapped_files(weight_files(model_dir, target))) if release_weight_pages else None
    if stored and wide_xml is None:  # no copy compiled: each calibration size once, as a load that dropped it did
        target.warm_calls(release_pages=release)
    elif wide_xml is not None:  # which call sizes the f32-weight copy runs: measured once per host
        host, found = stored["host"], stored["found"]
        if found:
            target.use_wide_from(stored["wide_from"])
            target.narrow_compiler = None
            target.warm_calls(release_pages=release)
        else:
            target.calibrate_wide(release_pages=release)
            target.recompile_narrow()
            wide_weights.store_wide_from(wide_xml, host, target.wide_from if target.wide_request is not None else None)
    tokenizer = Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").exists() else None
    pipe = cls(target, drafter, tokenizer, manifest["eos_token_ids"], manifest["block_size"],
               manifest["mask_token_id"], model_dir, manifest.get("bos_token_id"),
               manifest["default_block_size"], prompt_lookup, prefix_cache)
    pipe.numerics = numerics
    pipe.vocab_size = manifest.get("vocab_size")
    if release_weight_pages:
        pipe.release_weight_pages()
    return pipe


@contextmanager
def _stats_untouched(pipe):
    """Priming and warm-up runs are not user calls: the pipeline's stats stay as they were."""
    kept = pipe.stats, pipe.last_stats
    pipe.stats = GenerationStats()
    try:
        yield
    finally:
        pipe.stats, pipe.last_stats = kept


def release_weight_pages(pipe) -> int:
    """Run every kernel shape once (a prefill, a verify, an AR step), so the plugin has repacked
    its weights, then drop the resident pages of the mapped IR files (ovdflash.ov.memory)."""
    from .ov.memory import release_mapped_files

    prompt = [pipe.eos_token_ids[0] if pipe.eos_token_ids else 0] * 32
    with _stats_untouched(pipe):
        for block in ((2, 1) if pipe.drafter is not None else (1,)):
            for _ in pipe.generate_tokens(prompt, 3, block_size=block, eos_token_ids=(), prompt_lookup=False):
                pass
    for runner in (pipe.target, pipe.drafter):  # leave them as freshly loaded
        if runner is not None:
            runner.reset()
    pipe.prefix_store.invalidate()
    return release_mapped_files(weight_files(pipe.model_dir, pipe.target))


def weight_files(model_dir: Path | None, target) -> list[Path]:
    """The IR weight files a loaded pair maps: target, drafter, and the target's f32-weight copy."""
    files = [model_dir / "target" / "openvino_model.bin",
             model_dir / "drafter" / "openvino_model.bin"] if model_dir is not None else []
    wide_xml = wide_copy_ir(target)
    if wide_xml is not None:
        files.append(wide_xml.with_suffix(".bin"))
    return files


def warm_up(pipe, num_tokens: int = 4, block_size: int | str | None = None) -> None:
    """One short generation, so first-call costs (worker threads, first-shape kernels, and for
    "auto" the cost measurement) are paid now."""
    prompt = [pipe.eos_token_ids[0] if pipe.eos_token_ids else 0]
    with _stats_untouched(pipe):
        for _ in pipe.generate_tokens(prompt, num_tokens, block_size=block_size, eos_token_ids=()):
            pass
