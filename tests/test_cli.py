"""The command line: generate streams text, info lists owners, verify ends with 'N passed, N failed'."""
import re
import subprocess
import sys

import pytest

import hebrus
from conftest import PATIENCE

from hebrus.cli import main


def test_generate_streams_text(capsys):
    assert main(["generate", "Hello", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.endswith("\n")


def test_generate_by_default_writes_english_verse(capsys):
    """The default model is the trained `shakespeare` preset: sampled text is words, mostly
    common English ones, in lines, not the byte noise of a random preset."""
    assert main(["generate", "ROMEO.", "--max-new-tokens", "300"]) == 0
    out = capsys.readouterr().out
    assert sum(c.isalpha() or c in " \n,.;:'!?-" for c in out) >= 0.95 * len(out)
    words = re.findall(r"[a-z']+", out.lower())
    common = {"the", "and", "to", "of", "i", "you", "my", "a", "that", "is", "in", "not", "me", "with"}
    assert len(words) >= 40 and sum(w in common for w in words) >= 0.15 * len(words)
    assert out.count("\n") >= 3


def test_info_lists_stages_and_owners(capsys):
    assert main(["info", "--model", "tiny"]) == 0
    out = capsys.readouterr().out
    for needle in ("layers.1.qsa", "layers.0.gdn.recurrent", "routes", "appended", "banked", "parameters"):
        assert needle in out
    # the total's note: bytes every token of context adds, the sum of the appended owners' notes
    per_token = sum(int(m.replace(",", "")) for m in re.findall(r"appended .* ([\d,]+) per token", out))
    assert re.search(rf"^total .* {per_token:,} per token\s*$", out, re.M) and per_token > 0


def test_info_reports_the_state_pool_carved_from_the_bytes_given(capsys):
    from hebrus.state.pool import Pool
    model = hebrus.load("tiny")
    slot, block = Pool.slot_bytes(model.owners), Pool.block_bytes(model.owners, 16)
    padding = slot + 2 * block                                  # the planned steps' padding lanes
    assert main(["info", "--model", "tiny", "--pool-bytes", str(3 * slot + 10 * block + padding)]) == 0
    out = capsys.readouterr().out
    slots = (3 * slot + 10 * block) // 2 // slot                # half the bytes for slots, the rest in blocks
    assert slots == 3 and re.search(rf"^  slots +3 \({slot:,} bytes each", out, re.M)
    assert re.search(rf"^  blocks +10 of 16 rows \({block:,} bytes each", out, re.M)
    assert main(["info", "--model", "tiny", "--pool-bytes", str(slot + padding - 1)]) == 1
    assert "do not fit a pool" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_verify_passes_and_reports_every_cell(mode, capsys):
    assert main(["verify", "--model", "tiny", "--mode", mode]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert re.fullmatch(r"\d+ passed, 0 failed", lines[-1])
    assert sum(line.count("held") for line in lines) == 2 * 11 * 5      # alone, and in a ragged step
    assert "one session's fault in a ragged step of three" in out


def test_bad_arguments_are_clear(capsys):
    assert main(["generate", "x", "--model", "/no/such/model"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert main(["generate", "x", "--top-p", "3"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_console_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "hebrus.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "verify" in out.stdout


def test_stream_decoder_keeps_utf8_and_printing_hides_control_bytes():
    """The decoded text is the model's; what writes it to a terminal hides what would drive it."""
    from hebrus.text.tokenizers import ByteStream, ByteTokenizer, printable
    encode, d = ByteTokenizer().encode, ByteStream()
    text = "".join(d.push(t) for t in encode("é\n")[:1] + encode("é\n")[1:] + [0x1b, ord("x")]) + d.flush()
    assert text == "é\n\x1bx" and printable(text) == "é\n\ufffdx"


def test_the_context_limit_ends_a_generation_that_asks_for_more(capsys):
    assert main(["generate", "x", "--model", "tiny", "--max-new-tokens", "9000", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert "context limit of 1024 tokens ended the generation" in captured.err
    assert "generation: 1023 tokens" in captured.err


@pytest.mark.parametrize("argv,message", [
    (["generate", "x", "--seed", str(2**64)], "seed must lie in"),
    (["generate", "x", "--temperature", "1e400"], "temperature must be a finite number"),
    (["generate", "x", "--threads", "0"], "--threads must lie in [1, "),
    (["info", "--device", "cuda:banana"], "device must be"),
    (["info", "--memory-fraction", "2"], "memory_fraction must be a number in (0, 1]"),
    (["info", "--pool-bytes", "0"], "pool_bytes must be a positive int"),
])
def test_bad_input_is_one_line_not_a_traceback(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a CPU-only build")
def test_cuda_on_a_cpu_build_is_a_clear_error(capsys):
    assert main(["info", "--device", "cuda"]) == 2
    assert "no CUDA device is available" in capsys.readouterr().err


def test_a_closed_pipe_is_not_a_traceback():
    """`hebrus generate ... | head -c1`: the reader leaves after one byte."""
    proc = subprocess.Popen([sys.executable, "-m", "hebrus.cli", "generate", "Hello", "--max-new-tokens", "300"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(1)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=PATIENCE) == 141
    assert "Traceback" not in err and "Exception ignored" not in err


def test_bidi_controls_are_hidden_when_printed():
    from hebrus.text.tokenizers import ByteTokenizer, printable
    tokenizer = ByteTokenizer()
    assert printable(tokenizer.decode(tokenizer.encode("a\u202eb\u2067c"))) == "a\ufffdb\ufffdc"


def test_version_and_a_prompt_from_stdin(capsys, monkeypatch):
    import io
    from importlib.metadata import version
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"hebrus {version('hebrus')}"
    assert main(["generate", "Hello", "--max-new-tokens", "5", "--seed", "4"]) == 0
    direct = capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello"))
    assert main(["generate", "-", "--max-new-tokens", "5", "--seed", "4"]) == 0
    assert capsys.readouterr().out == direct
