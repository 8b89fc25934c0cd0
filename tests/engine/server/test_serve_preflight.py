"""`kvpilot serve` checks its address before it loads the model: one clear line, non-zero exit."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.server.cli import bind_listen_socket, port_number

KVPILOT = str(Path(sys.executable).with_name("kvpilot"))


def test_port_in_use_fails_before_the_model_loads(stories_model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([KVPILOT, "serve", str(stories_model_dir), "--host", "127.0.0.1", "--port", str(port)],
                              capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in lines[0] and "in use" in lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("value", ["99999", "0", "-1", "http"])
def test_port_out_of_range_is_a_usage_error(value):
    proc = subprocess.run([KVPILOT, "serve", "/nonexistent", "--port", value], capture_output=True, text=True,
                          timeout=120, cwd="/")
    assert proc.returncode == 2
    assert f"argument --port: invalid port (1-65535) value: '{value}'" in proc.stderr


def test_port_number_accepts_the_range():
    assert port_number("1") == 1 and port_number("65535") == 65535
    with pytest.raises(ValueError):
        port_number("65536")


def test_bind_listen_socket_listens_and_names_a_busy_address():
    sock = bind_listen_socket("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # the kernel accepts into the backlog: the socket listens
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: .*another process"):
            bind_listen_socket("127.0.0.1", port)
    finally:
        sock.close()
    with pytest.raises(OSError, match="unknown host"):
        bind_listen_socket("no-such-host.invalid", 8000)
