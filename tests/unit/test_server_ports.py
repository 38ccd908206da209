"""The ports ``tessera serve`` picks for Serve's HAProxy pages and fallback proxy."""

from __future__ import annotations

import socket

from tessera.cluster import server


def test_picked_ports_are_below_the_ephemeral_range_distinct_and_skip_a_taken_one(monkeypatch):
    # below Serve's direct-ingress ports (30000 up) and Linux's ephemeral ones (32768 up)
    assert server.PICKED_PORTS[-1] < 30000
    held = taken = None
    for port in server.PICKED_PORTS:  # hold the range's first free port
        try:
            held = socket.create_server(("", port))
        except OSError:
            continue
        taken = port
        break
    assert held is not None and taken is not None
    with held:  # the random start lands on it: the free ports after it are given
        monkeypatch.setattr(server.random, "randrange", lambda n: taken - server.PICKED_PORTS[0])
        ports = server._free_ports(4)
    assert len(set(ports)) == 4 and taken not in ports
    assert all(port in server.PICKED_PORTS and port > taken for port in ports)
    assert ports == sorted(ports)


def test_rays_log_monitor_keeps_to_the_scan_period_tessera_serve_sets():
    # Ray's own monitor code, with `local_ray_env` in its environment: below its
    # many-files threshold it once rescanned the log folder on every 0.1 s poll, whatever
    # LOG_NAME_UPDATE_INTERVAL_S said. A Ray whose monitor ignores either setting fails.
    import os
    import subprocess
    import sys

    check = (
        "import time, types\n"
        "from ray._private import log_monitor as m\n"
        "now = time.time()\n"
        "monitor = types.SimpleNamespace(log_filenames={'worker-1.out'})\n"
        "print(m.LOG_NAME_UPDATE_INTERVAL_S,"
        " m.LogMonitor.should_update_filenames(monitor, now),"
        " m.LogMonitor.should_update_filenames(monitor, now - 6))\n"
    )
    env = {**os.environ, **server.local_ray_env()}
    out = subprocess.run(
        [sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["5.0", "False", "True"]
