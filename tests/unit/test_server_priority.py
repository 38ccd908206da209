"""``yield_to_workers``: every process of a server's tree but its workers (and Ray's idle
worker processes, which may become workers) gets the front end's nice value."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tessera.cluster.server import FRONT_END_NICENESS, yield_to_workers

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads the process tree from /proc"
)

TITLES = ("ray::WorkerActor", "ray::IDLE", "ray::Scheduler", "sleep")


def tree_titles(root: int) -> dict[str, int]:
    """title -> pid of ``root``'s children (their argv[0])."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                title = cmdline.read().split(b"\0", 1)[0].decode()
        except (OSError, ValueError):
            continue
        if ppid == root:
            found[title] = int(entry)
    return found


@pytest.mark.skipif(
    os.getpriority(os.PRIO_PROCESS, 0) >= FRONT_END_NICENESS,
    reason="this process already runs at the front end's nice value or above",
)
def test_every_process_but_the_workers_gets_the_front_ends_nice_value():
    script = " ".join(f"(exec -a {title} sleep 60) &" for title in TITLES) + " wait"
    root = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(children := tree_titles(root.pid)) < len(TITLES):
            assert time.monotonic() < deadline, f"children not started: {children}"
            time.sleep(0.05)
        before = {title: os.getpriority(os.PRIO_PROCESS, pid) for title, pid in children.items()}
        assert set(before.values()) == {os.getpriority(os.PRIO_PROCESS, 0)}

        # bash, the scheduler's stand-in and plain sleep; never the workers
        assert yield_to_workers(root.pid) == 3
        after = {title: os.getpriority(os.PRIO_PROCESS, pid) for title, pid in children.items()}
        assert after == {
            "ray::WorkerActor": before["ray::WorkerActor"],
            "ray::IDLE": before["ray::IDLE"],
            "ray::Scheduler": FRONT_END_NICENESS,
            "sleep": FRONT_END_NICENESS,
        }
        assert os.getpriority(os.PRIO_PROCESS, root.pid) == FRONT_END_NICENESS
        assert yield_to_workers(root.pid) == 0  # nothing left to change
    finally:
        os.killpg(root.pid, signal.SIGKILL)  # exactly the group this test started
        root.wait()
