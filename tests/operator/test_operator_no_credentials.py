"""`kvpilot operator` with no kubeconfig and outside a cluster exits at once with one clear line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

KVPILOT = str(Path(sys.executable).with_name("kvpilot"))


def _env(tmp_path: Path, kubeconfig: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")}
    env["HOME"] = str(tmp_path)  # no ~/.kube/config
    if kubeconfig is not None:
        env["KUBECONFIG"] = kubeconfig
    return env


@pytest.mark.parametrize("kubeconfig", [None, "missing.yaml"])
def test_no_credentials_is_one_line_and_exit_1(tmp_path, kubeconfig):
    kc = None if kubeconfig is None else str(tmp_path / kubeconfig)
    proc = subprocess.run([KVPILOT, "operator", "--standalone"], capture_output=True, text=True, timeout=60,
                          cwd="/", env=_env(tmp_path, kc))
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvpilot operator: no Kubernetes credentials")
    assert "KUBECONFIG" in lines[0]


def test_check_credentials_accepts_a_kubeconfig(tmp_path, monkeypatch):
    from kvpilot.operator.cli_operator import check_credentials

    kc = tmp_path / "config"
    kc.write_text("apiVersion: v1\nkind: Config\ncurrent-context: c\n"
                  "clusters: [{name: k, cluster: {server: 'http://127.0.0.1:1'}}]\n"
                  "users: [{name: u, user: {token: t}}]\n"
                  "contexts: [{name: c, context: {cluster: k, user: u}}]\n")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kc))
    assert check_credentials() is None
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    assert "no Kubernetes credentials" in check_credentials()
