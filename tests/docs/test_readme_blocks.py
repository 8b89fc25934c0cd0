"""The README's commands work as written: its server quick start is run (on the CPU, with
stories260K) and its other commands are checked against the repository.

The server block is executed from the repository root as the README gives it, except for the
port (a free one), the converted model's folder (a temporary one) and the stories260K source
folder when ``KVPILOT_STORIES260K_DIR`` moves it.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest

from kvpilot.server.launcher import ServerProcess
from kvpilot.tools.convert_llama2c import stories260k_source_dir

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
KVPILOT = str(Path(sys.executable).with_name("kvpilot"))
REPO_DIRS = ("engine", "kernels", "operator", "docs", "examples", "images", "charts", "crds", "tests", "benchmarks")


def sh_blocks(text: str) -> list[list[str]]:
    """The ```sh blocks, each as its commands: continuation lines joined, comments dropped."""
    blocks = []
    for body in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", body)
        cmds = []
        for line in joined.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                cmds.append(line)
        blocks.append(cmds)
    return blocks


def command(prefix: str, block_with: str | None = None) -> list[str]:
    """The one README command that starts with ``prefix`` (in the block holding a command that
    starts with ``block_with``, if given), as argv (a trailing comment or ``&`` dropped)."""
    blocks = [b for b in sh_blocks(README) if block_with is None or any(c.startswith(block_with) for c in b)]
    found = [c for block in blocks for c in block if c.startswith(prefix)]
    assert len(found) == 1, f"expected one README command starting {prefix!r}, found {found}"
    argv = shlex.split(found[0], comments=True)
    return argv[:-1] if argv and argv[-1] == "&" else argv


def option(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


def curl_bodies() -> list[tuple[str, dict]]:
    """(path, JSON body) of every ``curl ... -d '{...}'`` in the README."""
    out = []
    for block in sh_blocks(README):
        for cmd in block:
            if cmd.startswith("curl ") and " -d " in cmd:
                argv = shlex.split(cmd)
                path = "/" + argv[1].split("/", 1)[1]
                out.append((path, json.loads(option(argv, "-d"))))
    return out


def test_requests_name_the_served_model():
    serve = command(".venv/bin/kvpilot serve")
    served = option(serve, "--served-model-name")
    bodies = curl_bodies()
    assert {p for p, _ in bodies} >= {"/v1/completions", "/v1/chat/completions"}
    assert all(body["model"] == served for _, body in bodies), bodies


def test_chat_template_ships_in_the_package():
    template = ROOT / option(command(".venv/bin/kvpilot serve"), "--chat-template")
    assert template.is_file()
    assert "{{" in template.read_text() or "{%" in template.read_text()
    # package-data covers it: it is installed with kvpilot.server, whose source folder is engine/server
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_root = Path(setuptools["package-dir"]["kvpilot"])
    patterns = setuptools["package-data"]["kvpilot.server"]
    rel = template.relative_to(ROOT / package_root / "server")
    assert any(rel.match(p) for p in patterns), (rel, patterns)
    from kvpilot.server.chat_template import load_chat_template

    assert load_chat_template(template.stem) == template.read_text()  # `--chat-template plain`


def test_cited_repository_paths_exist():
    cited = set(re.findall(rf"`((?:{'|'.join(REPO_DIRS)})/[A-Za-z0-9_./<>-]*)`", README))
    for block in sh_blocks(README):
        for cmd in block:
            cited |= {w for w in shlex.split(cmd, comments=True) if w.split("/")[0] in REPO_DIRS}
    assert {"engine/server/templates/plain.jinja", "images/engine.Dockerfile", "charts/kvpilot"} <= cited
    missing = sorted(p for p in cited if "<" not in p and not (ROOT / p.rstrip("/")).exists())
    assert not missing, missing


def test_images_are_built_before_the_chart_is_installed():
    k8s = next(b for b in sh_blocks(README) if any(c.startswith("helm install") for c in b))
    first_helm = next(i for i, c in enumerate(k8s) if c.startswith("helm install"))
    builds = [c for c in k8s[:first_helm] if c.startswith("docker build")]
    assert {option(shlex.split(c), "-f") for c in builds} == {"images/engine.Dockerfile", "images/operator.Dockerfile"}
    operator_tag = next(option(shlex.split(c), "-t") for c in builds if "operator" in c)
    assert option(shlex.split(k8s[first_helm]), "--set") == f"image.repository={operator_tag.split(':')[0]}"


def test_install_documents_cpu_and_cuda_torch_and_gpu_tests():
    assert "download.pytorch.org/whl/cpu" in README and "download.pytorch.org/whl/cu128" in README
    assert "make test-gpu" in README and "Supported GPUs" in README
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test-gpu:", makefile, flags=re.M)


def test_render_command_runs_as_written():
    argv = command(".venv/bin/kvpilot render")
    proc = subprocess.run([KVPILOT, *argv[1:]], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "kind: LeaderWorkerSet" in proc.stdout


def test_server_quick_start_runs(tmp_path):
    convert = command(".venv/bin/kvpilot convert llama2c", block_with=".venv/bin/kvpilot serve")
    out_dir = option(convert, "--output")
    src = stories260k_source_dir()
    args = [str(src / Path(a).name) if a.startswith("../shared/models/stories260K/") else a for a in convert[1:]]
    args[args.index("--output") + 1] = str(tmp_path / "model")
    proc = subprocess.run([KVPILOT, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr

    serve = command(".venv/bin/kvpilot serve")
    assert serve[2] == out_dir  # it serves what the convert command wrote
    extra = serve[3:]
    del extra[extra.index("--port"):extra.index("--port") + 2]
    # ServerProcess runs the server from /: paths the README gives from the repository root, absolute
    extra = [str(ROOT / a) if (ROOT / a).is_file() else a for a in extra]
    served = option(serve, "--served-model-name")
    with ServerProcess(tmp_path / "model", extra, log_path=tmp_path / "server.log") as srv:
        models = httpx.get(srv.url + "/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [served]
        for path, body in curl_bodies():
            r = httpx.post(srv.url + path, json=body, timeout=60)
            assert r.status_code == 200, (path, r.text)
            assert r.json()["model"] == served
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        assert "kvpilot:kv_cache_usage_perc" in metrics


@pytest.mark.parametrize("name", ["quickstart.py"])
def test_cited_example_exists(name):
    assert f"examples/{name}" in README and (ROOT / "examples" / name).is_file()
