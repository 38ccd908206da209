"""``tessera serve``: Ray, the cluster and the HTTP app, up until Ctrl-C, then down.

Order of start: check the configuration and the ports; join Ray (``address``) or
start a local Ray; start the scheduler and its workers (this process owns them); start
Ray Serve's HTTP proxy on ``host:port`` (and its gRPC proxy on ``grpc_port``) and
deploy the app (``tessera.cluster.serve_app``), whose replicas find the scheduler by name;
print the ready line. On SIGINT or SIGTERM, the
reverse: Serve stops taking requests and lets ongoing ones finish (up to
``graceful_shutdown_s``), then the workers and the scheduler stop, then Ray if this
process started it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time

import ray
from ray import serve

from tessera.cluster import exit_status
from tessera.cluster.cluster_config import ConfigError
from tessera.cluster.environment import check_environment
from tessera.cluster.grpc_api import SERVICER_FUNCTIONS
from tessera.cluster.haproxy_guard import guard_haproxy
from tessera.cluster.launch import Cluster
from tessera.cluster.serve_config import ServeConfig

logger = logging.getLogger(__name__)

#: The Serve application's name.
APP_NAME = "tessera"
#: Ray Serve's gRPC message limit (read by its processes at import).
GRPC_MAX_MESSAGE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"
DEFAULT_MAX_REQUEST_BYTES: int = ServeConfig.model_fields["max_request_bytes"].default
#: Ray Serve's controller loop period (``RAY_SERVE_CONTROL_LOOP_INTERVAL_S``) in a Ray
#: that ``tessera serve`` starts, unless set already. Serve's 0.1 s kept the idle
#: controller at ~2.8% of a core (and GCS at ~1.7%): with the worker's threads on every
#: core, that background slowed the engine by ~14% (docs/architecture.md).
SERVE_CONTROL_LOOP_S = "0.5"
#: How often a Serve replica (and router) hands its cached request counters to Ray's
#: metrics (``RAY_SERVE_METRICS_EXPORT_INTERVAL_MS``): Serve's 100 ms woke every replica
#: ten times a second; Ray exports its metrics every 10 s anyway.
SERVE_METRICS_EXPORT_MS = "1000"
#: How often Ray's log monitor looks for new log files (``LOG_NAME_UPDATE_INTERVAL_S``,
#: Ray's default 0.5 s); lines of files it knows are still read as they come.
LOG_NAME_UPDATE_S = "5"
#: Ray's log monitor keeps to ``LOG_NAME_UPDATE_S`` only once it watches this many files
#: (``RAY_LOG_MONITOR_MANY_FILES_THRESHOLD``, default 1,000); below, it globs the log
#: folder on every 0.1 s poll. 0: the period holds for any number of files.
LOG_MONITOR_MANY_FILES = "0"
#: Ray's own bookkeeping that nothing of a local ``tessera serve`` reads (it starts Ray
#: without the dashboard; its ``/metrics`` are its own): every process's task events
#: for the state API (``RAY_task_events_report_interval_ms``, 0 turns them off), its
#: metrics for the dashboard agent (``RAY_enable_metrics_collection``) and per-handler
#: timing of its event loops (``RAY_event_stats``). Off, an idle server's processes
#: took 12.1% of a core instead of 15.6% (90 s each, ``docs/architecture.md``).
RAY_BOOKKEEPING_OFF = {
    "RAY_task_events_report_interval_ms": "0",
    "RAY_enable_metrics_collection": "0",
    "RAY_event_stats": "0",
}
#: In a Ray that ``tessera serve`` starts: the nice value of its Ray actor processes
#: (``RAY_worker_niceness``, Ray's default 15), so the workers start at it, and the one
#: that ``yield_to_workers`` gives every other process of the server once it is up.
WORKER_NICENESS = "0"
FRONT_END_NICENESS = 19
#: How often the server gives that nice value again to processes started since (a Serve
#: replica added, the scheduler restarted after a failure: they start at the workers').
YIELD_PERIOD_S = 30.0


def haproxy_available() -> bool:
    """Whether this Ray has Serve's HAProxy mode and its HAProxy binary runs here."""
    try:  # the same search as Serve's, without its log line
        from ray.serve._private.haproxy import _resolve_haproxy_binary

        binary = _resolve_haproxy_binary()
        return subprocess.run([binary, "-v"], capture_output=True, timeout=10).returncode == 0
    except (ImportError, OSError, subprocess.SubprocessError):
        return False


def local_ray_env(max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> dict[str, str]:
    """Ray Serve's settings for a Ray that ``tessera serve`` starts (its processes inherit
    this process's environment); a value already in the environment wins.

    - gRPC's largest message (``RAY_SERVE_GRPC_MAX_MESSAGE_SIZE``, the receive and send
      limit of Serve's gRPC proxy and of a replica's own gRPC server behind HAProxy) is
      ``max_request_bytes``, as HTTP's body limit: Serve's default, 2 GiB, let a caller
      make the proxy take and parse that much before any key was checked. gRPC refuses
      a larger message with ``RESOURCE_EXHAUSTED`` before it reads it.

    - Fewer wake-ups in the background: Serve's controller loop at
      ``SERVE_CONTROL_LOOP_S``, its replicas' metrics export at
      ``SERVE_METRICS_EXPORT_MS``, Ray's log monitor's file scan at
      ``LOG_NAME_UPDATE_S`` (``LOG_MONITOR_MANY_FILES``), and Ray's bookkeeping that
      nothing here reads off (``RAY_BOOKKEEPING_OFF``). The worker's threads spin on
      every core, and each wake-up beside them stalls both: with an idle cluster up, a
      one-sequence decode step took 8.6-9.0 ms against 7.2-7.4 with every Ray process
      paused; with these periods (and the scheduler's 1 s reports) 8.0 against 7.2-7.5.
    - HAProxy mode, where the binary runs (``ray[serve]`` bundles it on Linux): HAProxy
      listens on ``host:port`` (and ``grpc_port``) and forwards each connection to the
      replica's own HTTP (gRPC) server, so no token crosses Serve's Python proxy. Over
      HTTP it gave 247-281 tok/s at 64 concurrent (four runs) against 217-228 through
      the proxy, and at 1 concurrent a p50 TTFT of 66-118 against 101-155 ms (README).
    - A replica behind HAProxy stays up this long after it is told to stop, for load
      balancers on other nodes to drop it (Serve's default, 30 s, made every Ctrl-C
      wait 30 s): 0, since this Ray's one HAProxy stops first. Ongoing requests still
      get ``graceful_shutdown_s``.
    - HAProxy's stats and Prometheus ports and Serve's fallback proxy (which HAProxy
      uses while no replica is up) on free ports: Serve's fixed defaults (8404, 9101,
      8500, 9500) let only one such Ray run on a machine.
    """
    env = {
        GRPC_MAX_MESSAGE_ENV: str(max_request_bytes),
        "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": SERVE_CONTROL_LOOP_S,
        "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": SERVE_METRICS_EXPORT_MS,
        "LOG_NAME_UPDATE_INTERVAL_S": LOG_NAME_UPDATE_S,
        "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": LOG_MONITOR_MANY_FILES,
        **RAY_BOOKKEEPING_OFF,
    }
    if haproxy_available():
        env["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
        env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = "0"
        names = (
            "RAY_SERVE_HAPROXY_STATS_PORT",
            "RAY_SERVE_HAPROXY_METRICS_PORT",
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
            "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
        )
        for name, port in zip(names, _free_ports(len(names)), strict=True):
            env[name] = str(port)
    return env


#: Where ``_free_ports`` looks: below Linux's ephemeral range (32768-60999), whose ports
#: every Ray process binds as it starts (a port the OS had picked for us before
#: ``ray.init`` was once taken by one of them before Serve bound it, and ``tessera
#: serve`` failed), and below Serve's direct-ingress ports (30000 up).
PICKED_PORTS = range(20000, 30000)


def _free_ports(count: int) -> list[int]:
    """``count`` different ports of ``PICKED_PORTS``, each free on every interface now,
    from a random start (two servers starting at once rarely try the same); the OS's
    picks for those the range cannot give."""
    ports: list[int] = []
    start = random.randrange(len(PICKED_PORTS))
    with contextlib.ExitStack() as held:  # each pick stays bound until all are made
        for i in range(len(PICKED_PORTS)):
            if len(ports) == count:
                break
            port = PICKED_PORTS[(start + i) % len(PICKED_PORTS)]
            try:
                held.enter_context(socket.create_server(("", port)))
            except OSError:
                continue
            ports.append(port)
        while len(ports) < count:
            sock = held.enter_context(socket.create_server(("", 0)))
            ports.append(sock.getsockname()[1])
    return ports


def _process_tree(root: int) -> list[int]:
    """``root`` and every process under it, from ``/proc`` (Linux)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):  # gone meanwhile
                continue
            children[ppid].append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children[pid]
    return tree


def yield_to_workers(root: int, niceness: int = FRONT_END_NICENESS) -> int:
    """Give process ``root`` and every process under it but the workers the nice value
    ``niceness``, as ``renice -n`` does (``setpriority`` on each process id: its main
    thread, and the threads it starts from now on); return how many changed.

    The workers (``ray::WorkerActor``) and Ray's idle worker processes (``ray::IDLE``,
    which may become workers) keep theirs: ``WORKER_NICENESS`` where ``tessera serve``
    started Ray. On a machine whose cores the workers' compute threads fill, every
    wake-up of another process (Serve's replica, proxy, HAProxy and controller, the
    scheduler, Ray's GCS, raylet and agents) preempted one of them, and each OpenMP
    region waits for its slowest thread: with the rest at 19 and the worker at 0, HTTP
    gave 349.9 / 425.2 and 380.2 / 469.3 tok/s at 16 / 64 concurrent against 289.4 /
    364.2 and 341.6 / 426.5 with every actor at Ray's 15 and Ray's own processes at 0
    (alternating, 2-core Xeon). The threads a process had before (Ray's I/O and gRPC
    threads, a Serve replica's event loop) keep their nice value, and must: with every
    thread at 19 the front end starved, the worker ran ~8 ms steps of a few sequences and
    HTTP gave 194-262 tok/s against 391-483 (16 / 64 concurrent, 2-core Zen 5). Only
    raising nice values: no privilege needed."""
    changed = 0
    if not sys.platform.startswith("linux"):
        return changed
    for pid in _process_tree(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                title = cmdline.read().split(b"\0", 1)[0].decode(errors="replace")
            if title.startswith(("ray::WorkerActor", "ray::IDLE")):
                continue
            if os.getpriority(os.PRIO_PROCESS, pid) < niceness:
                os.setpriority(os.PRIO_PROCESS, pid, niceness)
                changed += 1
        except OSError:  # gone meanwhile, or not ours to change
            continue
    return changed


def front_door_text() -> str:
    """Which front door a Ray that this process started has, for the ready line."""
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        return "HAProxy (Ray Serve's HAProxy mode)"
    return "Ray Serve's proxy"


def check_port(host: str, port: int, field: str = "port") -> None:
    """Raise ``ConfigError`` naming ``field`` when ``host:port`` cannot be listened on."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as error:
        where = f"{host}:{port}" if host else f"port {port}"
        raise ConfigError(f"{field}: cannot listen on {where} ({error.strerror})") from None


def grpc_options(config: ServeConfig) -> dict | None:
    """Serve's ``grpc_options`` for the gRPC API; None when it is off."""
    if config.grpc_port is None:
        return None
    return {"port": config.grpc_port, "grpc_servicer_functions": list(SERVICER_FUNCTIONS)}


def _serve_running() -> bool:
    """Whether Ray Serve already runs on the Ray cluster (another app's, perhaps)."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return False
    return True


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _say(text: str) -> None:
    print(f"tessera: {text}", flush=True)


def run_server(config: ServeConfig, log_level: str = "WARNING") -> int:
    """Serve until SIGINT/SIGTERM; return the exit code."""
    check_environment(config)
    check_port(config.host, config.port)
    if config.grpc_port is not None:
        check_port("", config.grpc_port, "grpc_port")  # Serve listens on every interface
    for sig in (signal.SIGINT, signal.SIGTERM):  # also where SIGINT was ignored (nohup, &)
        signal.signal(sig, _interrupt)  # as Ctrl-C: drain, then stop
    start = time.perf_counter()
    owns_ray = not ray.is_initialized()
    local_ray = owns_ray and config.address is None
    if local_ray:  # its processes get this environment
        for name, value in local_ray_env(config.max_request_bytes).items():
            os.environ.setdefault(name, value)
        os.environ.setdefault("RAY_worker_niceness", WORKER_NICENESS)
    # HAProxy's socket and files in a folder of this user's, its listeners on host
    haproxy = guard_haproxy() if local_ray else None
    if owns_ray:
        _say("starting Ray ..." if config.address is None else f"joining Ray at {config.address}")
        ray.init(
            address=config.address,
            namespace=config.namespace,
            include_dashboard=False,
            logging_level=log_level,
        )
        signal.signal(signal.SIGTERM, _interrupt)  # ray.init put its own (exit at once)
    cluster = None
    serve_was_running = True  # until known otherwise: never shut down someone's Serve
    try:
        _say(f"starting {config.workers_text} with model {config.model_name} ...")
        cluster = asyncio.run(Cluster.start(config.cluster_config()))
        _say(f"starting the HTTP server on {config.host}:{config.port} ...")
        from tessera.cluster.serve_app import build_app

        serve_was_running = _serve_running()
        if serve_was_running:
            _say("Ray Serve already runs on this Ray cluster: adding the app to it")
        serve.start(
            http_options={"host": config.host, "port": config.port},
            grpc_options=grpc_options(config),
            logging_config={"log_level": log_level},
        )
        serve.run(
            build_app(config),
            name=APP_NAME,
            route_prefix="/",
            logging_config={"log_level": log_level},
        )
        url = f"http://{config.host}:{config.port}"
        grpc = f", gRPC on port {config.grpc_port}" if config.grpc_port is not None else ""
        precision = config.precision_text(
            cluster.worker_num_cpus, cluster.precision, cluster.device
        )
        door = f", behind {front_door_text()}" if local_ray else ""
        if local_ray:
            logger.info(
                "%d of the server's processes now at nice %d",
                yield_to_workers(os.getpid()),
                FRONT_END_NICENESS,
            )
        _say(
            f"ready at {url}{grpc}{door} in {time.perf_counter() - start:.1f} s: model "
            f"{config.model_name!r}, {config.workers_text}, {precision}; try "
            f"{url}/v1/models "
            "(Ctrl-C stops)"
        )
        try:
            while True:
                time.sleep(YIELD_PERIOD_S if local_ray else 3600)
                if local_ray:
                    yield_to_workers(os.getpid())
        except KeyboardInterrupt:
            _say(f"draining (up to {config.graceful_shutdown_s:g} s for ongoing requests) ...")
        return exit_status.OK
    finally:
        if serve_was_running:
            with contextlib.suppress(Exception):
                serve.delete(APP_NAME)
        else:
            serve.shutdown()
        if cluster is not None:
            try:
                asyncio.run(cluster.shutdown())
            except Exception as error:  # Ray's own text names actors and pids: the log
                logger.warning("the cluster did not stop cleanly: %s", error)
                _say(f"the cluster did not stop cleanly ({type(error).__name__})")
        if owns_ray:
            ray.shutdown()
        if haproxy is not None:
            haproxy.remove()
        _say("stopped")
        sys.stdout.flush()
