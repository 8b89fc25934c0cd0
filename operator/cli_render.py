"""``kvpilot render CR.yaml``: print, as YAML, exactly what the operator would apply for a CR.

The file may hold several documents; every LLMDeployment in it is rendered, in order, and
other kinds are ignored. Objects get a controller ownerReference only when the CR carries a
``metadata.uid`` (a CR read from the cluster with ``kubectl get -o yaml`` does; a fresh file does
not, and the operator always adds it).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import yaml

from .crd import KIND, InvalidLLMDeployment
from .render import render

logger = logging.getLogger(__name__)


class _NoAliasDumper(yaml.SafeDumper):
    """Write repeated sub-objects in full: Kubernetes tooling and readers expect no YAML anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_yaml(objects: list[dict[str, Any]]) -> str:
    """Objects as a multi-document YAML stream, keys in rendering order."""
    return yaml.dump_all(objects, Dumper=_NoAliasDumper, sort_keys=False, default_flow_style=False)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="CR.yaml", help="a YAML file with one or more LLMDeployments ('-' for stdin)")
    parser.add_argument("--namespace", "-n", default=None,
                        help="namespace for CRs that name none (default: the CR's, else 'default')")


def run(args: argparse.Namespace) -> int:
    try:
        if args.file == "-":
            docs = list(yaml.safe_load_all(sys.stdin))
        else:
            with open(args.file, encoding="utf-8") as f:
                docs = list(yaml.safe_load_all(f))
    except (OSError, yaml.YAMLError) as exc:
        print(f"kvpilot render: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    crs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if not crs:
        print(f"kvpilot render: no {KIND} in {args.file}", file=sys.stderr)
        return 2
    out: list[dict[str, Any]] = []
    for cr in crs:
        if args.namespace and not (cr.get("metadata") or {}).get("namespace"):
            cr.setdefault("metadata", {})["namespace"] = args.namespace
        try:
            out += render(cr)
        except InvalidLLMDeployment as exc:
            name = (cr.get("metadata") or {}).get("name", "?")
            print(f"kvpilot render: {name}: {exc}", file=sys.stderr)
            return 1
    sys.stdout.write(dump_yaml(out))
    return 0
