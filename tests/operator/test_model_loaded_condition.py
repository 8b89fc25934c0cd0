"""A tensor-parallel size that does not split the model's heads becomes a clear status condition:
the engine refuses such a layout at start (its error is the container's termination message,
``FallbackToLogsOnError``), and the operator turns it into ``ModelLoaded=False`` with reason
``TensorParallelMismatch``, the model's count and the sizes that work, plus a Warning Event.
Pure parts first, then the real operator against kmock's emulator.
"""

from __future__ import annotations

from types import SimpleNamespace

import kmock
import pytest

from kvpilot.operator.apply import resource_path
from kvpilot.operator.engine_failures import layout_message, model_loaded_condition, valid_tensor_sizes
from kvpilot.operator.render import render
from kvpilot.parallel.executor import validate_layout
from support.operator_harness import NAMESPACE, make_cr, operator_env  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)

TRACEBACK = """Traceback (most recent call last):
  File "/usr/local/bin/kvpilot", line 8, in <module>
    sys.exit(main())
{error}
"""


def _engine_error(heads: int, kv_heads: int, intermediate: int, tp: int) -> str:
    """The engine's own message for this layout (its validate_layout), as a crash log's last line."""
    # The fields validate_layout reads before it refuses (a ModelConfig has many more).
    cfg = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
                          num_hidden_layers=2)
    with pytest.raises(ValueError) as info:
        validate_layout(cfg, tp, 1)
    return TRACEBACK.format(error=f"ValueError: {info.value}")


def _pod(name="llama-0", ready=False, engine=None, init=None):
    status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if engine is not None:
        status["containerStatuses"] = [{"name": "engine", "restartCount": 3, "lastState": {"terminated": engine},
                                        "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]
    if init is not None:
        status["initContainerStatuses"] = [{"name": "download-model", "state": {"terminated": init}}]
    labels = render(make_cr("llama"))[0]["spec"]["template"]["metadata"]["labels"]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
            "spec": {"containers": [{"name": "engine", "image": "x"}]}, "status": status}


@pytest.mark.parametrize("heads,kv,inter,tp,expected", [
    # 14 query heads (Qwen2.5-0.5B) over TP 4
    (14, 2, 64, 4, "the model has 14 attention heads (num_attention_heads), and parallelism.tensor 4 does not "
                   "divide it, so the engine refuses to start; parallelism.tensor values that work: 1, 2"),
    # 12 heads, 3 KV heads over TP 2: 2 neither divides 3 nor is a multiple of it
    (12, 3, 64, 2, "the model has 3 KV heads (num_key_value_heads), and parallelism.tensor 2 does not divide, "
                   "or be a multiple of, it, so the engine refuses to start; parallelism.tensor values that work: 1"),
    (8, 8, 36, 8, "the model has 36 MLP channels (intermediate_size), and parallelism.tensor 8 "
                  "does not divide it, so the engine refuses to start; parallelism.tensor values that work: 1, 2, 4"),
])
def test_engine_layout_error_becomes_an_actionable_message(heads, kv, inter, tp, expected):
    assert layout_message(_engine_error(heads, kv, inter, tp)) == expected


def test_kv_heads_allow_multiples():
    assert valid_tensor_sizes(4, or_multiple=True) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert valid_tensor_sizes(12, or_multiple=False) == [1, 2, 4]


def test_condition_from_pods():
    bad = _pod(engine={"exitCode": 1, "reason": "Error", "message": _engine_error(14, 2, 64, 4)})
    cond = model_loaded_condition(bad)
    assert (cond["status"], cond["reason"]) == ("False", "TensorParallelMismatch") and "(pod llama-0)" in cond["message"]
    other = model_loaded_condition(_pod(engine={"exitCode": 137, "reason": "OOMKilled", "message": ""}))
    assert (other["reason"], other["message"]) == (
        "EngineFailed", "the engine container of pod llama-0 exited: exit code 137, reason OOMKilled")
    download = model_loaded_condition(_pod(init={"exitCode": 1, "message": "...\n401 Client Error: gated repo\n"}))
    assert download["reason"] == "DownloadFailed" and download["message"].endswith("exited: 401 Client Error: gated repo")
    assert model_loaded_condition(_pod(ready=True))["status"] == "True"
    assert model_loaded_condition(_pod()) is None  # still loading: nothing to say
    assert model_loaded_condition(_pod(engine={"exitCode": 0, "message": "bye"})) is None


def test_engine_container_keeps_its_error_as_termination_message():
    spec = render(make_cr("llama"))[0]["spec"]["template"]["spec"]
    assert spec["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert spec["initContainers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"


def _condition(env):
    cr = env.get("LLMDeployment", NAMESPACE, "llama") or {}
    return next(((c["status"], c["reason"], c["message"]) for c in (cr.get("status") or {}).get("conditions") or []
                 if c["type"] == "ModelLoaded"), None)


async def test_crashing_engine_sets_model_loaded_false_then_true(operator_env):
    env = operator_env
    await env.start()
    await env.create_cr(make_cr("llama", {"model": {"name": "Qwen/Qwen2.5-0.5B-Instruct"},
                                          "parallelism": {"tensor": 4}, "gpusPerNode": 8}))
    await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "llama"))
    pod = _pod(engine={"exitCode": 1, "reason": "Error", "message": _engine_error(14, 2, 4864, 4)})
    resp = await env.k.post(resource_path("v1", "pods", NAMESPACE), json=pod)
    assert resp.status == 200
    cond = await env.wait_for(lambda: (c := _condition(env)) and c, timeout=5)
    assert cond[:2] == ("False", "TensorParallelMismatch") and "values that work: 1, 2" in cond[2]
    key = kmock.resource("v1/events")
    await env.wait_for(lambda: [o for (r, _, _), o in env.k.objects.items()
                                if r == key and o.raw.get("reason") == "TensorParallelMismatch"], timeout=5)
    # The user fixes the shape; a pod of the new shape becomes Ready.
    await env.patch("LLMDeployment", NAMESPACE, "llama", {"spec": {"parallelism": {"tensor": 2}}})
    resp = await env.k.post(resource_path("v1", "pods", NAMESPACE), json=_pod("llama-1", ready=True))
    assert resp.status == 200
    await env.wait_for(lambda: (_condition(env) or ("",))[0] == "True", timeout=5)
