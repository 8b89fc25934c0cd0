"""``kvpilot bench all --dry-run``: every figure of the results table runs on a tiny random Llama on
the CPU and yields finite rows; a failing figure prints an error row and the run goes on."""

from __future__ import annotations

import json
import math

import pytest

from kvpilot import cli
from kvpilot.tools import bench_figures

EXPECTED_FIGURES = ["prefill", "decode-b1", "ttft", "batch64", "offline", "http", "offline-bf16", "capacity",
                    "accuracy"]


@pytest.fixture(scope="module")
def dry_model(tmp_path_factory):
    """The dry-run model, written once for the module (`make_context` writes it when missing)."""
    path = tmp_path_factory.mktemp("bench-dry-model")
    bench_figures.make_context("cpu", str(path), quick=False, dry_run=True)
    return path


def test_bench_all_dry_run_produces_every_figure(dry_model, tmp_path, capsys):
    out = tmp_path / "results.json"
    rc = cli.main(["bench", "all", "--dry-run", "--model-dir", str(dry_model), "--out", str(out),
                   "--commit", "abc1234"])
    table = capsys.readouterr().out
    assert rc == 0, table
    report = json.loads(out.read_text())
    assert list(report["figures"]) == EXPECTED_FIGURES
    assert all(f["status"] == "ok" for f in report["figures"].values()), report["figures"]
    assert {"meta", "figures", "rows", "measurements", "total_s"} <= set(report)
    assert report["meta"]["dry_run"] is True and report["meta"]["device"] == "cpu"
    assert report["meta"]["commit"] == "abc1234" and "commit abc1234" in table
    rows = report["rows"]
    assert {r["figure"] for r in rows} == set(EXPECTED_FIGURES)
    for r in rows:
        assert math.isfinite(r["value"]) and r["error"] == "", r
    by_metric = {(r["figure"], r["metric"].split(",")[0]): r for r in rows}
    # float32 kvpilot and transformers compute the same function on the same weights
    acc = [r for r in rows if r["figure"] == "accuracy"]
    assert acc[0]["unit"] == "rel L2" and acc[0]["value"] < 2e-2
    assert acc[1]["unit"] == "%" and acc[1]["value"] >= 90
    itl = by_metric[("decode-b1", "batch-1 ITL")]
    assert itl["unit"] == "ms" and itl["value"] > 0 and itl["reference"].startswith("floor ")
    m = report["measurements"]
    assert m["decode-b1"]["floor_itl_s"] > 0 and m["copy_bandwidth_Bps"] > 0
    assert m["offline"]["output_tokens"] == 12 * 16 and m["offline-bf16"]["output_tokens"] == 12 * 16
    assert m["batch64"]["output_tokens"] == 8 * 12
    # every scheduled token of the fresh bf16 engine's run: 12 prompts of 24, then 15 decodes each
    steps = m["offline-bf16"]["steps"]
    scheduled = sum(p["steps"] * p["mean_tokens"] for p in steps.values() if p["steps"])
    assert round(scheduled) == 12 * 24 + 12 * 15 and steps["decode_only"]["steps"] >= 15
    assert [run["concurrency"] for run in m["http"]] == [1, 4]
    assert all(run["failed"] == 0 and run["total_output_tokens"] == n * 8
               for run, n in zip(m["http"], (2, 8)))
    caps = [r for r in rows if r["figure"] == "capacity"]
    assert len(caps) == 2 and all(r["value"] == 8192 and r["unit"] == "tokens" for r in caps)
    assert len(m["ttft"]["cold_s"]) == 2 and all(t > 0 for t in m["ttft"]["warm_s"])
    # the printed table: a header, one line per row, the total time
    assert "figure" in table and "floor / target" in table and "total " in table
    for name in EXPECTED_FIGURES:
        assert f"\n{name} " in table


def test_failing_figure_prints_an_error_row_and_the_run_goes_on(dry_model, tmp_path, capsys, monkeypatch):
    def broken(ctx):
        raise RuntimeError("simulated failure")

    monkeypatch.setitem(bench_figures.FIGURES, "batch64", (broken, "broken"))
    out = tmp_path / "r.json"
    rc = cli.main(["bench", "all", "--dry-run", "--model-dir", str(dry_model), "--figures", "capacity,batch64",
                   "--out", str(out)])
    table = capsys.readouterr().out
    assert rc == 1
    report = json.loads(out.read_text())
    # run in the figures' canonical order, the failure recorded, the next figure measured
    assert list(report["figures"]) == ["batch64", "capacity"]
    assert report["figures"]["batch64"]["status"] == "error"
    err = [r for r in report["rows"] if r["figure"] == "batch64"]
    assert len(err) == 1 and math.isnan(err[0]["value"]) and "simulated failure" in err[0]["error"]
    cap = [r for r in report["rows"] if r["figure"] == "capacity"]
    assert cap and all(math.isfinite(r["value"]) for r in cap)
    assert "ERROR" in table and "simulated failure" in table


def test_unknown_figure_is_refused(capsys):
    with pytest.raises(SystemExit, match="unknown nope"):
        cli.main(["bench", "all", "--dry-run", "--figures", "capacity,nope"])
    with pytest.raises(ValueError, match="unknown figure"):
        bench_figures.run_figures(None, ["nope"])


def test_prefill_flops_counts_weights_attention_and_one_lm_head_row():
    cfg = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, vocab_size=10)
    # per token per layer: q 8x8 + k,v 2 x 8x4 + o 8x8 + 3 x 8x16 = 576 weights; attention 2 x 2 x 2 x 4 x T(T+1)/2
    assert bench_figures.prefill_flops(cfg, 3) == 2 * 2 * 576 * 3 + 2 * 2 * 2 * 2 * 4 * 6 + 2 * 8 * 10


def test_full_figures_without_a_gpu_stop_with_one_line(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "all", "--figures", "capacity"]) == 2
    err = capsys.readouterr().err
    assert "CUDA GPU" in err and "--dry-run" in err and "Traceback" not in err
