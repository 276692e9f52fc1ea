"""hebrus.hub.fetch against a loopback hub (`hub_server`).

huggingface_hub reads HF_ENDPOINT, HF_HUB_OFFLINE and HF_HOME once, when it is imported, so each
fetch runs in a fresh Python process with its own environment and its own HF_HOME.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hebrus
from hebrus import hub
from conftest import PATIENCE
from hub_server import HubServer

# One line of JSON per call: {"path": ...} or {"error": ...}; each call's stderr after a marker.
RUNNER = """
import json, sys
from hebrus import hub
from hebrus.errors import InvalidInput
for number, (repo_id, revision, progress) in enumerate(json.loads(sys.argv[1])):
    print(f"--- call {number}", file=sys.stderr, flush=True)
    try:
        print(json.dumps({"path": str(hub.fetch(repo_id, revision, progress))}), flush=True)
    except InvalidInput as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
    sys.stderr.flush()
"""

# What the served checkpoint holds beyond the model's own config.json and model.safetensors.
READ = ("tokenizer.json", "tokenizer_config.json")
NEVER = ("pytorch_model.bin", "modeling_x.py", "README.md", "sub/x.safetensors")


@pytest.fixture(scope="module")
def checkpoint(tiny, tmp_path_factory):
    """The tiny model's checkpoint with tokenizer files, a pickle, code, a card and weights in a
    subfolder: what a repo on the hub may hold."""
    from tokenizers import Tokenizer, models
    folder = tmp_path_factory.mktemp("repo") / "tiny"
    tiny.save(folder)
    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04\x95\x00never unpickled")
    (folder / "modeling_x.py").write_text("raise SystemExit('never run')\n")
    (folder / "README.md").write_text("# tiny\n")
    (folder / "sub").mkdir()
    shutil.copyfile(folder / "model.safetensors", folder / "sub" / "x.safetensors")
    return folder


@pytest.fixture
def server(checkpoint, tmp_path):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copyfile(checkpoint / "config.json", pickled / "config.json")
    shutil.copyfile(checkpoint / "pytorch_model.bin", pickled / "pytorch_model.bin")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copyfile(checkpoint / "model.safetensors", bare / "model.safetensors")
    nested = tmp_path / "nested"
    (nested / "sub").mkdir(parents=True)
    shutil.copyfile(checkpoint / "config.json", nested / "config.json")
    shutil.copyfile(checkpoint / "model.safetensors", nested / "sub" / "model.safetensors")
    with HubServer() as hub_server:
        hub_server.add("Org/Tiny", checkpoint)
        hub_server.add("Org/Pickled", pickled)
        hub_server.add("Org/Bare", bare)
        hub_server.add("Org/Nested", nested)
        yield hub_server


def fetched(home, endpoint: str, *calls, offline: bool = False, **more: str) -> tuple[list[dict], list[str]]:
    """Run `hub.fetch(repo_id, revision, progress)` for each call in one fresh process whose
    HF_HOME is `home` (and environment `more`); the answers and each call's stderr."""
    env = {k: v for k, v in os.environ.items()
           if not k.upper().startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TQDM_"))
           and k.upper() not in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")}
    env.update(HF_HOME=str(home), HF_ENDPOINT=endpoint, NO_PROXY="127.0.0.1", no_proxy="127.0.0.1",
               HF_HUB_ETAG_TIMEOUT=str(int(PATIENCE)), HF_HUB_DOWNLOAD_TIMEOUT=str(int(PATIENCE)))
    env.update(more)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run([sys.executable, "-c", RUNNER, json.dumps([list(c) for c in calls])], env=env,
                          capture_output=True, text=True, timeout=PATIENCE)
    assert done.returncode == 0, done.stderr
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(answers) == len(calls), done.stderr
    return answers, done.stderr.split("--- call ")[1:]


def requested(server: HubServer, name: str) -> list[str]:
    return [path for path in server.paths() if name in path]


def test_fetch_downloads_only_what_hebrus_reads(server, checkpoint, tiny, tmp_path, monkeypatch):
    home = tmp_path / "home"
    answers, stderr = fetched(home, server.url, ("Org/Tiny", None, False), ("Org/Tiny", None, True))
    first, second = (Path(a["path"]) for a in answers)
    sha = server.repos["Org/Tiny"].sha
    assert first == second == home / "hub" / "models--Org--Tiny" / "snapshots" / sha
    assert (home / "hub" / "models--Org--Tiny" / "refs" / "main").read_text() == sha
    assert sorted(p.name for p in first.iterdir()) == sorted(("config.json", "model.safetensors") + READ)
    for name in ("config.json", "model.safetensors") + READ:
        assert (first / name).read_bytes() == (checkpoint / name).read_bytes()
    loaded = hebrus.load(first)
    mine, theirs = dict(loaded.named_parameters()), dict(tiny.named_parameters())
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    # found again from the cache alone, by this process's huggingface_hub pointed at that cache
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub.cached("Org/Tiny") == hub.fetch("Org/Tiny") == first
    assert hub.cached("Org/Pickled") is None
    for name in NEVER:
        assert not requested(server, name), server.requests
    # each file fetched once: the second fetch found them all in the cache
    assert len([r for r in server.requests if r[0] == "GET" and "/resolve/" in r[1]]) == 2 + len(READ)
    assert "4/4" not in stderr[0] and "4/4" in stderr[1]           # the bar counting the 4 files


def test_offline_fetch_returns_the_cached_snapshot_without_a_request(server, tmp_path):
    home = tmp_path / "home"
    [online], _ = fetched(home, server.url, ("Org/Tiny", None, False))
    server.clear()
    [offline], _ = fetched(home, server.url, ("Org/Tiny", None, False), offline=True)
    assert offline == online and "path" in online
    assert server.requests == []


def test_offline_and_not_cached_is_refused(server, tmp_path):
    cache = tmp_path / "elsewhere"                  # HF_HUB_CACHE, not HF_HOME/hub
    [answer], _ = fetched(tmp_path / "home", server.url, ("Org/Tiny", None, False), offline=True,
                          HF_HUB_CACHE=str(cache))
    assert "Org/Tiny" in answer["error"] and "not in the local Hugging Face cache" in answer["error"]
    assert "HF_HUB_OFFLINE" in answer["error"] and f"({cache})" in answer["error"]
    assert server.requests == []


def test_an_unknown_repo_or_revision_is_refused(server, tmp_path):
    answers, _ = fetched(tmp_path / "home", server.url, ("Org/Absent", None, False), ("Org/Tiny", "nope", False))
    absent, revision = (a["error"] for a in answers)
    assert "Org/Absent" in absent and server.url in absent and "no model repo" in absent
    assert "Org/Tiny" in revision and "'nope'" in revision and server.url in revision
    assert not requested(server, "/resolve/")


def test_a_repo_without_safetensors_or_config_is_refused_before_any_download(server, tmp_path):
    home = tmp_path / "home"
    answers, _ = fetched(home, server.url, ("Org/Pickled", None, False), ("Org/Bare", None, False),
                       ("Org/Nested", None, False))
    pickled, bare, nested = (a["error"] for a in answers)
    assert "only safetensors" in pickled and "'pytorch_model.bin'" in pickled and "never fetched" in pickled
    assert "Org/Pickled" in pickled
    assert "Org/Bare" in bare and "config.json" in bare
    assert "Org/Nested" in nested and "'sub/model.safetensors'" in nested and "top level" in nested
    assert not requested(server, "/resolve/") and not requested(server, "/tree/")
    assert not list(home.glob("hub/models--*/snapshots/*"))


@pytest.mark.parametrize("repo_id, revision", [
    ("../x", None), ("a/b/c", None), ("Org", None), ("Org/../x", None), ("/Org/Name", None), ("Org/Na--me", None),
    ("Org/Name.", None), ("Org/Name.git", None), ("Org-/Name", None), ("", None), ("Org/" + "n" * 96, None),
    ("Org/Tiny", "../../x"), ("Org/Tiny", "main/"), ("Org/Tiny", ".hidden"), ("Org/Tiny", ""),
])
def test_a_bad_repo_id_or_revision_is_refused_before_any_request(repo_id, revision):
    expected = ("is not a branch, tag or commit hash" if revision is not None
                else "is not a (valid )?Hugging Face repo id")
    with pytest.raises(hebrus.InvalidInput, match=expected):
        hub.fetch(repo_id, revision)


def test_bad_names_make_no_request(server, tmp_path):
    answers, _ = fetched(tmp_path / "home", server.url, ("../x", None, False), ("a/b/c", None, False),
                       ("Org/Tiny", "../../x", False))
    assert all("error" in a for a in answers)
    assert "Org/Name" in answers[0]["error"] and "Org/Name" in answers[1]["error"]
    assert server.requests == []
    assert not (tmp_path / "home" / "hub").exists()


def test_an_unreachable_hub_is_a_clear_error(tmp_path):
    with socket.socket() as s:                       # a port nothing listens on once it is closed
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    [answer], _ = fetched(tmp_path / "home", closed, ("Org/Tiny", None, False))
    assert "cannot download Org/Tiny" in answer["error"] and closed in answer["error"]


def test_a_failing_hub_leaves_the_cached_snapshot_and_refuses_the_rest(server, tmp_path):
    home = tmp_path / "home"
    [online], _ = fetched(home, server.url, ("Org/Tiny", None, False))
    server.fail = 503
    server.clear()
    answers, stderr = fetched(home, server.url, ("Org/Tiny", None, False), ("Org/Bare", None, False))
    assert answers[0] == online and "is unavailable" in stderr[0] and "Org/Tiny" in stderr[0]
    refused = answers[1]["error"]
    assert "HTTP 503" in refused and "Org/Bare" in refused and server.url in refused
    assert not requested(server, "/resolve/")



def _cli(home, endpoint: str, *argv: str, offline: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(home), HF_ENDPOINT=endpoint, NO_PROXY="127.0.0.1", no_proxy="127.0.0.1",
               PYTHONPATH=str(Path(__file__).parents[1] / "src"))
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, "-m", "hebrus", *argv], env=env, capture_output=True, text=True,
                          timeout=PATIENCE)


def test_hebrus_download_then_load_by_repo_id(server, tmp_path):
    """`hebrus download Org/Name` prints the folder it fetched; every command then loads the repo
    id from the cache, offline too; a command naming a missing repo id fetches it itself."""
    home = tmp_path / "home"
    done = _cli(home, server.url, "download", "Org/Tiny")
    assert done.returncode == 0, done.stderr
    folder = Path(done.stdout.strip())
    assert folder.parent == home / "hub" / "models--Org--Tiny" / "snapshots"
    offline = _cli(home, server.url, "generate", "x", "--model", "Org/Tiny", "--max-new-tokens", "3", offline=True)
    assert offline.returncode == 0, offline.stderr
    fresh = _cli(tmp_path / "other", server.url, "info", "--model", "Org/Tiny")
    assert fresh.returncode == 0 and "parameters" in fresh.stdout, fresh.stderr
    refused = _cli(tmp_path / "third", server.url, "download", "Org/Pickled")
    assert refused.returncode == 2 and "only safetensors" in refused.stderr
    assert "Traceback" not in refused.stderr
