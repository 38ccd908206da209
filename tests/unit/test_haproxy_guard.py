"""HAProxy kept to its user and its host: the config Ray Serve's own generator writes,
hardened (admin socket 600, listeners on every interface moved to the HTTP frontend's
address), accepted by the real HAProxy, and one real HAProxy started through the
launcher as Serve starts it, its sockets and folder checked."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tessera.cluster import server
from tessera.cluster.haproxy_guard import PrivateHAProxy, guard_haproxy, harden_config

pytestmark = pytest.mark.skipif(
    not server.haproxy_available(), reason="Ray Serve's HAProxy does not run here"
)


def real_binary() -> str:
    from ray.serve._private.haproxy import _resolve_haproxy_binary

    return _resolve_haproxy_binary()


def serve_config_text(folder: Path, host: str, ports: list[int]) -> Path:
    """The config Serve's HAProxy manager writes (its own generator, HTTP and gRPC on
    ``host``), with every file in ``folder``; its path."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions, gRPCOptions

    http, grpc_port, stats_port, metrics_port = ports
    config = HAProxyConfig(
        http_options=HTTPOptions(host=host, port=http),
        grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=["x.add_servicer"]),
        socket_path=str(folder / "admin.sock"),
        server_state_base=str(folder),
        server_state_file=str(folder / "server-state"),
        metrics_socket_path=str(folder / "metrics.sock"),
        stats_port=stats_port,
        metrics_port=metrics_port,
        enable_hap_optimization=False,
    )
    api = HAProxyApi(cfg=config, config_file_path=str(folder / "haproxy.cfg"))
    api._generate_config_file_internal()
    return folder / "haproxy.cfg"


def binds(text: str) -> list[str]:
    return re.findall(r"^\s*bind (\S*):\d+", text, flags=re.MULTILINE)


def test_serves_config_gets_a_private_socket_and_listeners_on_the_host(tmp_path):
    path = serve_config_text(tmp_path, "127.0.0.1", server._free_ports(4))
    written = path.read_text()
    assert "mode 666 level admin" in written and {"", "*"} <= set(binds(written))  # Serve's
    hardened = harden_config(written)
    assert re.search(r"^\s*stats socket \S+ mode 600 level admin", hardened, re.MULTILINE)
    assert "mode 666" not in hardened
    assert set(binds(hardened)) == {"127.0.0.1"}  # stats and Prometheus too
    assert harden_config(hardened) == hardened
    path.write_text(hardened)
    check = subprocess.run([real_binary(), "-c", "-f", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_server_on_every_interface_keeps_its_listeners_there_but_not_its_socket(tmp_path):
    written = serve_config_text(tmp_path, "0.0.0.0", server._free_ports(4)).read_text()
    hardened = harden_config(written)
    assert binds(hardened) == binds(written)
    assert "mode 600 level admin" in hardened and "mode 666" not in hardened


def test_a_socket_line_without_a_mode_gets_one():
    text = "global\n    stats socket /x/admin.sock level admin\nfrontend http_frontend\n"
    assert "stats socket /x/admin.sock mode 600 level admin\n" in harden_config(text)


def test_haproxy_started_through_the_launcher_is_private_and_on_the_host(tmp_path):
    """As Serve starts it: ``<binary> -db -f <config> -dR``. The process Serve spawned is
    HAProxy itself (same pid, the config path on its command line), its admin socket is
    the user's alone in a 0700 folder, and it listens on 127.0.0.1 only."""
    private = PrivateHAProxy.create(real_binary())
    try:
        assert stat.S_IMODE(private.root.stat().st_mode) == 0o700
        node = private.root / ("f" * 56)  # Serve's per-node folder
        node.mkdir()
        config = serve_config_text(node, "127.0.0.1", server._free_ports(4))
        launcher = private.env()["RAY_SERVE_HAPROXY_BINARY_PATH"]
        process = subprocess.Popen([launcher, "-db", "-f", str(config), "-dR"])
        try:
            socket = node / "admin.sock"
            deadline = time.monotonic() + 20
            while not socket.exists() and time.monotonic() < deadline:
                assert process.poll() is None, "HAProxy exited"
                time.sleep(0.1)
            haproxy = psutil.Process(process.pid)
            assert haproxy.name() == "haproxy" and str(config) in haproxy.cmdline()
            assert stat.S_IMODE(socket.stat().st_mode) & 0o077 == 0  # nobody else's
            listening = {
                conn.laddr.ip
                for conn in haproxy.net_connections(kind="inet")
                if conn.status == psutil.CONN_LISTEN
            }
            assert listening == {"127.0.0.1"}
        finally:
            process.terminate()
            process.wait(timeout=20)
    finally:
        private.remove()
    assert not private.root.exists()


def test_guard_sets_serves_paths_and_wraps_its_binary_only_in_haproxy_mode():
    assert guard_haproxy({}) is None
    environ = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_SOCKET_PATH": "/mine.sock"}
    private = guard_haproxy(environ)
    try:
        assert private is not None and private.real_binary == real_binary()
        assert environ["RAY_SERVE_HAPROXY_SOCKET_PATH"] == "/mine.sock"  # given: kept
        assert environ["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"].startswith(f"{private.root}/")
        launcher = Path(environ["RAY_SERVE_HAPROXY_BINARY_PATH"])
        assert launcher.parent == private.root and os.access(launcher, os.X_OK)
    finally:
        private.remove()
