"""Probes: a wedged engine is restarted within a minute whatever the drain length, and one slow
readiness answer does not take a pod out of the Service."""

from __future__ import annotations

import pytest

from kvpilot.operator.render import render
from support.operator_harness import make_cr


def _engine(drain: int):
    cr = make_cr("m", {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "engine": {"drainTimeoutSeconds": drain}})
    return render(cr)[0]["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("drain", [30, 600, 3600])
def test_wedged_engine_is_restarted_within_a_minute_whatever_the_drain(drain):
    live = _engine(drain)["livenessProbe"]
    assert live["httpGet"]["path"] == "/v1/health/live"  # 200 while draining, unlike /health
    assert live["periodSeconds"] * live["failureThreshold"] <= 60


def test_one_slow_readiness_answer_keeps_the_pod_in_the_service():
    ready = _engine(30)["readinessProbe"]
    assert ready["httpGet"]["path"] == "/health" and ready["failureThreshold"] >= 2


def test_engine_liveness_path_stays_up_while_draining():
    """The path the liveness probe uses answers 200 while the engine drains; /health says 503."""
    from fastapi.testclient import TestClient

    from kvpilot.server.app import create_app
    from kvpilot.server.state import ServerState

    state = ServerState(served_model_name="m", model_path="/m", llm=object())
    state.draining = True
    with TestClient(create_app(state)) as client:
        assert client.get(_engine(30)["livenessProbe"]["httpGet"]["path"]).status_code == 200
        assert client.get(_engine(30)["readinessProbe"]["httpGet"]["path"]).status_code == 503
