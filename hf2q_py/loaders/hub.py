"""Models named on the Hugging Face hub: what the user typed, which files a
model needs, and getting them with ``huggingface_hub`` (downloaded, or from
its cache when offline or when the hub cannot be reached).

Names, as mlx-lm, llama.cpp's ``-hf`` and Ollama take them:

- ``owner/name``: a model folder (config.json, safetensors, tokenizer, chat
  template; not the rest of the repo), or the repo's one GGUF model;
- ``owner/name:QUANT``: that quantization's GGUF file (case-insensitive;
  ``Q4`` picks ``Q4_K_M`` when it is the only ``Q4_*``), every part of a
  split GGUF;
- ``owner/name/path/file.gguf``: that file (and its other parts if split).

``HF_ENDPOINT``, ``HF_HOME``, ``HF_TOKEN`` and ``HF_HUB_OFFLINE`` work as
they do for ``huggingface_hub``. Every failure is a one-line
``ModelLoadError``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError, one_line

#: Files of a model folder that mlx-lm downloads (``mlx_lm.utils``), and spiece.model.
MODEL_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "spiece.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]
#: A split GGUF's part: ``<stem>-00001-of-00003.gguf`` (llama.cpp's gguf-split).
SPLIT_PART = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
#: A quantization's name inside a file name: Q4_K_M, IQ3_XXS, Q8_0, F16, BF16, ...
QUANT = re.compile(
    r"(?<![A-Za-z0-9])(I?Q\d+(?:_[A-Za-z0-9]+)*|BF16|FP?16|FP?32)(?![A-Za-z0-9])", re.IGNORECASE
)
_QUANT_TEXT = re.compile(r"^[A-Za-z0-9_.\-]+$")
_HINT = "owner/name, owner/name:QUANT or owner/name/file.gguf"


@dataclass(frozen=True)
class HubName:
    """A model on the hub as typed: a repo, and a quantization or a file in it."""

    repo_id: str
    quant: str | None = None
    file: str | None = None

    def __str__(self) -> str:
        if self.file is not None:
            return f"{self.repo_id}/{self.file}"
        return self.repo_id + (f":{self.quant}" if self.quant else "")


@dataclass(frozen=True)
class GGUFModel:
    """One GGUF model in a repo: one file, or a split file's parts in order;
    ``quant`` is the quantization its name gives ("" when none)."""

    files: tuple[str, ...]
    quant: str


# -- names ------------------------------------------------------------------------------
def parse_source(source: str | Path) -> Path | HubName:
    """An existing local file or folder, else a hub name; neither is refused."""
    text = str(source)
    path = Path(text).expanduser()
    if path.exists():
        return path
    if text.startswith((".", "/", "~")) or "\\" in text:
        raise ModelLoadError(f"{text}: no such file or folder")
    name = _hub_name(text)
    if name is None:
        raise ModelLoadError(f"{text}: no such file or folder, and not a hub model name ({_HINT})")
    return name


def _hub_name(text: str) -> HubName | None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    rest, quant = text, None
    if ":" in text:
        rest, _, quant = text.rpartition(":")
        if not _QUANT_TEXT.match(quant):
            return None
    parts = rest.split("/")
    if len(parts) == 2:
        repo_id, file = rest, None
    elif len(parts) > 2 and quant is None and parts[-1].lower().endswith(".gguf") and all(parts[2:]):
        repo_id, file = "/".join(parts[:2]), "/".join(parts[2:])
    else:
        return None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return HubName(repo_id, quant, file)


def display_name(source: str | Path | None) -> str:
    """The name a model goes by (the server's model name): a hub name as
    typed, a file's name without ``.gguf``, a folder's name."""
    if source is None or str(source) == "":
        from .builtin import BUILTIN_FILE

        return BUILTIN_FILE.removesuffix(".gguf")
    path = Path(str(source)).expanduser()
    if not path.exists() and _hub_name(str(source)) is not None:
        return str(source)
    return path.name.removesuffix(".gguf") or str(source)


# -- choosing files ---------------------------------------------------------------------
def gguf_models(files: list[str]) -> list[GGUFModel]:
    """The GGUF models among a repo's files: each file, or each split file's
    parts together; vision projectors (``mmproj``) are not models."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for f in files:
        base = f.rsplit("/", 1)[-1]
        if not base.lower().endswith(".gguf") or "mmproj" in base.lower():
            continue
        m = SPLIT_PART.match(base)
        key = f[: len(f) - len(base)] + (m.group("stem") if m else base)
        groups.setdefault(key, []).append((int(m.group("no")) if m else 0, f))
    models = []
    for key, parts in sorted(groups.items()):
        found = QUANT.findall(key.rsplit("/", 1)[-1].removesuffix(".gguf"))
        models.append(GGUFModel(tuple(f for _, f in sorted(parts)), found[-1].upper() if found else ""))
    return models


def is_folder_repo(files: list[str]) -> bool:
    """A repo holding an mlx-lm / transformers model folder (config.json and safetensors)."""
    return "config.json" in files and any(f.endswith(".safetensors") for f in files)


def choose_gguf(name: HubName, files: list[str]) -> GGUFModel:
    """The GGUF model ``name`` picks from a repo's files, or a one-line refusal."""
    models = gguf_models(files)
    if name.file is not None:
        picked = [m for m in models if name.file in m.files]
        if not picked:
            raise ModelLoadError(f"{name.repo_id} has no file {name.file}; {_listing(models, name)}")
        return picked[0]
    if name.quant is not None:
        want = name.quant.upper()
        picked = [m for m in models if m.quant == want] or [
            m for m in models if m.quant.startswith(want + "_")
        ]
        if not picked:
            raise ModelLoadError(f"{name.repo_id} has no {want} GGUF file; {_listing(models, name)}")
        if len({m.quant for m in picked}) > 1:
            raise ModelLoadError(f"{name}: {want} matches several quantizations; {_listing(picked, name)}")
        if len(picked) > 1:
            files_named = ", ".join(m.files[0] for m in picked)
            raise ModelLoadError(
                f"{name}: several {picked[0].quant} files ({files_named}); name one as {name.repo_id}/FILE"
            )
        return picked[0]
    if len(models) == 1:
        return models[0]
    if not models:
        raise ModelLoadError(
            f"{name.repo_id} holds neither a model folder (config.json with safetensors) nor a GGUF file"
        )
    raise ModelLoadError(f"{name.repo_id} holds several GGUF models; {_listing(models, name)}")


def _listing(models: list[GGUFModel], name: HubName) -> str:
    if not models:
        return "it holds no GGUF file"
    if all(m.quant for m in models) and len({m.quant for m in models}) == len(models):
        labels = ", ".join(m.quant for m in models)
        return f"choose one of {labels} (as {name.repo_id}:{models[0].quant})"
    return "choose a file: " + ", ".join(f"{name.repo_id}/{m.files[0]}" for m in models)


# -- getting files ----------------------------------------------------------------------
@dataclass(frozen=True)
class RepoFiles:
    """A repo's file names, as the hub lists them, or (``cached``: why) as
    the local cache holds them."""

    files: list[str]
    cached: str | None = None


def resolve(
    source: str | Path, *, offline: bool = False, progress: bool = False, patterns: list[str] | None = None
) -> Path:
    """A local path for ``source``: a local file or folder as it is, else the
    hub model's folder or GGUF file (first part of a split one), downloaded
    into the Hugging Face cache unless already there. ``offline`` (or
    ``HF_HUB_OFFLINE=1``) uses the cache only; ``progress`` shows
    ``huggingface_hub``'s progress bars on stderr; ``patterns`` (a folder's
    files to get) default to a model's."""
    found = parse_source(source)
    if isinstance(found, Path):
        return found
    repo = repo_files(found, offline or _offline_env())
    if _is_folder(found, repo, patterns):
        return _folder(found, patterns or MODEL_PATTERNS, repo.cached, progress)
    return [_file(found, f, repo.cached, progress) for f in _choose(found, repo).files][0]


def check(source: str | Path, *, offline: bool = False, patterns: list[str] | None = None) -> None:
    """Refuse, without downloading, a hub name that names nothing: a missing
    repo, file or quantization, or (from the cache) a model not all there.
    ``patterns``: the name is a folder of these files (as for ``resolve``)."""
    found = parse_source(source)
    if isinstance(found, Path):
        return
    repo = repo_files(found, offline or _offline_env())
    if _is_folder(found, repo, patterns):
        if repo.cached is not None:
            _folder(found, patterns or MODEL_PATTERNS, repo.cached, False)
        return
    model = _choose(found, repo)
    if repo.cached is not None:
        for f in model.files:
            _file(found, f, repo.cached, False)


def _is_folder(name: HubName, repo: RepoFiles, patterns: list[str] | None) -> bool:
    return name.quant is None and name.file is None and (patterns is not None or is_folder_repo(repo.files))


def _choose(name: HubName, repo: RepoFiles) -> GGUFModel:
    """``choose_gguf``, saying so when only the cache was looked at."""
    try:
        return choose_gguf(name, repo.files)
    except ModelLoadError as e:
        if repo.cached is None:
            raise
        raise ModelLoadError(
            f"{name}: not in the local Hugging Face cache ({_cache_dir()}), {repo.cached}"
        ) from e


def repo_files(name: HubName, offline: bool) -> RepoFiles:
    """The repo's files as the hub lists them, or, offline or when the hub
    cannot be reached, as the local cache holds them."""
    why = _OFF
    if not offline:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError

        try:
            return RepoFiles([s.rfilename for s in HfApi().model_info(name.repo_id).siblings or []])
        except HfHubHTTPError as e:
            if e.response is None or e.response.status_code < 500:
                raise _failure(name, e, None) from None
            why = f"and the hub at {_endpoint()} answers {e.response.status_code}"
        except Exception as e:  # the transport failed: no answer from the hub
            why = f"and the hub at {_endpoint()} cannot be reached ({one_line(e, 120)})"
    cached = _cached_files(name.repo_id)
    if cached is None:
        raise ModelLoadError(f"{name}: not in the local Hugging Face cache ({_cache_dir()}), {why}")
    return RepoFiles(cached, why)


_OFF = "and downloads are off (--offline or HF_HUB_OFFLINE=1)"


def _cached_files(repo_id: str) -> list[str] | None:
    """Files of the cached snapshot of the repo's main revision, if any."""
    from huggingface_hub.file_download import repo_folder_name

    storage = Path(_cache_dir()) / repo_folder_name(repo_id=repo_id, repo_type="model")
    try:
        commit = (storage / "refs" / "main").read_text().strip()
    except OSError:
        return None
    snapshot = storage / "snapshots" / commit
    if not snapshot.is_dir():
        return None
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


def _folder(name: HubName, patterns: list[str], cached: str | None, progress: bool) -> Path:
    """The repo's files matching ``patterns``, downloaded unless ``cached``
    says the cache alone is to be read (and why)."""
    from huggingface_hub import snapshot_download

    try:
        with _quiet(not progress):
            path = snapshot_download(
                name.repo_id,
                allow_patterns=patterns,
                local_files_only=cached is not None,
                tqdm_class=_bars(progress),
            )
    except Exception as e:
        raise _failure(name, e, cached) from None
    return Path(path)


def _file(name: HubName, filename: str, cached: str | None, progress: bool) -> Path:
    """One file of the repo, downloaded unless ``cached`` (as for ``_folder``)."""
    from huggingface_hub import hf_hub_download

    try:
        with _quiet(not progress):
            path = hf_hub_download(
                name.repo_id, filename, local_files_only=cached is not None, tqdm_class=_bars(progress)
            )
    except Exception as e:
        raise _failure(name, e, cached, filename) from None
    return Path(path)


@contextmanager
def _quiet(quiet: bool) -> Iterator[None]:
    """Without progress bars, also without ``huggingface_hub``'s warnings
    (a resumed download's): stderr keeps to hf2q-py's own lines."""
    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    if quiet:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _failure(name: HubName, e: Exception, cached: str | None, filename: str | None = None) -> ModelLoadError:
    """One line for what ``huggingface_hub`` raised (``cached``: why only the cache was read)."""
    from huggingface_hub import errors

    login = "log in with `hf auth login` or set HF_TOKEN"
    if isinstance(e, errors.GatedRepoError):
        return ModelLoadError(
            f"{name.repo_id} is a gated model: accept its terms at {_endpoint()}/{name.repo_id} and {login}"
        )
    if isinstance(e, errors.RepositoryNotFoundError):
        return ModelLoadError(
            f"{name.repo_id}: no such model on the hub ({_endpoint()}), or it is private: {login}"
        )
    if isinstance(e, errors.RevisionNotFoundError):
        return ModelLoadError(f"{name.repo_id}: the hub has no main revision of this repo")
    if isinstance(e, errors.RemoteEntryNotFoundError):
        return ModelLoadError(f"{name.repo_id} has no file {filename}")
    if isinstance(e, errors.LocalEntryNotFoundError):
        what = f"{name.repo_id}/{filename}" if filename else str(name)
        why = cached or "and the hub cannot be reached"
        return ModelLoadError(
            f"{what}: not (completely) in the local Hugging Face cache ({_cache_dir()}), {why}"
        )
    if isinstance(e, errors.HfHubHTTPError) and e.response is not None:
        status = e.response.status_code
        if status in (401, 403):
            return ModelLoadError(f"{name.repo_id}: the hub refused access ({status}): {login}")
        return ModelLoadError(f"{name}: the hub at {_endpoint()} answered {status} (try again later)")
    return ModelLoadError(f"{name}: download failed: {one_line(e, 200)}")


# -- huggingface_hub's settings -----------------------------------------------------------
def _offline_env() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _bars(progress: bool) -> Any:
    """The progress bar class for ``huggingface_hub``: tqdm on stderr, shown or not."""
    from tqdm import tqdm

    class Bars(tqdm):
        def __init__(self, *args: Any, **kw: Any) -> None:
            kw["disable"] = not progress
            super().__init__(*args, **kw)

    return Bars
