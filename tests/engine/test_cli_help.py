"""`kvpilot --version`, and every `--help` entry of every subcommand says what it is and its default."""

from __future__ import annotations

import argparse

import pytest

from kvpilot import __version__
from kvpilot.cli import _COMMANDS, _CONVERTERS, HelpFormatter, build_parser, main


def _parsers(parser: argparse.ArgumentParser, path: str = "kvpilot"):
    """(command path, parser) for ``parser`` and every subcommand's parser below it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def _all_parsers():
    seen = {}
    for argv in [[name] for name, *_ in _COMMANDS] + [["convert"]]:
        for path, parser in _parsers(build_parser(argv)):
            # only the subcommand named in argv is fully built; keep the parser that has arguments
            if path not in seen or len(parser._actions) > len(seen[path]._actions):
                seen[path] = parser
    return seen


PARSERS = _all_parsers()


def test_every_subcommand_is_built():
    names = {f"kvpilot {n}" for n, *_ in _COMMANDS} | {f"kvpilot convert {n}" for n, *_ in _CONVERTERS}
    assert names <= set(PARSERS)
    assert {"kvpilot bench serve", "kvpilot bench latency", "kvpilot bench throughput"} <= set(PARSERS)
    for path in names:
        assert len(PARSERS[path]._actions) > 1, f"{path} has no arguments"


@pytest.mark.parametrize("path", sorted(PARSERS))
def test_every_entry_has_a_description_and_its_default(path):
    parser = PARSERS[path]
    assert parser.description, f"{path} has no description"
    formatter = HelpFormatter(prog=path)
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help != argparse.SUPPRESS, f"{path} {name}: no help text"
        if action.required or not action.option_strings:
            continue
        text = formatter._get_help_string(action) % {"default": action.default}
        assert "default" in text.lower(), f"{path} {name}: help does not say its default: {text!r}"
    parser.format_help()  # every %-placeholder in the help texts resolves


def test_help_shows_a_concrete_default(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 256)" in out  # --max-batch-size
    assert "(default: on)" in out or "(default: off)" in out  # a flag


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvpilot {__version__}"
