"""The command line: generate streams text, info lists owners, verify ends with 'N passed, N failed'."""
import re
import subprocess
import sys

import pytest

from hebrus.cli import main


def test_generate_streams_text(capsys):
    assert main(["generate", "Hello", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.endswith("\n")


def test_info_lists_stages_and_owners(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for needle in ("layers.1.qsa", "layers.0.gdn.recurrent", "routes", "appended", "banked", "parameters"):
        assert needle in out


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_verify_passes_and_reports_every_cell(mode, capsys):
    assert main(["verify", "--mode", mode]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert re.fullmatch(r"\d+ passed, 0 failed", lines[-1])
    assert sum(line.count("held") for line in lines) == 11 * 5


def test_bad_arguments_are_clear(capsys):
    assert main(["generate", "x", "--model", "/no/such/model"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert main(["generate", "x", "--top-p", "3"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_console_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "hebrus.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "verify" in out.stdout


def test_stream_decoder_keeps_utf8_and_hides_control_bytes():
    from hebrus.tokenizer import StreamDecoder, encode
    d = StreamDecoder()
    text = "".join(d.push(t) for t in encode("é\n") + [0x1b, ord("x")]) + d.flush()
    assert text == "é\n\ufffdx"
