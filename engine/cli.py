"""The `kvpilot` command line: one entry point, one module per subcommand.

Each subcommand lives in its own module exposing ``configure_parser(parser)`` and
``run(args) -> int``; this file only wires them together and imports them lazily, so that
``kvpilot render`` does not import torch and ``kvpilot serve`` does not import kopf.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# (subcommand, module, help). `convert` takes a source format as a further subcommand.
_COMMANDS = [
    ("serve", "kvpilot.server.cli", "run the OpenAI-compatible HTTP server for one model"),
    ("router", "kvpilot.router.cli", "run a prefix- and load-aware OpenAI-compatible proxy in front of engines"),
    ("bench", "kvpilot.tools.bench", "benchmarks: serving latency, offline throughput, batch-1 latency"),
    ("operator", "kvpilot.operator.cli_operator", "run the LLMDeployment operator (kopf)"),
    ("render", "kvpilot.operator.cli_render", "print the manifests the operator would apply for a CR"),
]
_CONVERTERS = [
    ("llama2c", "kvpilot.tools.convert_llama2c", "llama2.c checkpoint + tokenizer -> Hugging Face directory"),
]


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default: ``(default: X)`` is added unless the text already
    names one; options whose default is None must say in their help what that means."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, argparse.SUPPRESS) or action.required:
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text  # a required positional has no default
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return f"{text} (default: {'on' if action.default else 'off'})"
        if isinstance(action.default, (list, tuple)):
            return f"{text} (default: {' '.join(map(str, action.default))})"
        return f"{text} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with `HelpFormatter`; its subcommands' parsers are of this class too."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def _add(subparsers, name: str, module: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    mod = importlib.import_module(module)
    mod.configure_parser(parser)
    parser.set_defaults(_run=mod.run)


def _command_name(argv: list[str]) -> str | None:
    """The first positional argument, skipping the value of ``--log-level``."""
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--log-level":
            skip = True
        elif not a.startswith("-"):
            return a
    return None


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """Build the parser, importing only the module of the subcommand named in ``argv``."""
    from kvpilot import __version__

    parser = ArgumentParser(prog="kvpilot", description="kvpilot: LLM serving engine and Kubernetes operator")
    parser.add_argument("--version", action="version", version=f"kvpilot {__version__}",
                        help="print the version and exit")
    parser.add_argument("--log-level", default="INFO",
                        help="logging level: DEBUG, INFO, WARNING, ERROR (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = _command_name(argv)
    for name, module, help_text in _COMMANDS:
        if wanted in (None, name):
            _add(sub, name, module, help_text)
        else:
            sub.add_parser(name, help=help_text, description=help_text)
    convert_help = "convert a checkpoint into a Hugging Face directory"
    convert = sub.add_parser("convert", help=convert_help, description=convert_help)
    conv_sub = convert.add_subparsers(dest="format", metavar="FORMAT")
    for name, module, help_text in _CONVERTERS:
        if wanted == "convert":
            _add(conv_sub, name, module, help_text)
        else:
            conv_sub.add_parser(name, help=help_text, description=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    return int(run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
