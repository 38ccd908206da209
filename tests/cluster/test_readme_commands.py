"""The README's first command, as a new user runs it: in a fresh clone, in a fresh
virtual environment, it installs everything and ends with `tessera serve` answering the
README's curl example. (CI itself runs the second command, the tests, the same way.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tessera.cluster.server import SERVE_CONTROL_LOOP_S

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def readme_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)


def test_readme_run_command_serves_and_the_curl_example_answers(tmp_path):
    run_cmd, curl_cmd = (block.strip() for block in readme_blocks()[:2])
    assert run_cmd.endswith("tessera serve") and curl_cmd.startswith("curl ")
    clone = tmp_path / "tessera"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    log = tmp_path / "run.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "RAY_"))}
    with log.open("w") as out:
        # Its own session, so that the interrupt below reaches exactly what it started.
        process = subprocess.Popen(
            run_cmd,
            shell=True,
            cwd=clone,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 1200  # installs included
        while "tessera: ready at http://127.0.0.1:8000" not in log.read_text():
            assert process.poll() is None, log.read_text()[-5000:]
            assert time.monotonic() < deadline, log.read_text()[-5000:]
            time.sleep(2)
        answer = subprocess.run(
            curl_cmd, shell=True, capture_output=True, text=True, timeout=120, check=True
        )
        body = json.loads(answer.stdout)
        assert body["object"] == "chat.completion"
        # the default precision: the fast mode where this CPU runs it, and it says so
        from tessera.workers.model.loader import fast_mode_available

        chosen = "fast mode" if fast_mode_available() else "exact mode"
        assert f"auto -> float32, {chosen}" in log.read_text(), log.read_text()[-5000:]
        assert body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] > 0
        # the Ray it started runs Serve's controller loop at SERVE_CONTROL_LOOP_S, and
        # HAProxy, not Serve's proxy, listens on the port
        (controller,) = [
            p for p in descendants(process.pid) if cmdline(p).startswith("ray::ServeController")
        ]
        environ = Path(f"/proc/{controller}/environ").read_bytes().split(b"\0")
        assert f"RAY_SERVE_CONTROL_LOOP_INTERVAL_S={SERVE_CONTROL_LOOP_S}".encode() in environ
        assert b"RAY_SERVE_ENABLE_HA_PROXY=1" in environ
        assert "behind HAProxy (Ray Serve's HAProxy mode)" in log.read_text()
        assert "haproxy" in [comm(p) for p in descendants(process.pid)]
    finally:
        # `tessera serve` (the shell's child) stopped as `kill`, systemd or docker stop it:
        # SIGTERM drains and stops like Ctrl-C (which every `serve_process` test sends)
        for pid in children(process.pid):
            os.kill(pid, signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # only the session started above
            process.wait()
        shutil.rmtree(clone, ignore_errors=True)
    assert process.returncode == 0, log.read_text()[-5000:]
    assert "tessera: stopped" in log.read_text()


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def descendants(pid: int) -> list[int]:
    found = children(pid)
    return found + [d for child in found for d in descendants(child)]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def comm(pid: int) -> str:
    """The process's command name (``/proc/<pid>/comm``)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
