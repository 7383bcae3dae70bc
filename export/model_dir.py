"""The model directory both export paths write: `exporter.export_pair` (from checkpoints) and
`optimum_import.import_openvino_pair` (from optimum-intel IRs).

Contract (docs/DESIGN.md, "Exported model directory"):
- `PairInfo`: what the pair checks found (the target config, the DrafterConfig, the geometry).
- `copy_tokenizer(src, dst)` writes `tokenizer.json`, `tokenizer_config.json` (with its chat
  template) and `chat_template.jinja`; `write_ov_tokenizer(tokenizer_dir, dst)` the optional
  OpenVINO tokenizer IRs for openvino.genai; `_eos_bos` / `_source_eos_ids` the EOS and BOS ids.
- `check_default_block_size` / `check_compile_options`: the manifest's options, checked by the
  runtime's rules; `source_record` a source's entry; `pair_manifest(...)` the whole manifest;
  `move_into_place(work, out_dir, manifest)` checksums the files, writes the manifest and renames
  the finished directory into place.
Every input problem is an `ExportError` (`PairMismatchError` for a pair that does not fit).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from ovdflash.manifest import FORMAT, MANIFEST_FILE, checksum_files, parse_default_block_size

from .errors import ExportError, PairMismatchError
from .target_config import HYBRID_ARCHS


@dataclass
class PairInfo:
    target_config: dict
    drafter_config: object  # DrafterConfig
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int


def _source_eos_ids(target: Path, tcfg: dict) -> list[int] | None:
    """The EOS ids the export will write, where the source tells them before any conversion
    (None: a GGUF whose tokenizer transformers converts, or a directory without tokenizer.json)."""
    if target.suffix == ".gguf":
        from .gguf_tokenizer import gguf_eos_token_ids, read_gguf_tokenizer_metadata
        try:
            return gguf_eos_token_ids(read_gguf_tokenizer_metadata(target))
        except ValueError:
            return None
    if not (target / "tokenizer.json").is_file():
        return None
    return _eos_bos(target, tcfg, _tokenizer_config(target), json.loads((target / "tokenizer.json").read_text()))[0]


def _sha256_files(paths) -> str:
    h = hashlib.sha256()
    for p in sorted(paths, key=lambda p: p.name):
        fh = hashlib.sha256()
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                fh.update(chunk)
        h.update(f"{p.name}:{fh.hexdigest()}\n".encode())
    return h.hexdigest()


def source_record(source: Path, weight_format, **extra) -> dict:
    """A manifest's record of one exported model's source: its weight format, path and digest."""
    return {"weight_format": weight_format, "source": str(source.resolve()), "source_sha256": source_sha256(source),
            **extra}


def source_sha256(source: Path) -> str:
    """sha256 over the source's config and weight files (a single digest for a directory)."""
    if source.is_file():
        return _sha256_files([source])
    files = [p for p in source.iterdir() if p.is_file() and (
        p.name == "config.json" or p.suffix in (".safetensors", ".bin", ".gguf", ".pt", ".pth"))]
    return _sha256_files(files)


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("ovdflash", "openvino", "torch", "transformers", "optimum-intel", "optimum", "nncf", "tokenizers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def _token_id(tokenizer_json: dict, token) -> int | None:
    if token is None:
        return None
    if isinstance(token, dict):
        token = token.get("content")
    for added in tokenizer_json.get("added_tokens", []):
        if added["content"] == token:
            return int(added["id"])
    return tokenizer_json.get("model", {}).get("vocab", {}).get(token)


def _tokenizer_config(src: Path) -> dict:
    path = src / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def copy_tokenizer(src: Path, dst: Path) -> dict:
    """Copy tokenizer.json, tokenizer_config.json (with chat_template) and chat_template.jinja."""
    tok_json = src / "tokenizer.json"
    if not tok_json.is_file():
        raise ExportError(f"target has no tokenizer.json (a HF fast tokenizer is required): {src}")
    shutil.copyfile(tok_json, dst / "tokenizer.json")
    tok_cfg = _tokenizer_config(src)
    template = tok_cfg.get("chat_template")
    if (src / "chat_template.jinja").is_file():
        template = (src / "chat_template.jinja").read_text()
    if isinstance(template, list):  # named templates: keep the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    if template is None:
        raise ExportError(f"target tokenizer has no chat template: {src}")
    tok_cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    (dst / "chat_template.jinja").write_text(template)
    return tok_cfg


def write_ov_tokenizer(tokenizer_dir: Path, dst: Path) -> str | None:
    """openvino_tokenizer.xml / openvino_detokenizer.xml for openvino.genai (its LLMPipeline reads
    them from the model directory to take text prompts); built from the tokenizer files just
    written (so a rebuilt GGUF tokenizer is the one converted). Returns why not, or None."""
    try:
        import openvino as ov
        from openvino_tokenizers import convert_tokenizer
        from transformers import AutoTokenizer

        tok, detok = convert_tokenizer(AutoTokenizer.from_pretrained(str(tokenizer_dir)), with_detokenizer=True)
        ov.save_model(tok, str(dst / "openvino_tokenizer.xml"))
        ov.save_model(detok, str(dst / "openvino_detokenizer.xml"))
        return None
    except Exception as exc:  # optional: only genai needs it
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def _eos_bos(target_dir: Path, tcfg: dict, tok_cfg: dict, tokenizer_json: dict):
    eos: list[int] = []

    def add(v):
        for x in (v if isinstance(v, list) else [v]):
            if x is not None and int(x) not in eos:
                eos.append(int(x))

    gen_path = target_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    add(_token_id(tokenizer_json, tok_cfg.get("eos_token")))
    add(gen.get("eos_token_id"))
    add(tcfg.get("eos_token_id"))
    bos = gen.get("bos_token_id", tcfg.get("bos_token_id"))
    if tok_cfg.get("bos_token", "absent") is None or tok_cfg.get("add_bos_token") is False:
        bos = None  # the tokenizer adds no BOS (SmolLM2, Qwen): the runtime must not prepend one
    return eos, (int(bos) if bos is not None else None)


def _hybrid_keys(info: PairInfo) -> dict:
    """A linear-attention target runs on the paged runner (the plugin's paged Gated DeltaNet ops; batched)
    or the stateful hybrid one; its layout goes to the manifest."""
    if info.arch not in HYBRID_ARCHS:
        return {}
    from .qwen3_5 import hybrid_geometry

    return {"target_runner": "paged", "hybrid": hybrid_geometry(info.target_config)}


def check_default_block_size(value, block_size: int) -> int | str:
    """The runtime's rule (`ovdflash.manifest.parse_default_block_size`), as an ExportError."""
    try:
        return parse_default_block_size(value, block_size)
    except ValueError as exc:
        raise ExportError(str(exc)) from None


def check_compile_options(options: dict | None) -> dict:
    """Compile options for the manifest: string keys and values; a precision hint the runtime knows."""
    from ovdflash.ov.precision import resolve

    options = {str(k): str(v) for k, v in (options or {}).items()}
    try:  # the precision pair must be one the runtime can compile on some CPU
        resolve(options, None, "stateful", ("f32", "bf16", "f16"))
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    return options


def pair_manifest(info: PairInfo, block_size: int, default_block_size, eos: list[int], bos: int | None,
                  target_entry: dict, drafter_entry: dict, draft_vocab_size: int | None,
                  compile_options: dict) -> dict:
    """The manifest of a pair (docs/DESIGN.md); `*_entry` add weight_format, source and the like."""
    from .drafter import SHORT_BLOCKS_KEY

    dcfg = info.drafter_config
    if not eos:
        raise ExportError("the target defines no eos token")
    if dcfg.mask_token_id in eos:
        raise PairMismatchError(f"mask_token_id {dcfg.mask_token_id} is an eos token of the target")
    return {
        "format": FORMAT,
        "block_size": block_size,
        "default_block_size": default_block_size,
        # drafters trained on short blocks too draft k + 1 tokens; others the whole block
        "draft_pass": "exact" if float(dcfg.extra.get(SHORT_BLOCKS_KEY, 0) or 0) > 0 else "full_block",
        "target_layer_ids": list(dcfg.target_layer_ids),
        "mask_token_id": dcfg.mask_token_id,
        "eos_token_ids": eos,
        "bos_token_id": bos,
        "vocab_size": info.vocab_size,
        "max_position_embeddings": int(info.target_config["max_position_embeddings"]),
        "target": {"arch": info.arch, "num_layers": info.num_layers, "hidden_size": info.hidden_size,
                   **target_entry},
        **_hybrid_keys(info),
        "drafter": {"kind": dcfg.kind, "num_layers": dcfg.num_hidden_layers, "hidden_size": dcfg.hidden_size,
                    **drafter_entry},
        "draft_vocab_size": draft_vocab_size,
        **({"compile_options": compile_options} if compile_options else {}),
        "versions": _versions(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def move_into_place(work: Path, out_dir: Path, manifest: dict) -> None:
    """Record the IR checksums, write the manifest and rename the finished `work` to `out_dir`."""
    manifest["files"] = checksum_files(work)  # `ovdflash verify` and the default model check them
    (work / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)  # a previous ovdflash export (checked before the export began)
    work.chmod(0o755)  # mkdtemp makes it private
    work.rename(out_dir)

