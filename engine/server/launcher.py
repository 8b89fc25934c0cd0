"""Start ``kvpilot serve`` as a child process and wait until it serves (for tests, demos, benchmarks)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kvpilot_command() -> list[str]:
    # The console script next to this interpreter; running `python -m` from the repository root
    # would import the top-level `operator/` folder instead of the standard library's module.
    script = Path(sys.executable).with_name("kvpilot")
    if script.is_file():
        return [str(script)]
    found = shutil.which("kvpilot")
    if found is None:
        raise FileNotFoundError("the kvpilot console script is not installed (pip install -e .)")
    return [found]


class ServerProcess:
    """``kvpilot serve MODEL ARGS...`` on 127.0.0.1 and a free port, as a context manager.

    Args:
        model: the model directory.
        args: further ``kvpilot serve`` arguments (e.g. ``["--chat-template", "t.jinja"]``).
        log_path: where the server's stdout/stderr go (default: discarded).
        startup_timeout: seconds to wait for ``/health`` to answer 200.

    Attributes:
        url: ``http://127.0.0.1:PORT``; ``base_url`` adds ``/v1`` for OpenAI clients.

    Raises:
        RuntimeError: the server exited or did not become healthy in time (the message carries the
            end of its log).
    """

    def __init__(self, model: str | os.PathLike, args: Optional[list[str]] = None,
                 log_path: Optional[str | os.PathLike] = None, startup_timeout: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        self.command = _kvpilot_command() + ["serve", str(model), "--host", "127.0.0.1",
                                             "--port", str(self.port)] + list(args or [])
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout = startup_timeout
        self.proc: Optional[subprocess.Popen] = None
        self._log_file = None

    def start(self) -> "ServerProcess":
        if self.log_path is not None:
            self._log_file = open(self.log_path, "wb")
            out = self._log_file
        else:
            out = subprocess.DEVNULL
        # cwd outside the repository for the same reason as in _kvpilot_command.
        self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, cwd="/")
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvpilot serve exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"kvpilot serve did not become healthy in {self.startup_timeout} s: {self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log file)"
        return self.log_path.read_text(errors="replace")[-chars:]

    def terminate(self) -> None:
        """Send SIGTERM (the server drains, then exits 0)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        """SIGTERM, wait up to ``timeout`` seconds, then SIGKILL. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("kvpilot serve did not stop in %.0f s; killing it", timeout)
                self.proc.kill()
                self.proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
