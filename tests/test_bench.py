"""`hebrus bench`: the measurement runs end to end on the CPU (speed targets live in its output,
never in tests) and a random-weight shape loads through the importer."""
from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch

import hebrus
from hebrus import bench
from hebrus.cli import main


def test_bench_writes_a_table_and_json(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    argv = ["bench", "--model", "tiny", "--contexts", "16,1023", "--decode-steps", "2", "--rounds", "1",
            "--json", str(tmp_path / "r.json"), "--table", str(tmp_path / "r.md")]
    with redirect_stdout(out), redirect_stderr(err):
        assert main(argv) == 0, err.getvalue()
    report = json.loads((tmp_path / "r.json").read_text())
    assert [p["context"] for p in report["points"]] == [16]        # 1023 + 2 steps > max_context 1024
    assert "context 1023 skipped" in err.getvalue()
    point = report["points"][0]
    for key in ("prefill_ratio_transactional_over_in_place", "decode_ratio_transactional_over_in_place",
                "decode_fraction_of_floor", "prefill_fraction_of_roofline"):
        assert point[key] > 0
    assert (tmp_path / "r.md").read_text() == out.getvalue()
    owners = hebrus.load("tiny").owners                  # a session's state bytes, as the owners say
    assert report["state_bytes_per_token"] == sum(o.nbytes for o in owners if o.kind == "appended") > 0
    assert report["state_bytes_per_session"] == 2 * sum(o.nbytes for o in owners if o.kind == "banked") > 0
    assert f"{report['state_bytes_per_token']:,} bytes a token of context" in out.getvalue()


@pytest.mark.parametrize("argv, message", [(["--batch", "0"], "from 1 to"), (["--batch", "2,y"], "integers"),
                                           (["--contexts", "1,x"], "integers"),
                                           (["--rounds", "0"], "--rounds"), (["--contexts", "0"], "positive"),
                                           (["--decode", "graph"], "captures CUDA graphs"),
                                           (["--mode", "exact", "--decode", "planned"], "runs exact mode"),
                                           (["--compare-transformers"], "not a preset")])
def test_bench_arguments_are_checked(argv, message):
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        assert main(["bench", "--model", "tiny", *argv]) == 2
    assert message in err.getvalue()


def test_a_random_shape_is_written_in_its_family_layout(tmp_path, monkeypatch):
    small = dict(bench.SHAPES["qwen3.5-1.7b"], vocab_size=64, hidden_size=32, num_hidden_layers=4,
                 layer_types=["linear_attention"] * 3 + ["full_attention"], intermediate_size=48,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                 linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    monkeypatch.setitem(bench.SHAPES, "mini", small)
    folder = bench.random_checkpoint("mini", tmp_path / "mini")
    model = hebrus.load(folder)
    assert model.family == "qwen3_5"
    assert model.session().feed([1, 2, 3]).isfinite().all()
    with pytest.raises(hebrus.InvalidInput, match="unknown shape"):
        bench.random_checkpoint("nope", tmp_path / "x")


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_the_in_place_variant_computes_what_a_session_computes(tiny, mode):
    """The baseline must not drift from the product path: same logits, chunk by chunk."""
    model = tiny.with_mode(mode)
    session, in_place = model.session(), bench.InPlaceSession(model)
    for chunk in ([1, 2, 3], [4], list(range(5, 30))):
        assert session.feed(chunk).equal(in_place.feed(chunk))


def test_the_floor_counts_what_a_decode_step_reads(tiny):
    c = tiny.config
    params = dict(tiny.named_parameters())
    everything = sum(p.numel() * p.element_size() for p in params.values())
    experts = sum(p.numel() * p.element_size() for n, p in params.items() if ".moe.experts." in n)
    floor = bench.decode_bytes(tiny, 0)
    assert floor < everything - experts * (1 - c.moe_top_k / c.moe_experts) + 1     # unused experts not read
    assert bench.decode_bytes(tiny, 100) > floor                                     # K/V and index rows


def test_bench_against_transformers_on_the_same_checkpoint(tmp_path):
    """The planned decode route, and transformers timed on the same folder after every point."""
    from foreign import build
    folder, _ = build("qwen3_5", tmp_path / "q")
    out, err = io.StringIO(), io.StringIO()
    argv = ["bench", "--model", str(folder), "--contexts", "20,40", "--decode-steps", "2", "--rounds", "1",
            "--decode", "planned", "--compare-transformers", "--json", str(tmp_path / "r.json")]
    with redirect_stdout(out), redirect_stderr(err):
        assert main(argv) == 0, err.getvalue()
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["decode"] == "planned" and report["warm_decode_steps"] == bench.WARM_STEPS
    for point in report["points"]:
        hf = point["transformers"]
        assert "error" not in hf, hf
        assert hf["prefill_s_per_token"] > 0 and hf["decode_s_per_step"] > 0
        assert point["decode_speedup_over_transformers"] > 0
    assert "transformers prefill tok/s" in out.getvalue()


def test_transformers_out_of_memory_is_reported_not_fatal(tmp_path, monkeypatch):
    """transformers running out of memory at a length (its eager attention at 32K on an H100)
    is that point's error in the report, and the bench goes on."""
    transformers = pytest.importorskip("transformers")
    from hebrus.bench.timing import transformers_point

    class Greedy(torch.nn.Module):
        def forward(self, ids, **_):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.25 GiB.")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Greedy())
    point = transformers_point(tmp_path, [1, 2, 3], 2, 1, torch.device("cpu"), torch.float32)
    assert point == {"error": "out of memory at 3 tokens (CUDA out of memory. Tried to allocate 32.25 GiB.)"}


def test_bench_measures_sessions_decoding_together(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    argv = ["bench", "--model", "tiny", "--contexts", "16", "--batch", "1,3", "--decode-steps", "2",
            "--rounds", "1", "--json", str(tmp_path / "r.json")]
    with redirect_stdout(out), redirect_stderr(err):
        assert main(argv) == 0, err.getvalue()
    one, three = json.loads((tmp_path / "r.json").read_text())["points"]
    assert (one["batch"], three["batch"]) == (1, 3)
    assert "prefill_tokens_per_s" in one and "prefill_tokens_per_s" not in three
    assert three["decode_tokens_per_s"] > 0 and three["decode_ratio_transactional_over_in_place"] > 0
    assert three["decode_floor_ms_per_step"] > one["decode_floor_ms_per_step"]      # three sessions' state
    assert one["ops_per_step"] > 0 and three["ops_per_step"] > 0


def test_the_in_place_batch_computes_what_a_planned_batch_computes(tiny_fast):
    """The in-place batch runs the runner's lanes step with every write in place: the same
    logits as a planned `Batch`, bit for bit, step after step (one growing its storage)."""
    sessions = [tiny_fast.session() for _ in range(3)]
    inplace = [bench.InPlaceSession(tiny_fast) for _ in range(3)]
    for i, (s, p) in enumerate(zip(sessions, inplace)):
        s.feed([1 + i, 2, 3] * (1 + 2 * i))
        p.feed([1 + i, 2, 3] * (1 + 2 * i))
    group, planned = bench.InPlaceBatch(inplace), hebrus.Batch(sessions, decode="planned")
    for step in range(10):
        ids = [4 + step, 5, 6 + step]
        assert torch.equal(group.feed(ids), torch.stack(planned.feed(ids))), step
    assert [p.frontier for p in inplace] == [s.frontier for s in sessions] == [13, 19, 25]
    assert [int(tiny_fast.pool.banks["frontier"][0, p.image.slot]) for p in inplace] == [13, 19, 25]


def test_bench_long_compares_sparse_and_dense_attention(tmp_path):
    """`--long`: the small shape at a 132K context limit, QSA against dense attention, with a
    comparison per context (here short contexts on the CPU: the GPU run measures 1K to 128K)."""
    out, err = io.StringIO(), io.StringIO()
    argv = ["bench", "--long", "--contexts", "24,80", "--decode-steps", "2", "--rounds", "1", "--chunk", "64",
            "--json", str(tmp_path / "r.json"), "--table", str(tmp_path / "r.md")]
    with redirect_stdout(out), redirect_stderr(err):
        assert main(argv) == 0, err.getvalue()
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["context"] for r in report["comparison"]] == [24, 80]
    assert report["qsa"]["model"].endswith("qsa attention") and report["dense"]["model"].endswith("dense attention")
    row = report["comparison"][1]
    assert row["dense_over_qsa"] == pytest.approx(row["dense_decode_ms"] / row["qsa_decode_ms"])
    bandwidth = {name: report[name]["copy_bandwidth_bytes_per_s"] for name in ("qsa", "dense")}
    assert row["floors_ratio"] == pytest.approx(row["dense_floor_ms"] * bandwidth["dense"]
                                                / (row["qsa_floor_ms"] * bandwidth["qsa"]))
    assert row["share_of_floors_ratio"] == pytest.approx(row["dense_over_qsa"] / row["floors_ratio"])
    assert row["qsa_floor_ms"] == report["qsa"]["points"][1]["decode_floor_ms_per_step"]
    assert "dense ÷ QSA" in out.getvalue() and "floors' ratio" in (tmp_path / "r.md").read_text()
    # one attention layer for one query: QSA reads every index key and top_k K/V rows, dense every K/V row
    layer = {(p["model"], p["context"]): p for p in report["layer"]}
    assert set(layer) == {(m, c) for m in ("qsa", "dense") for c in (24, 80)}
    item, kv = 4, 2 * 2 * 64                      # float32; k and v rows of 2 heads × 64
    assert layer["qsa", 80]["bytes_needed"] == 80 * 64 * item + 64 * kv * item
    assert layer["qsa", 24]["bytes_needed"] == 24 * 64 * item + 24 * kv * item      # fewer rows than top_k
    assert layer["dense", 80]["bytes_needed"] == 80 * kv * item
    assert all(p["seconds"] > 0 and p["over_floor"] == pytest.approx(p["seconds"] / p["floor_seconds"])
               for p in layer.values())
    assert "over floor" in (tmp_path / "r.md").read_text()
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        assert main(["bench", "--long", "--model", "tiny"]) == 2
        assert main(["bench", "--long-shape", "wide"]) == 2
    assert "leave out --model" in err.getvalue() and "--long-shape goes with --long" in err.getvalue()


def test_the_long_shape_flag_offers_every_long_shape():
    """`--long-shape`'s choices are written in the command (building the parser imports no model
    code); they are the long bench's SHAPES."""
    from hebrus.bench import long
    from hebrus.cli import _parser
    bench_parser = _parser()._subparsers._group_actions[0].choices["bench"]
    flag = next(a for a in bench_parser._actions if "--long-shape" in a.option_strings)
    assert sorted(flag.choices) == sorted(long.SHAPES)


@pytest.mark.parametrize("shape", ["small", "wide"])
def test_the_long_models_differ_only_in_attention(shape):
    """Both shapes' two models differ in their attention layers alone; at 128K dense attention's
    byte floor passes QSA's by the ratio each shape is for: 2.28x (small), 7.3x (wide: K/V rows
    four times as wide), as the bench's README states them."""
    from hebrus.bench import long
    from hebrus.bench.limits import decode_bytes
    models = long.long_models(torch.device("cpu"), torch.bfloat16, shape=shape)
    sparse, dense = models["qsa"].spec, models["dense"].spec
    assert sparse.max_context == dense.max_context == long.LONG_CONTEXT >= 131072 + 64
    assert [m for m in sparse.mixers if m != "qsa"] == [m for m in dense.mixers if m != "attention"]
    assert "qsa" not in dense.mixers and sparse.mixers.count("qsa") == dense.mixers.count("attention") > 0
    ratio = decode_bytes(models["dense"], 131072) / decode_bytes(models["qsa"], 131072)
    assert ratio == pytest.approx(2.28 if shape == "small" else 7.30, abs=0.01)


def test_bench_ple_pages_compares_paged_and_resident_tables(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    argv = ["bench", "--ple-pages", "--ple-gib", "0.02", "--ple-cache-mib", "8", "--decode-steps", "3",
            "--rounds", "1", "--cache", str(tmp_path), "--json", str(tmp_path / "r.json")]
    with redirect_stdout(out), redirect_stderr(err):
        assert main(argv) == 0, err.getvalue()
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["paged_over_resident"] > 0 and 0 <= report["page_hit_rate"] <= 1
    assert report["bytes_moved_per_token"] >= 0 and "paged ÷ resident" in out.getvalue()
    weights = next(tmp_path.glob("ple-pages-*")) / "model.safetensors"
    assert weights.stat().st_blocks * 512 < weights.stat().st_size / 4          # written sparse
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        assert main(["bench", "--ple-pages", "--ple-gib", "0"]) == 2
    assert "--ple-gib must lie in" in err.getvalue()


def test_bench_quant_reports_quality_and_speed_per_format(tmp_path):
    """`--quant`: the trained model's validation loss per format against float (here over a few
    hundred bytes), and decode speed and KL per format against float on --model."""
    val = tmp_path / "val.bin"
    val.write_bytes(b"MACBETH. So foul and fair a day I have not seen.\n" * 6)
    out, err = io.StringIO(), io.StringIO()
    argv = ["bench", "--quant", "--model", "tiny", "--formats", "int8,int4", "--contexts", "24", "--decode-steps",
            "2", "--rounds", "1", "--batch", "1,2", "--val", str(val), "--val-context", "100",
            "--json", str(tmp_path / "r.json"), "--table", str(tmp_path / "r.md")]
    with redirect_stdout(out), redirect_stderr(err):
        assert main(argv) == 0, err.getvalue()
    report = json.loads((tmp_path / "r.json").read_text())
    quality = {r["format"]: r for r in report["quality"]}
    assert list(quality) == ["float", "int8", "int4"] and quality["float"]["increase"] == 0
    assert quality["int8"]["increase"] == pytest.approx(quality["int8"]["val_nats_per_byte"]
                                                        / quality["float"]["val_nats_per_byte"] - 1)
    speed = {(r["format"], r["batch"]): r for r in report["speed"]}
    assert list(speed) == [(f, b) for f in ("float", "int8", "int4") for b in (1, 2)]
    assert speed["float", 1]["kl"] is None and speed["int8", 1]["kl"] >= 0
    assert speed["int4", 1]["weight_bytes"] < speed["int8", 1]["weight_bytes"] < speed["float", 1]["weight_bytes"]
    # the targets: one session's against float's per format, any larger batch at least float's
    assert [speed[f, b]["target"] for f in ("float", "int8", "int4") for b in (1, 2)] == [None, None, 1.4, 1.0, 2.0, 1.0]
    assert all(r["graph_captures"] == 0 for r in speed.values())            # eager on the CPU
    table = (tmp_path / "r.md").read_text()
    assert "| × float | target |" in table and "graphs captured |" in table and "≥ 1.4×" in table
    assert "nats/byte" in out.getvalue()
    with redirect_stdout(io.StringIO()), redirect_stderr(err := io.StringIO()):
        assert main(["bench", "--quant", "--formats", "int3"]) == 2
    assert "--formats takes" in err.getvalue()


def test_bench_spec_compares_speculation_with_plain_decoding(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    argv = ["bench", "--spec", "--model", "tiny", "--draft", "tiny", "--draft-quantize", "int8",
            "--spec-tokens", "12", "--draft-tokens", "4", "--rounds", "1", "--contexts", "16,64,4096",
            "--json", str(tmp_path / "s.json"), "--table", str(tmp_path / "s.md")]
    with redirect_stdout(out), redirect_stderr(err):
        assert main(argv) == 0, err.getvalue()
    report = json.loads((tmp_path / "s.json").read_text())
    rows = {row["variant"]: row for row in report["decode"]}
    assert list(rows) == ["plain", "lookup", "draft model tiny (int8)"]
    assert rows["plain"]["speedup_over_plain"] == 1.0 and rows["lookup"]["output_equals_plain"]
    assert rows["draft model tiny (int8)"]["drafted"] > 0 and all(r["tokens_per_s"] > 0 for r in rows.values())
    assert [row["context"] for row in report["fork"]] == [16, 64] and report["fork_ratio"] > 0
    assert "fork at context 4096 skipped" in err.getvalue()
    assert (tmp_path / "s.md").read_text() == out.getvalue()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        assert main(["bench", "--spec", "--model", "tiny", "--spec-tokens", "0"]) == 2
        assert main(["bench", "--spec", "--model", "tiny", "--spec-tokens", "2000"]) == 2
    assert "--spec-tokens must be at least 1" in err.getvalue() and "max_context" in err.getvalue()


def test_bench_serve_measures_the_server_against_the_engine_offline(tmp_path):
    pytest.importorskip("uvicorn")
    out, err = io.StringIO(), io.StringIO()
    argv = ["bench", "--serve", "--model", "tiny", "--clients", "1,3", "--requests", "4", "--serve-prompt", "8",
            "--serve-tokens", "4", "--json", str(tmp_path / "v.json"), "--table", str(tmp_path / "v.md")]
    with redirect_stdout(out), redirect_stderr(err):
        assert main(argv) == 0, err.getvalue()
    report = json.loads((tmp_path / "v.json").read_text())
    assert [p["clients"] for p in report["points"]] == [1, 3]
    for point in report["points"]:
        assert point["output_tokens_per_s"] > 0 and point["offline"]["tokens_per_s"] > 0
        assert point["ttft_ms_p50"] > 0 and point["throughput_over_offline"] > 0
        assert point["offline"]["decode_tokens_per_s"] >= point["offline"]["tokens_per_s"]
        assert 0 < point["engine_prefill_ms_p50"] < point["ttft_ms_p50"]
    assert (tmp_path / "v.md").read_text() == out.getvalue()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        assert main(["bench", "--serve", "--model", "tiny", "--clients", "0"]) == 2
        assert main(["bench", "--serve", "--model", "tiny", "--serve-temperature", "-1"]) == 2
        assert main(["bench", "--serve", "--workload", "mixed", "--model", "tiny", "--serve-temperature", "1"]) == 2
    assert "--clients takes" in err.getvalue() and "--serve-temperature must be" in err.getvalue()
    assert "uniform workload only" in err.getvalue()


def test_bench_serve_samples_at_a_temperature(tmp_path):
    pytest.importorskip("uvicorn")
    out, err = io.StringIO(), io.StringIO()
    argv = ["bench", "--serve", "--model", "tiny", "--clients", "2", "--requests", "3", "--serve-prompt", "8",
            "--serve-tokens", "4", "--serve-temperature", "0.8", "--json", str(tmp_path / "t.json")]
    with redirect_stdout(out), redirect_stderr(err):
        assert main(argv) == 0, err.getvalue()
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["temperature"] == 0.8 and report["points"][0]["output_tokens_per_s"] > 0
    assert "sampled at temperature 0.8" in out.getvalue()


@pytest.mark.parametrize("workload", ["shared", "mixed", "long", "chat"])
def test_bench_serve_runs_its_workloads_with_the_cache_on_and_off(tmp_path, workload):
    pytest.importorskip("uvicorn")
    out, err = io.StringIO(), io.StringIO()
    argv = ["bench", "--serve", "--workload", workload, "--model", "tiny", "--device", "cpu", "--clients", "3", "--requests", "4",
            "--system", "130", "--own", "4", "--serve-prompt", "8", "--serve-tokens", "30" if workload == "long" else "3",
            "--serve-prefill-share", "1.5", "--serve-prefill-chunk", "64", "--serve-prefix-every", "32",
            "--json", str(tmp_path / "w.json"),
            "--table", str(tmp_path / "w.md")]
    with redirect_stdout(out), redirect_stderr(err):
        assert main(argv) == 0, err.getvalue()
    report = json.loads((tmp_path / "w.json").read_text())
    if workload == "shared":                    # the cache on: the clients and the last request hit
        assert report["off"]["clients"]["hit_rate"] == 0 and report["on"]["clients"]["hit_rate"] == 1.0
        assert report["on"]["after"]["hit_rate"] == 1.0 and report["cached_over_cold_ttft"] > 0
        assert report["cached_over_cold_off_ttft"] > 0 and report["prefix_every"] == 32
        assert "÷ a cold request's with the cache off" in out.getvalue() and "a state every 32 tokens" in out.getvalue()
    elif workload == "chat":                    # a later turn finds at least the turn before's prompt
        assert report["on"]["later_cached_share"] > 0 and report["off"]["later_cached_share"] == 0
    elif workload == "long":                    # decoders seen before the long prompt and after it arrives
        assert report["gaps_before"] >= 3 * 3 and report["long_ttft_ms"] > 0 and report["decoders_tokens_per_s"] > 0
        assert "prompt share 1.5 (a turn within 1 + that many decode steps), chunks of 64 tokens" in out.getvalue()
    else:
        assert report["on"]["output_tokens_per_s"] > 0 and report["off"]["output_tokens_per_s"] > 0
    assert report["prefill_share"] == 1.5 and report["prefill_chunk"] == 64
    assert (tmp_path / "w.md").read_text() == out.getvalue()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        assert main(["bench", "--serve", "--workload", "shared", "--model", "tiny", "--system", "5000"]) == 2
        assert main(["bench", "--serve", "--workload", workload, "--model", "tiny", "--serve-prefill-share", "0"]) == 2
        assert main(["bench", "--serve", "--workload", workload, "--model", "tiny", "--serve-prefill-chunk", "0"]) == 2
        assert main(["bench", "--serve", "--workload", workload, "--model", "tiny", "--serve-gather-ms", "nan"]) == 2
        assert main(["bench", "--serve", "--workload", workload, "--model", "tiny", "--serve-prefix-every", "0"]) == 2
    assert "--serve-gather-ms must be from 0 to 100, got nan" in err.getvalue()
    assert "--serve-prefix-every must be at least 1, got 0" in err.getvalue()
    assert "max_context" in err.getvalue() and "--serve-prefill-share must be a positive" in err.getvalue()
    assert "--serve-prefill-chunk must be at least 1" in err.getvalue()


def test_a_batch_point_needs_slots_for_one_rounds_sessions_only():
    """Each round of a batch point lets the last round's sessions go before it makes its own: a
    pool of nine slots measures three sessions (three transactional, three in place, one joining)
    over any number of rounds."""
    from hebrus.bench.timing import _batch_point
    from hebrus.state.pool import Pool
    specs = hebrus.load("tiny").owners
    per_slot, per_block = Pool.slot_bytes(specs), Pool.block_bytes(specs, 16)
    model = hebrus.load("tiny", pool_bytes=per_slot + 2 * per_block + 2 * 9 * per_slot).with_mode("fast")
    assert model.pool.slots == 9
    point = _batch_point(model, list(range(1, 17)), steps=2, rounds=3, chunk=16, batch=3, how="planned")
    assert set(point.decode_s_per_step) == {"transactional", "in-place"}


def test_ops_per_step_counts_what_a_step_dispatches_and_no_view(tiny_fast):
    """The count is of operations that compute (a view launches nothing): one operation more in
    a stage's work is one more in the count."""
    import unittest.mock
    from hebrus.bench.timing import ops_per_step
    session = tiny_fast.session()
    session.feed([1, 2, 3])
    plain = ops_per_step(tiny_fast, [session], "auto")
    head = tiny_fast.stages[-1]
    real = head.run

    def one_more(txn, step):
        step.streams = step.streams.clone().view(-1).view_as(step.streams)     # a copy and two views
        return real(txn, step)
    with unittest.mock.patch.object(head, "run", one_more):
        more = ops_per_step(tiny_fast, [session], "auto")
    assert plain > 0 and more == plain + 1
