"""`kvpilot render` prints exactly render()'s objects; bad CRs fail with the CRD's messages."""

from __future__ import annotations


import yaml

from kvpilot.cli import main
from kvpilot.operator.render import render
from support.paths import REPO

REPO = REPO
EXAMPLE = REPO / "examples" / "deployments" / "llama-3.1-405b-tp8-pp2.yaml"


def test_render_cli_prints_render_output(capsys):
    assert main(["render", str(EXAMPLE), "--namespace", "prod"]) == 0
    out = capsys.readouterr().out
    printed = list(yaml.safe_load_all(out))
    cr = yaml.safe_load(EXAMPLE.read_text())
    cr["metadata"]["namespace"] = "prod"
    assert printed == render(cr)
    assert [o["kind"] for o in printed] == ["LeaderWorkerSet", "Service", "PodDisruptionBudget"]
    assert "&id" not in out and "*id" not in out


def test_render_cli_rejects_impossible_shape(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"apiVersion": "serving.kvpilot.io/v1alpha1", "kind": "LLMDeployment",
                                   "metadata": {"name": "x"},
                                   "spec": {"model": {"name": "org/m"}, "parallelism": {"tensor": 3, "pipeline": 3}}}))
    assert main(["render", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "x: invalid LLMDeployment" in err and "fill whole nodes" in err


def test_render_cli_needs_an_llmdeployment(tmp_path, capsys):
    other = tmp_path / "other.yaml"
    other.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n")
    assert main(["render", str(other)]) == 2
    assert "no LLMDeployment" in capsys.readouterr().err
