"""Local neighbours of a real `tessera serve --host 127.0.0.1` that starts its own Ray
(HAProxy mode): HAProxy's admin socket sits in a folder only the serving user can open
and is not writable by others, every HAProxy listener (the front door, the stats page,
the Prometheus exporter) is on 127.0.0.1, and the folder is gone once the server stops."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tessera.cluster import server

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.skipif(not server.haproxy_available(), reason="no HAProxy mode here"),
]


def haproxies(root: int) -> list[psutil.Process]:
    tree = psutil.Process(root).children(recursive=True)
    return [p for p in tree if p.name() == "haproxy"]


def test_haproxy_is_private_to_the_user_and_listens_on_the_host_only(tmp_path):
    (port,) = server._free_ports(1)
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # its own Ray
    command = [sys.executable, "-m", "tessera.cluster.cli", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--worker-num-cpus", "1", "--dtype", "float32"]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while "tessera: ready at" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-5000:]
            time.sleep(1)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200

        running = haproxies(process.pid)
        assert running, "no HAProxy under the server"
        listening = {
            (conn.laddr.ip, conn.laddr.port)
            for haproxy in running
            for conn in haproxy.net_connections(kind="inet")
            if conn.status == psutil.CONN_LISTEN
        }
        assert ("127.0.0.1", port) in listening
        assert {ip for ip, _ in listening} == {"127.0.0.1"}, listening  # stats and metrics too

        config = Path(next(a for a in running[0].cmdline() if a.endswith("haproxy.cfg")))
        (socket,) = re.findall(r"^\s*stats socket (\S+) ", config.read_text(), re.MULTILINE)
        socket = Path(socket)
        private = config.parent.parent  # <private folder>/<node id>/haproxy.cfg
        assert private.name.startswith("tessera-hap-") and socket.is_relative_to(private)
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
        assert private.stat().st_uid == os.getuid()
        assert stat.S_ISSOCK(socket.stat().st_mode)
        assert stat.S_IMODE(socket.stat().st_mode) & 0o077 == 0  # neither group nor others
    finally:
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=120)
    assert code == 0, log.read_text()[-5000:]
    assert not private.exists()
