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
