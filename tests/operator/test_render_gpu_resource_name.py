"""`kvpilot render` refuses a GPU resource name that is no Kubernetes resource name (empty included)."""

from __future__ import annotations

import pytest
import yaml

from kvpilot.cli import main


def _cr(resources: dict) -> dict:
    return {"apiVersion": "serving.kvpilot.io/v1alpha1", "kind": "LLMDeployment", "metadata": {"name": "x"},
            "spec": {"model": {"name": "org/m"}, "resources": resources}}


@pytest.mark.parametrize("name", ["", " ", "nvidia.com/", "/gpu", "nvidia.com/gpu/extra", "gpu name"])
def test_render_rejects_a_bad_gpu_resource_name(tmp_path, capsys, name):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_cr({"gpuResourceName": name})))
    assert main(["render", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "x: invalid LLMDeployment" in err and "gpuResourceName" in err


@pytest.mark.parametrize("name", ["nvidia.com/gpu", "amd.com/gpu", "nvidia.com/mig-1g.10gb", "gpu"])
def test_render_accepts_resource_names(tmp_path, capsys, name):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(_cr({"gpuResourceName": name})))
    assert main(["render", str(good)]) == 0
    objs = list(yaml.safe_load_all(capsys.readouterr().out))
    limits = objs[0]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits[name] == "1"
