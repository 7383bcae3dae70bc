"""Model sources by Hugging Face hub id: `org/name[@revision][:FILE.gguf]` -> a local directory or file.

Contract:
- `resolve_source(spec, role, cache_dir=None) -> ModelSource`: an existing local path is returned
  as it is (`repo_id` None). Otherwise `spec` must be a hub id `org/name`, optionally with
  `@revision` (branch, tag or commit) and, for a GGUF target, `:FILE.gguf`; it is fetched with
  `huggingface_hub.snapshot_download` into the Hugging Face cache and the snapshot directory (or
  the GGUF file in it) is returned.
- Only what the export reads is fetched (`ALLOW_PATTERNS`: configs, tokenizer and chat template
  files, safetensors weights, a drafter's draft vocabulary, an OpenVINO export's IRs). Never `*.py`: a checkpoint's own code
  is never fetched, imported or run (the export reads weights with its own modules and calls
  transformers with `trust_remote_code=False`); never pickled `.bin` weights.
- The cache is `cache_dir`, else `HF_HUB_CACHE`, else `HF_HOME/hub`, else huggingface_hub's
  default, read when called. `HF_HUB_OFFLINE=1` (or `TRANSFORMERS_OFFLINE=1`), read when called,
  uses the cache only. An unreachable hub falls back to the cache, as huggingface_hub does.
- Every failure is a `HubError` (an `ExportError`) with one line naming the spec: not a path nor an
  id, not cached while offline or unreachable, no such repo or revision, gated, or a snapshot
  without the files the export needs.
- `stay_offline()`: from then on this process makes no hub request (the export proper never needs one).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import ExportError

ALLOW_PATTERNS = (
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja", "chat_template.json",
    "*.safetensors", "*.safetensors.index.json",
    "draft_vocab.json",
    # an OpenVINO export (optimum-intel's layout): its IR and tokenizer IRs (OpenVINO weights, not pickles)
    "openvino_model.xml", "openvino_model.bin",
    "openvino_tokenizer.xml", "openvino_tokenizer.bin", "openvino_detokenizer.xml", "openvino_detokenizer.bin",
)
_TRUE = {"1", "on", "yes", "true"}


class HubError(ExportError):
    """A model spec that names neither a local path nor a hub snapshot the export can read."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model spec lives on disk, and which hub snapshot it came from (None: a local path)."""

    path: Path
    repo_id: str | None = None
    commit: str | None = None

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path) if self.repo_id is None else f"{self.repo_id}@{self.commit}"


def offline() -> bool:
    """Whether hub requests are switched off (the environment now, or huggingface_hub at import)."""
    if any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_cache_dir(cache_dir=None) -> Path:
    """The cache a hub id resolves in: `cache_dir`, HF_HUB_CACHE, HF_HOME/hub, huggingface_hub's default."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def stay_offline() -> None:
    """No hub request from here on: for libraries that read the environment later, and for
    huggingface_hub, which read it at import."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        from huggingface_hub import constants
    except ImportError:
        return
    constants.HF_HUB_OFFLINE = True


def parse_hub_spec(spec: str) -> tuple[str, str | None, str | None]:
    """`org/name[@revision][:FILE.gguf]` -> (repo_id, revision or None, gguf file or None);
    ValueError when it is not one."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    rest, gguf = spec, None
    if ":" in spec:
        rest, gguf = spec.split(":", 1)
        if not gguf.endswith(".gguf") or ".." in gguf:
            raise ValueError(f"after ':' a GGUF file in the repo (NAME.gguf) is expected, got {gguf!r}")
    repo_id, at, revision = rest.partition("@")
    if at and not revision:
        raise ValueError("an empty revision after '@'")
    revision = revision or None
    if repo_id.count("/") != 1:
        raise ValueError("not of the form org/name")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ValueError(str(exc).rstrip(".")) from None
    return repo_id, revision, gguf


def _patterns(gguf: str | None) -> list[str]:
    return [gguf] if gguf else list(ALLOW_PATTERNS)


def _check_snapshot(spec: str, role: str, snapshot: Path, gguf: str | None, cache: Path) -> Path:
    """The path the export reads; one line when the snapshot lacks it (a partial or pickle-only repo)."""
    if gguf:
        path = snapshot / gguf
        if not path.is_file():
            raise HubError(f"{spec}: the {role} snapshot in {cache} has no file {gguf}")
        return path
    if not (snapshot / "config.json").is_file():
        raise HubError(f"{spec}: the {role} snapshot in {cache} has no config.json (not a model repo, "
                       "or an incomplete download)")
    if not any(snapshot.glob("*.safetensors")) and not (snapshot / "openvino_model.xml").is_file():
        raise HubError(f"{spec}: the {role} snapshot in {cache} has no *.safetensors weights "
                       "(only safetensors are read, never pickled .bin weights)")
    return snapshot


def resolve_source(spec, role: str = "model", cache_dir=None) -> ModelSource:
    """A local path as it is, or a hub id's snapshot in the cache (see the module contract)."""
    if isinstance(spec, ModelSource):
        return spec
    text = os.fspath(spec)
    if not text.strip():
        raise HubError(f"the {role} is empty: give a local path or a Hugging Face id (org/name)")
    local = Path(text).expanduser()
    if local.exists():
        return ModelSource(local)
    if text.startswith((".", "/", "~", os.sep)):  # spelled as a path: say only that it is missing
        raise HubError(f"{role} {text!r}: no such file or directory")
    try:
        repo_id, revision, gguf = parse_hub_spec(text)
    except ValueError as exc:
        raise HubError(f"{role} {text!r}: no such file or directory, and not a Hugging Face id "
                       f"org/name[@revision][:FILE.gguf] ({exc})") from None
    cache = hub_cache_dir(cache_dir)
    is_offline = offline()

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    try:
        snapshot = Path(snapshot_download(repo_id, revision=revision, cache_dir=str(cache),
                                          allow_patterns=_patterns(gguf), local_files_only=is_offline))
    except LocalEntryNotFoundError:
        why = "offline: HF_HUB_OFFLINE=1" if is_offline else "unreachable"
        at = f" at revision {revision}" if revision else ""
        raise HubError(f"{repo_id}{at}: not in the Hugging Face cache (HF_HUB_CACHE={cache}) and the hub is "
                       f"{why}; download it on a machine with network or pass a local directory") from None
    except GatedRepoError:
        raise HubError(f"{repo_id}: a gated repo; accept its terms on the hub and log in "
                       "(`hf auth login` or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise HubError(f"{repo_id}: no revision {revision!r} on the hub") from None
    except RepositoryNotFoundError:
        raise HubError(f"{repo_id}: no such repo on the hub (or a private one: log in with "
                       "`hf auth login` or HF_TOKEN)") from None
    except HfHubHTTPError as exc:
        raise HubError(f"{repo_id}: the hub refused the download ({str(exc).splitlines()[0]})") from None
    path = _check_snapshot(text, role, snapshot, gguf, cache)
    return ModelSource(path, repo_id, snapshot.name)


def resolve_pair(target, drafter, cache_dir=None) -> tuple[Path, Path]:
    """The local paths of a (target, drafter) pair, each a local path or a hub id."""
    return resolve_source(target, "target", cache_dir).path, resolve_source(drafter, "drafter", cache_dir).path
