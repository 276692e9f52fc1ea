"""The README's examples run as written: every Python block (in a fresh folder, since they
write files), and the serving section's shell and client blocks against a real `hebrus serve`
on the port they name."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PATIENCE, wait_until

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PYTHON = re.findall(r"```python\n(.*?)```", README, flags=re.S)
SERVED = "127.0.0.1:8000"


def _healthy(httpx, url: str) -> bool:
    try:
        return httpx.get(url, timeout=PATIENCE).status_code == 200
    except httpx.TransportError:
        return False


def test_the_readme_has_python_examples():
    assert len(PYTHON) >= 3


@pytest.mark.parametrize("index", [i for i, block in enumerate(PYTHON) if SERVED not in block])
def test_a_readme_example_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(PYTHON[index], f"README.md python block {index}", "exec"), {"__name__": "readme"})


def test_the_serving_examples_run_against_the_server_they_start():
    pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    shell = re.search(r"```bash\n(pip install -e '\.\[serve\]'\n.*?)```", README, flags=re.S).group(1)
    lines = shell.strip().splitlines()
    assert lines[1].startswith("hebrus serve") and lines[1].endswith("&")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    command = lines[1].removesuffix("&").split()
    server = subprocess.Popen([sys.executable, "-m", "hebrus", *command[1:]], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: _healthy(httpx, f"http://{SERVED}/health"), step=0.05), "the server did not start"
        curl = "\n".join(lines[2:])
        answer = json.loads(subprocess.run(["bash", "-c", curl], capture_output=True, text=True,
                                           timeout=PATIENCE, check=True).stdout)
        assert answer["choices"][0]["finish_reason"] in ("stop", "length")
        assert isinstance(answer["choices"][0]["text"], str)
        client = next(block for block in PYTHON if SERVED in block)
        done = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True, timeout=PATIENCE,
                              env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        # what a sampled reply says is the model's (it may be blank); that the stream ran to its end is ours
        assert done.stdout.endswith("\n")
    finally:
        server.terminate()
        server.wait(PATIENCE)
