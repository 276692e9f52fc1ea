"""Fetching a Hugging Face model repo into the local Hugging Face cache, through huggingface_hub.

`fetch` requests only the files hebrus reads (`FETCHED`, at the repo's top level): pickles, code and
every other file are never requested; `cached` finds such a snapshot without any request. HF_ENDPOINT,
HF_HUB_OFFLINE, HF_HOME / HF_HUB_CACHE and the token apply as huggingface_hub reads them; every
failure is `InvalidInput` naming the repo.
"""
from __future__ import annotations

import os
import re
import sys
import warnings
from pathlib import Path
from typing import NoReturn

from hebrus.errors import InvalidInput
from hebrus.show import escaped, shown

CONFIG = "config.json"

# What a fetch may request (huggingface_hub's allow_patterns). Its patterns are fnmatch patterns
# whose `*` also matches '/', so "*.safetensors" alone would take "sub/x.safetensors" as well:
# `IN_FOLDERS` leaves out everything below a folder. A checkpoint's files sit at the top level
# (an index names its shards by plain file name), so nothing hebrus reads is lost.
FETCHED = (CONFIG, "generation_config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
           "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
           "chat_template.jinja", "chat_template.json")
IN_FOLDERS = ("*/*",)

# Weight formats a repo may hold instead of safetensors; named in the refusal, never fetched.
OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".h5", ".msgpack", ".gguf", ".onnx")

_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*(/[A-Za-z0-9_][A-Za-z0-9_.+-]*)*")


def fetch(repo_id: str, revision: str | None = None, progress: bool = True) -> Path:
    """The local snapshot folder of `repo_id` (Org/Name) at `revision` (a branch, tag or commit
    hash; None: main), downloading what is missing of its `FETCHED` files into the cache.

    Online, the repo's file list is read first (one API call) and a repo without top-level
    safetensors weights or without config.json is refused before anything is downloaded; a hub
    that cannot be reached (or fails: 5xx, 429) leaves the cached snapshot, with a warning, when
    there is one. With HF_HUB_OFFLINE set, the cached snapshot is returned and nothing is
    requested. `progress`: huggingface_hub's own progress bars on stderr (as it shows them);
    False: none. InvalidInput for a malformed repo id or revision, a repo or revision the hub
    does not have, a hub that cannot be reached or answers an error, a refused repo, or
    (offline) one not in the cache."""
    repo_id, revision = check_repo_id(repo_id), _check_revision(revision)
    constants = _hub_constants(repo_id)
    cache = Path(constants.HF_HUB_CACHE)
    storage = _storage(repo_id, revision, cache)
    if not _offline(constants):
        return _snapshot(repo_id, _fetched(repo_id, revision, progress, constants.ENDPOINT), storage)
    folder = _cached(repo_id, revision)
    if folder is None:
        raise InvalidInput(f"{_named(repo_id, revision)} is not in the local Hugging Face cache ({cache}), or "
                           f"only partly, and downloads are off (HF_HUB_OFFLINE is set): unset HF_HUB_OFFLINE "
                           f"to download it, or pass a checkpoint folder")
    return _snapshot(repo_id, folder, storage)


def cached(repo_id: str, revision: str | None = None) -> Path | None:
    """The snapshot folder of `repo_id` at `revision` when the cache holds its `FETCHED` files,
    found without any request; None when it does not. (huggingface_hub's own cache look-up,
    `snapshot_download(local_files_only=True)` without patterns, refuses such a snapshot: the
    file list it cached names the files a fetch leaves out.)"""
    repo_id, revision = check_repo_id(repo_id), _check_revision(revision)
    constants = _hub_constants(repo_id)
    storage = _storage(repo_id, revision, Path(constants.HF_HUB_CACHE))
    folder = _cached(repo_id, revision)
    return None if folder is None else _snapshot(repo_id, folder, storage)


def check_repo_id(repo_id) -> str:
    """`repo_id` if it is a Hugging Face model repo id of the form Org/Name (the rules of the
    local cache's look-up, and the hub's own); InvalidInput otherwise, before any request."""
    text = repo_id if isinstance(repo_id, str) else None
    if (text is None or not _REPO_ID.fullmatch(text) or ".." in text or "--" in text or len(text) > 96
            or text.endswith((".", "-"))):
        raise InvalidInput(f"{shown(repo_id)} is not a Hugging Face repo id: it must be Org/Name, two parts of "
                           f"letters, digits, '_', '.' and '-' that start with a letter or digit, with no '..' "
                           f"or '--', not ending in '.' or '-', at most 96 characters in all")
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:
        return text
    try:
        validate_repo_id(text)
    except HFValidationError as exc:
        raise InvalidInput(f"{shown(text)} is not a valid Hugging Face repo id: {exc}") from None
    return text


def _check_revision(revision) -> str | None:
    if revision is None:
        return None
    if (not isinstance(revision, str) or not _REVISION.fullmatch(revision) or ".." in revision
            or len(revision) > 255):
        raise InvalidInput(f"revision {shown(revision)} is not a branch, tag or commit hash: it must be parts of "
                           f"letters, digits, '_', '.', '+' and '-' joined by '/', each starting with a letter, "
                           f"digit or '_', with no '..', at most 255 characters (or None: main)")
    return revision


def _hub_constants(repo_id: str):
    """huggingface_hub's settings module, read at each call (it reads the environment once, when
    it is first imported)."""
    try:
        from huggingface_hub import constants
    except ImportError:
        raise InvalidInput(f"downloading {repo_id} needs huggingface_hub, which is not installed "
                           f"(pip install huggingface_hub)") from None
    return constants


def _offline(constants) -> bool:
    is_offline = getattr(constants, "is_offline_mode", None)
    return bool(is_offline()) if callable(is_offline) else bool(constants.HF_HUB_OFFLINE)


def _storage(repo_id: str, revision: str | None, cache: Path) -> Path:
    """The repo's folder in the cache, once its ref for `revision` is safe to read (a FIFO there
    would block huggingface_hub's read of it forever)."""
    from huggingface_hub.file_download import repo_folder_name
    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    ref = storage / "refs" / (revision or "main")
    if os.path.lexists(ref) and not os.path.isfile(ref):
        raise InvalidInput(f"{ref} is not a regular file; the cache entry of {repo_id} is damaged")
    return storage


def _cached(repo_id: str, revision: str | None) -> Path | None:
    """The complete cached snapshot, from the cache alone (no request); None if there is none."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import LocalEntryNotFoundError
    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True,
                                      allow_patterns=list(FETCHED), ignore_patterns=list(IN_FOLDERS)))
    except LocalEntryNotFoundError:
        return None


def _fetched(repo_id: str, revision: str | None, progress: bool, endpoint: str) -> Path:
    """The snapshot once its missing files are downloaded, after its file list is checked. A hub
    that cannot be reached (or fails: 5xx, 429) leaves the cached snapshot, when there is one."""
    try:
        paths = _listing(repo_id, revision)
    except Exception as exc:
        folder = _cached(repo_id, revision) if _unreachable(exc) else None
        if folder is None:
            _raise_failure(exc, repo_id, revision, endpoint)
        warnings.warn(f"hebrus: {endpoint} is unavailable ({_reason(exc)}); using the cached snapshot of "
                      f"{_named(repo_id, revision)}", stacklevel=3)
        return folder
    _check_listing(repo_id, paths, endpoint)
    return _download(repo_id, revision, progress, endpoint)


def _listing(repo_id: str, revision: str | None) -> list[str]:
    """The paths of every file in the repo at `revision`: one API call, nothing downloaded."""
    from huggingface_hub import HfApi
    info = HfApi().model_info(repo_id, revision=revision)
    return [sibling.rfilename for sibling in info.siblings or []]


def _check_listing(repo_id: str, paths: list[str], endpoint: str) -> None:
    """InvalidInput unless the repo has safetensors weights and a config.json at its top level."""
    top = [p for p in paths if "/" not in p and "\\" not in p]
    if not any(p.endswith(".safetensors") for p in top):
        nested = [p for p in paths if p.endswith(".safetensors")]
        others = [p for p in top if p.lower().endswith(OTHER_WEIGHTS)]
        if nested:
            raise InvalidInput(f"{repo_id} has safetensors weights only below its top level ({_names(nested)}); "
                               f"hebrus loads a checkpoint from the top level, and files in folders are never "
                               f"fetched")
        if others:
            raise InvalidInput(f"hebrus loads only safetensors weights; {repo_id} has only {_names(others)}, "
                               f"which are never fetched")
        raise InvalidInput(f"{repo_id} on {endpoint} has no safetensors weights at its top level (its files: "
                           f"{_names(paths) or 'none'}); hebrus loads only safetensors checkpoints")
    if CONFIG not in top:
        raise InvalidInput(f"{repo_id} has no {CONFIG} at its top level; hebrus needs one beside the weights")


def _download(repo_id: str, revision: str | None, progress: bool, endpoint: str) -> Path:
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(FETCHED),
                                      ignore_patterns=list(IN_FOLDERS), tqdm_class=None if progress else _quiet()))
    except Exception as exc:
        _raise_failure(exc, repo_id, revision, endpoint)


def _raise_failure(exc: Exception, repo_id: str, revision: str | None, endpoint: str) -> NoReturn:
    failure = _failure(exc, repo_id, revision, endpoint)
    if failure is None:
        raise exc
    raise failure from None


def _snapshot(repo_id: str, folder: Path, storage: Path) -> Path:
    """`folder`, once it is a snapshot inside the repo's cache folder with what a load needs."""
    if (storage / "snapshots").resolve() not in folder.resolve().parents:
        raise InvalidInput(f"the cache entry of {repo_id} points outside {storage / 'snapshots'}: {folder}")
    lacking = [what for what, held in ((CONFIG, (folder / CONFIG).is_file()),
                                       ("safetensors weights", any(p.name.endswith(".safetensors") and p.is_file()
                                                                   for p in folder.iterdir())))
               if not held]
    if lacking:
        raise InvalidInput(f"the snapshot of {repo_id} in the cache ({folder}) lacks {' and '.join(lacking)}; "
                           f"hebrus loads a config.json with safetensors weights")
    return folder


def _failure(exc: Exception, repo_id: str, revision: str | None, endpoint: str) -> InvalidInput | None:
    """The InvalidInput that says why a request about `repo_id` failed; None for an error that
    is not the hub's or the network's (a full disk stays an OSError)."""
    from huggingface_hub import utils
    named = _named(repo_id, revision)
    if isinstance(exc, utils.GatedRepoError):
        return InvalidInput(f"{repo_id} is gated on {endpoint}: accept its terms there and use a token that may "
                            f"read it (HF_TOKEN, or hf auth login)")
    if isinstance(exc, utils.RepositoryNotFoundError):
        return InvalidInput(f"{endpoint} has no model repo {repo_id} (or it is private: use a token that may read "
                            f"it, HF_TOKEN or hf auth login)")
    if isinstance(exc, utils.RevisionNotFoundError):
        return InvalidInput(f"{repo_id} on {endpoint} has no revision {shown(revision or 'main')}")
    if isinstance(exc, utils.OfflineModeIsEnabled):
        return InvalidInput(f"{named} cannot be downloaded: downloads are off (HF_HUB_OFFLINE is set)")
    if isinstance(exc, utils.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        return InvalidInput(f"{endpoint} answered HTTP {status} for {named}: {_reason(exc)}")
    if isinstance(exc, utils.LocalEntryNotFoundError):
        return InvalidInput(f"cannot download {named} from {endpoint}, and it is not in the local cache: "
                            f"{_reason(exc.__cause__ or exc)}")
    if isinstance(exc, _transport_errors()) or (isinstance(exc, OSError) and exc.errno is None):
        return InvalidInput(f"cannot download {named} from {endpoint}: {_reason(exc)}")
    return None


def _unreachable(exc: Exception) -> bool:
    """Did the hub not answer (the network, a timeout, a proxy), or fail (5xx, 429)?"""
    from huggingface_hub import utils
    if isinstance(exc, utils.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        return isinstance(status, int) and (status >= 500 or status == 429)
    return isinstance(exc, _transport_errors() + (utils.OfflineModeIsEnabled,))


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's own errors (connection refused, timeouts, proxies, redirects)."""
    found = []
    for module, name in (("httpx2", "HTTPError"), ("httpx", "HTTPError"), ("requests", "RequestException")):
        error = getattr(sys.modules.get(module), name, None)      # the client huggingface_hub uses is imported
        if isinstance(error, type):
            found.append(error)
    return tuple(found)


def _reason(exc: BaseException) -> str:
    """The first line of an error's message, escaped and cut short."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = escaped(lines[0] if lines else type(exc).__name__, lines=False)
    return text if len(text) <= 200 else text[:200] + "..."


def _named(repo_id: str, revision: str | None) -> str:
    return repo_id if revision is None else f"{repo_id} (revision {revision})"


def _names(paths: list[str], most: int = 6) -> str:
    text = ", ".join(shown(p) for p in paths[:most])
    return text + (f" and {len(paths) - most} more" if len(paths) > most else "")


def _quiet():
    """huggingface_hub's progress bar class, never shown."""
    from huggingface_hub.utils import tqdm

    class Quiet(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Quiet
