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
