"""A real `tessera serve` process for tests: started with a YAML file and flags,
joined to the session's Ray, stopped with SIGINT (Ctrl-C), which must exit cleanly."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import ray

from tessera.cluster.server import _free_ports


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path
    api_key: str
    namespace: str
    grpc_port: int | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0)

    def post(self, path: str, body, **kwargs) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        data = body if isinstance(body, bytes | str) else json.dumps(body)
        return httpx.post(f"{self.url}{path}", content=data, headers=headers, timeout=120, **kwargs)

    def scheduler(self):
        return ray.get_actor("tessera-scheduler", namespace=self.namespace)


def free_port() -> int:
    """A free port below Linux's ephemeral range, as ``tessera serve`` picks its own
    (``_free_ports``): one the OS picked (bind to 0) was taken by a process of the
    server's own Ray before HAProxy bound it, and the server failed to start."""
    return _free_ports(1)[0]


def wait_for_line(process: subprocess.Popen, log: Path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in log.read_text():
            return
        if process.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"no {text!r} from tessera serve; its log:\n{log.read_text()[-5000:]}")


@contextlib.contextmanager
def serve_process(
    root: Path, settings: str, api_key: str, namespace: str, *flags: str, grpc: bool = False
) -> Iterator[Server]:
    """Run `tessera serve --config <settings> --port <free> --api-key <key> *flags`
    (plus `--grpc-port <free>` when ``grpc``); yield it once ready; on exit, SIGINT it
    and check that it stopped cleanly."""
    config = root / "serve.yaml"
    if "worker_num_cpus" not in settings:  # the session's Ray has 2 CPUs for all clusters
        settings = f"worker_num_cpus: 1\n{settings}"
    if "dtype" not in settings:  # the exact mode, which the tests compare against
        settings = f"dtype: float32\n{settings}"
    config.write_text(f"namespace: {namespace}\n{settings}")
    port, grpc_port = _free_ports(2) if grpc else (free_port(), None)
    log = root / "serve.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "tessera.cluster.cli", "serve"),
                *("--config", str(config)),
                *("--address", ray.get_runtime_context().gcs_address),
                *("--port", str(port)),
                *("--api-key", api_key),
                *(("--grpc-port", str(grpc_port)) if grpc else ()),
                *flags,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for_line(process, log, "tessera: ready at", 300)
        yield Server(f"http://127.0.0.1:{port}", process, log, api_key, namespace, grpc_port)
    finally:
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=120)
    assert code == 0, log.read_text()[-5000:]
    assert "tessera: stopped" in log.read_text()
