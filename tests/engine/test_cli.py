"""The `kvpilot` entry point: subcommand dispatch and global options."""

from __future__ import annotations

import pytest

from kvpilot.cli import _command_name, main


def test_command_name_skips_log_level_value():
    assert _command_name(["--log-level", "WARNING", "render", "x.yaml"]) == "render"
    assert _command_name(["serve", "model"]) == "serve"
    assert _command_name(["--log-level", "DEBUG"]) is None


def test_global_option_before_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--log-level", "WARNING", "render", "--help"])
    assert exc.value.code == 0
    assert "usage: kvpilot render" in capsys.readouterr().out


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "serve" in capsys.readouterr().out


def test_serve_on_a_leaderworkerset_worker_runs_ranks_not_http(monkeypatch, stories_model_dir):
    import kvpilot.parallel.executor as parallel

    calls = {}

    def fake_run_lws_worker(model, group, **kwargs):
        calls.update(model=model, index=group.index, size=group.size, **kwargs)
        return 0

    monkeypatch.setattr(parallel, "run_lws_worker", fake_run_lws_worker)
    monkeypatch.setenv("LWS_GROUP_SIZE", "2")
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "10.0.0.1")
    monkeypatch.setenv("LWS_WORKER_INDEX", "1")
    assert main(["serve", str(stories_model_dir), "--pipeline-parallel-size", "2"]) == 0
    assert calls["model"] == str(stories_model_dir)
    assert (calls["index"], calls["size"], calls["pipeline_parallel_size"]) == (1, 2, 2)
