"""A loopback Hugging Face Hub for tests: repos served from local folders at HF_ENDPOINT=server.url.

It answers what huggingface_hub's `model_info`, `snapshot_download` and `hf_hub_download` ask, over
plain HTTP (no Xet headers, so hf_xet stays unused), with the hub's 404s (`X-Error-Code`), and
records every request it receives, so a test can tell what was and was not asked for.
"""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".h5", ".msgpack", ".gguf", ".onnx")
POINTER_SIZE = 134                              # bytes of a git-lfs pointer file


@dataclass
class Repo:
    """A repo's files at one commit, read when it is added."""
    files: dict[str, bytes]
    sha: str
    branches: tuple[str, ...] = ("main",)
    blobs: dict[str, str] = field(init=False)                # path: git blob sha1

    def __post_init__(self):
        self.blobs = {p: hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() for p, data in self.files.items()}

    def has(self, revision: str) -> bool:
        return revision in self.branches or revision == self.sha

    def entry(self, path: str) -> dict:
        data = self.files[path]
        out = {"type": "file", "oid": self.blobs[path], "size": len(data), "path": path}
        if path.endswith(LFS):
            out["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": POINTER_SIZE}
        return out

    def folders(self) -> set[str]:
        return {"/".join(p.split("/")[:i]) for p in self.files for i in range(1, p.count("/") + 1)}


def read_repo(folder: Path, branches: tuple[str, ...] = ("main",)) -> Repo:
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    digest = hashlib.sha1()
    for path, data in files.items():
        digest.update(path.encode() + b"\0" + hashlib.sha256(data).digest())
    return Repo(files, digest.hexdigest(), branches)


class HubServer:
    """The hub on 127.0.0.1 at a free port, served from a thread; a context manager.

    `add(repo_id, folder)` serves a folder's files as a model repo; `requests` lists every
    (method, path) received, the path percent-decoded, its query kept; `fail` set to a status code
    answers every request with it (a hub that is down)."""

    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.fail: int | None = None
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self._httpd.block_on_close = False
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def add(self, repo_id: str, folder: Path, branches: tuple[str, ...] = ("main",)) -> str:
        """Serve `folder` as the model repo `repo_id`; its commit hash."""
        repo = read_repo(Path(folder), branches)
        self.repos[repo_id] = repo
        return repo.sha

    def record(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))

    def paths(self) -> list[str]:
        with self._lock:
            return [path for _, path in self.requests]

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    def start(self) -> "HubServer":
        self._thread.start()
        return self

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            self._answer(body=True)

        def do_HEAD(self):
            self._answer(body=False)

        def log_message(self, *args):
            pass

        def _answer(self, body: bool) -> None:
            url = urlsplit(self.path)
            parts = [unquote(p) for p in url.path.split("/")[1:]]
            hub.record(self.command, "/" + "/".join(parts) + (f"?{url.query}" if url.query else ""))
            if hub.fail is not None:
                return self._send(hub.fail, b'{"error": "the hub is down"}', body, {"X-Error-Message": "down"})
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                return self._api(parts[2] + "/" + parts[3], parts[4:], query, body)
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]), body)
            self._send(404, b"Not Found", body)

        def _api(self, repo_id: str, rest: list[str], query: dict, body: bool) -> None:
            repo = self._repo(repo_id, body)
            if repo is None:
                return
            if not rest or (rest[0] == "revision" and len(rest) == 2):
                if not self._revision(repo, rest[1] if rest else "main", body):
                    return
                return self._json(_info(repo_id, repo, query.get("blobs") == "true"), body)
            if rest[0] == "tree" and len(rest) >= 2:
                if not self._revision(repo, rest[1], body):
                    return
                under = "/".join(rest[2:])
                if under and under not in repo.folders():
                    return self._missing(repo, body)
                return self._json(_tree(repo, under, query.get("recursive", "").lower() in ("1", "true")), body)
            self._send(404, b"Not Found", body)

        def _resolve(self, repo_id: str, revision: str, path: str, body: bool) -> None:
            repo = self._repo(repo_id, body)
            if repo is None or not self._revision(repo, revision, body):
                return
            if path not in repo.files:
                return self._missing(repo, body)
            data = repo.files[path]
            headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{repo.blobs[path]}"', "Accept-Ranges": "bytes",
                       "Content-Type": "application/octet-stream"}
            if path.endswith(LFS):
                sha256 = hashlib.sha256(data).hexdigest()
                headers.update({"ETag": f'"{sha256}"', "X-Linked-Etag": f'"{sha256}"', "X-Linked-Size": str(len(data))})
            start = _range_start(self.headers.get("Range"), len(data))
            if start:
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                return self._send(206, data[start:], body, headers)
            self._send(200, data, body, headers)

        def _repo(self, repo_id: str, body: bool) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._send(404, b'{"error": "Repository not found"}', body,
                           {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})
            return repo

        def _revision(self, repo: Repo, revision: str, body: bool) -> bool:
            if repo.has(revision):
                return True
            message = f"Invalid rev id: {revision}"
            self._send(404, json.dumps({"error": message}).encode(), body,
                       {"X-Error-Code": "RevisionNotFound", "X-Error-Message": message})
            return False

        def _missing(self, repo: Repo, body: bool) -> None:
            self._send(404, b'{"error": "Entry not found"}', body,
                       {"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found",
                        "X-Repo-Commit": repo.sha})

        def _json(self, value, body: bool) -> None:
            self._send(200, json.dumps(value).encode(), body, {"Content-Type": "application/json"})

        def _send(self, status: int, data: bytes, body: bool, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

    return Handler


def _info(repo_id: str, repo: Repo, blobs: bool) -> dict:
    """What GET /api/models/{repo_id}[/revision/{revision}] answers (the fields huggingface_hub reads)."""
    siblings = []
    for path in repo.files:
        sibling = {"rfilename": path}
        if blobs:
            entry = repo.entry(path)
            sibling.update(size=entry["size"], blobId=entry["oid"])
            if "lfs" in entry:
                sibling["lfs"] = {"size": entry["size"], "sha256": entry["lfs"]["oid"], "pointerSize": POINTER_SIZE}
        siblings.append(sibling)
    return {"_id": repo.sha[:24], "id": repo_id, "modelId": repo_id, "author": repo_id.split("/")[0],
            "sha": repo.sha, "private": False, "disabled": False, "gated": False, "tags": [], "downloads": 0,
            "likes": 0, "lastModified": "2025-01-01T00:00:00.000Z", "createdAt": "2025-01-01T00:00:00.000Z",
            "siblings": siblings}


def _tree(repo: Repo, under: str, recursive: bool) -> list[dict]:
    """What GET /api/models/{repo_id}/tree/{revision}[/{path}] answers: one page, no Link header."""
    prefix = under + "/" if under else ""

    def listed(path: str) -> bool:
        return path.startswith(prefix) and (recursive or "/" not in path[len(prefix):])

    folders = [{"type": "directory", "oid": hashlib.sha1(f.encode()).hexdigest(), "size": 0, "path": f}
               for f in sorted(repo.folders()) if listed(f)]
    return folders + [repo.entry(p) for p in repo.files if listed(p)]


def _range_start(header: str | None, size: int) -> int:
    """The first byte a `Range: bytes=N-` header asks for (0 for none or anything else)."""
    if not header or not header.startswith("bytes=") or not header.endswith("-"):
        return 0
    try:
        start = int(header[len("bytes="):-1])
    except ValueError:
        return 0
    return start if 0 < start < size else 0
