"""spec.lora.adapters: every listed adapter reaches the engine's arguments (--enable-lora
--lora-modules name=path, the slot counts), Hub adapters are downloaded by init containers into the
model volume (on every pod of a multi-node group), and the CRD refuses duplicate names and bad sources."""

from __future__ import annotations

import pytest

from kvpilot.operator import crd
from kvpilot.operator.render import render
from support.k8s_validate import validate_all

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def cr(lora: dict, **spec) -> dict:
    return {"apiVersion": "serving.kvpilot.io/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "llama", "namespace": "ml", "uid": "1"},
            "spec": {"model": {"name": MODEL}, "lora": lora, **spec}}


def _pod(objects):
    return objects[0]["spec"]["template"]["spec"]


def test_adapters_reach_the_engine_args_and_hub_ones_are_downloaded():
    doc = crd.normalize(cr({"adapters": [{"name": "sql", "source": "acme/llama-sql-lora", "revision": "v2"},
                                         {"name": "chat", "source": "/models/adapters/chat"}],
                            "maxLoras": 2, "maxLoraRank": 32}))
    objects = render(doc)
    validate_all(objects)
    pod = _pod(objects)
    args = pod["containers"][0]["args"]
    i = args.index("--enable-lora")
    assert args[i:] == ["--enable-lora", "--lora-modules", "sql=/models/lora/acme/llama-sql-lora/v2",
                        "chat=/models/adapters/chat", "--max-loras", "2", "--max-lora-rank", "32"]
    inits = pod["initContainers"]
    assert [c["name"] for c in inits] == ["download-model", "download-lora-0"]
    assert inits[1]["command"] == ["hf", "download", "acme/llama-sql-lora", "--revision", "v2", "--local-dir",
                                   "/models/lora/acme/llama-sql-lora/v2"]
    assert inits[1]["volumeMounts"] == inits[0]["volumeMounts"]


def test_without_adapters_nothing_changes():
    plain = render(crd.normalize(cr({})))
    doc = cr({})
    del doc["spec"]["lora"]
    assert plain == render(crd.normalize(doc))
    assert "--enable-lora" not in _pod(plain)["containers"][0]["args"]


def test_changing_the_adapters_changes_the_pod_template():
    a = render(crd.normalize(cr({"adapters": [{"name": "sql", "source": "/a"}]})))
    b = render(crd.normalize(cr({"adapters": [{"name": "sql", "source": "/a"}, {"name": "x", "source": "/b"}]})))
    assert _pod(a)["containers"][0]["args"] != _pod(b)["containers"][0]["args"]


@pytest.mark.parametrize("lora,spec,message", [
    ({"adapters": [{"name": "a", "source": "/x"}, {"name": "a", "source": "/y"}]}, {}, "names must be unique"),
    ({"adapters": [{"name": "a", "source": "s3://bucket/x"}]}, {}, "Hub id (org/name) or an absolute path"),
    ({"adapters": [{"name": "a", "source": "/x", "revision": "v1"}]}, {}, "revision applies to Hub ids only"),
    ({"adapters": [{"name": MODEL, "source": "/x"}]}, {}, "must differ from the base model's name"),
    ({"adapters": [{"name": "a"}]}, {}, "'source' is a required property"),
    ({"adapters": [], "maxLoras": 0}, {}, "less than the minimum of 1"),
])
def test_bad_lora_specs_are_rejected(lora, spec, message):
    with pytest.raises(crd.InvalidLLMDeployment) as info:
        crd.normalize(cr(lora, **spec))
    assert any(message in e for e in info.value.errors), info.value.errors


def test_every_pod_of_a_multi_node_group_downloads_the_adapters():
    doc = crd.normalize(cr({"adapters": [{"name": "sql", "source": "acme/sql-lora"}]},
                           parallelism={"tensor": 8, "pipeline": 2}))
    objects = render(doc)
    validate_all(objects)
    lws = objects[0]
    assert lws["kind"] == "LeaderWorkerSet"
    spec = lws["spec"]["leaderWorkerTemplate"]
    for tpl in (spec["leaderTemplate"], spec["workerTemplate"]):
        pod = tpl["spec"]
        assert [c["name"] for c in pod["initContainers"]] == ["download-model", "download-lora-0"]
        assert "sql=/models/lora/acme/sql-lora/main" in pod["containers"][0]["args"]


def test_an_adapter_that_fails_to_load_becomes_a_condition_with_the_engines_reason(tmp_path):
    from kvpilot.executor import LoRARequest
    from kvpilot.lora.adapter import load_adapter
    from kvpilot.operator.engine_failures import model_loaded_condition

    with pytest.raises(FileNotFoundError) as info:
        load_adapter(LoRARequest("sql", 1, str(tmp_path / "gone")), {}, 1, 8, None)
    log = f"Traceback (most recent call last):\n  ...\nFileNotFoundError: {info.value}\n"
    pod = {"metadata": {"name": "llama-0"}, "status": {
        "conditions": [{"type": "Ready", "status": "False"}],
        "containerStatuses": [{"name": "engine", "lastState": {"terminated": {"exitCode": 1, "message": log}}}]}}
    cond = model_loaded_condition(pod)
    assert (cond["status"], cond["reason"]) == ("False", "LoRAAdapterFailed")
    assert cond["message"] == (f"LoRA adapter sql (spec.lora.adapters) failed to load: no directory "
                               f"{tmp_path / 'gone'} (pod llama-0)")
