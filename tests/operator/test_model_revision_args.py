"""The CR's ``spec.model.revision`` reaches every engine pod: the download step fetches that
revision into the directory the rendered ``kvpilot serve`` arguments load, and those arguments
parse with `kvpilot serve`'s parser into a local directory (no ``--revision``: the engine then
loads the downloaded snapshot, which `kvpilot.model.hub.resolve_model` accepts as it is)."""

from __future__ import annotations

import argparse

import pytest

from kvpilot.operator.render import render

HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"


def _cr(model: dict, **parallelism) -> dict:
    spec = {"model": model}
    if parallelism:
        spec["parallelism"] = parallelism
    return {"apiVersion": "serving.kvpilot.io/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "qwen", "namespace": "ml", "uid": "1"}, "spec": spec}


def _pod_templates(objects: list[dict]) -> list[dict]:
    child = objects[0]
    if child["kind"] == "LeaderWorkerSet":
        t = child["spec"]["leaderWorkerTemplate"]
        return [t["leaderTemplate"]["spec"], t["workerTemplate"]["spec"]]
    return [child["spec"]["template"]["spec"]]


@pytest.mark.parametrize("revision,want", [("3b8e4c1", "3b8e4c1"), (None, "main")])
@pytest.mark.parametrize("parallelism", [{}, {"tensor": 8, "pipeline": 2}], ids=["one-pod", "multi-node"])
def test_revision_reaches_the_download_and_the_engine_args(revision, want, parallelism):
    from kvpilot.server.cli import configure_parser

    model = {"name": HUB_ID} | ({"revision": revision} if revision else {})
    pods = _pod_templates(render(_cr(model, **parallelism)))
    assert len(pods) == (2 if parallelism else 1)
    for pod in pods:
        (init,) = pod["initContainers"]
        cmd = init["command"]
        assert cmd[:3] == ["hf", "download", HUB_ID] and cmd[cmd.index("--revision") + 1] == want
        local_dir = cmd[cmd.index("--local-dir") + 1]
        args = pod["containers"][0]["args"]
        parser = argparse.ArgumentParser()
        configure_parser(parser)
        parsed = parser.parse_args(args[1:])
        assert parsed.model == local_dir and local_dir.endswith(f"/{HUB_ID}/{want}")
        assert parsed.revision is None  # a local directory: a revision there would be an error


@pytest.mark.parametrize("model,expected", [
    ({"name": HUB_ID, "revision": "7ae557604adf67be50417f59c2c2f167def9a775"},
     {"name": HUB_ID, "revision": "7ae557604adf67be50417f59c2c2f167def9a775"}),
    ({"name": HUB_ID}, {"name": HUB_ID, "revision": "main"}),
    ({"name": "pvc://weights/qwen"}, {"name": "pvc://weights/qwen"}),  # no download, no revision
])
def test_status_reports_the_revision_the_pods_download(model, expected):
    from kvpilot.operator.crd import normalize
    from kvpilot.operator.status import desired_status

    cr = normalize(_cr(model))
    status = desired_status(cr, None, "2026-01-01T00:00:00Z")
    assert status["model"] == expected
    if "revision" in expected:
        init = _pod_templates(render(cr))[0]["initContainers"][0]["command"]
        assert init[init.index("--revision") + 1] == expected["revision"]
