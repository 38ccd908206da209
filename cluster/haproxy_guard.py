"""HAProxy (Ray Serve's HAProxy mode) kept to the serving user and to ``--host``.

Left to itself, Serve puts HAProxy's config, admin socket, server state and logs under
``/tmp/haproxy-serve`` (folders anyone may enter), creates the admin socket with mode
666 at admin level (any local user could re-route or stop traffic), and binds HAProxy's
stats page and Prometheus exporter on every interface whatever the HTTP host is. A Ray
that ``tessera serve`` starts runs HAProxy through a ``PrivateHAProxy`` instead:

- every one of those paths lies in a folder made for this server with mode 0700
  (``mkdtemp``), removed when it stops: no other user can reach the socket;
- Serve starts HAProxy through a launcher written there (``RAY_SERVE_HAPROXY_BINARY_PATH``)
  which rewrites the config Serve wrote (``harden_config``) and then execs the real
  binary with the same arguments, so Serve's checks of the process (its pid, the config
  path on its command line) hold: the admin socket at mode 600, and every listener bound
  on all interfaces moved to the HTTP frontend's own address (``--host``).

Nothing here imports Ray: the launcher runs at every HAProxy start and reload.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import sys
import tempfile
from collections.abc import MutableMapping
from pathlib import Path
from typing import NoReturn

#: The admin socket's mode: the serving user only.
SOCKET_MODE = "600"
#: The launcher's file name in the private folder.
LAUNCHER = "haproxy"
#: The folder's name: ``mkdtemp`` adds 8 characters.
_PREFIX = "tessera-hap-"
#: What Serve adds to a path under ours: ``/<node id (56 hex)>/metrics.sock``.
_SERVE_SUFFIX = 1 + 56 + len("/metrics.sock")
#: The longest Unix socket path HAProxy 2.8 takes in its config (Linux's is 107).
_MAX_SOCKET_PATH = 97

_STATS_SOCKET = re.compile(r"^(\s*stats socket \S+)(.*)$")
_MODE = re.compile(r"\bmode \d+")
_BIND = re.compile(r"^(\s*bind )(\S*):(\d+)(.*)$")
#: What HAProxy and Serve write for "every interface".
_EVERY_INTERFACE = ("", "*", "0.0.0.0", "::", "[::]")


def harden_config(text: str) -> str:
    """``text`` (an HAProxy config as Serve writes it) with its admin socket at mode 600
    and its listeners on every interface moved to the HTTP frontend's address, when that
    address is not every interface itself."""
    lines = text.splitlines(keepends=True)
    host = _frontend_host(lines)
    out = []
    for line in lines:
        body = line.rstrip("\n")
        newline = line[len(body) :]
        socket = _STATS_SOCKET.match(body)
        if socket is not None:
            head, options = socket.groups()
            if _MODE.search(options):
                options = _MODE.sub(f"mode {SOCKET_MODE}", options)
            else:
                options = f" mode {SOCKET_MODE}{options}"
            body = head + options
        bind = _BIND.match(body)
        if bind is not None and host is not None and bind.group(2) in _EVERY_INTERFACE:
            body = f"{bind.group(1)}{host}:{bind.group(3)}{bind.group(4)}"
        out.append(body + newline)
    return "".join(out)


def _frontend_host(lines: list[str]) -> str | None:
    """The address of ``frontend http_frontend``'s first bind; None when it is every
    interface (or there is none): then nothing moves."""
    section = None
    for line in lines:
        if line and not line[0].isspace():
            section = line.split("#", 1)[0].strip()
            continue
        bind = _BIND.match(line.rstrip("\n"))
        if section == "frontend http_frontend" and bind is not None:
            host = bind.group(2)
            return None if host in _EVERY_INTERFACE else host
    return None


def harden_file(path: Path) -> None:
    """Rewrite the config at ``path`` in place, under the lock Serve writes it with."""
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            text = path.read_text()
            hardened = harden_config(text)
            if hardened != text:
                partial = path.with_name(f".{path.name}.{os.getpid()}")
                partial.write_text(hardened)
                partial.replace(path)  # HAProxy never reads half a file
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def launch(real_binary: str, argv: list[str]) -> NoReturn:
    """The launcher's body: harden the config named by ``-f``, then become HAProxy."""
    args = argv[1:]
    for flag, value in zip(args, args[1:], strict=False):
        if flag == "-f" and Path(value).is_file():
            harden_file(Path(value))
    os.execv(real_binary, [real_binary, *args])


class PrivateHAProxy:
    """A folder only this user can open, holding HAProxy's files and its launcher."""

    def __init__(self, root: Path, real_binary: str) -> None:
        self.root = root
        self.real_binary = real_binary

    @classmethod
    def create(cls, real_binary: str) -> PrivateHAProxy:
        """Make the folder (mode 0700) and the launcher of ``real_binary``."""
        base = tempfile.gettempdir()
        if len(base) + 1 + len(_PREFIX) + 8 + _SERVE_SUFFIX > _MAX_SOCKET_PATH:
            base = "/tmp"  # Serve's socket paths under $TMPDIR would be too long
        root = Path(tempfile.mkdtemp(prefix=_PREFIX, dir=base))  # mode 0700
        launcher = root / LAUNCHER
        launcher.write_text(
            f"#!{sys.executable}\n"
            "# Written by tessera serve: HAProxy's config hardened, then HAProxy itself.\n"
            "import sys\n"
            "from tessera.cluster.haproxy_guard import launch\n"
            f"launch({real_binary!r}, sys.argv)\n"
        )
        launcher.chmod(0o700)
        return cls(root, real_binary)

    def env(self) -> dict[str, str]:
        """Serve's HAProxy settings that put every file here and start the launcher."""
        root = str(self.root)
        return {
            "RAY_SERVE_HAPROXY_BINARY_PATH": str(self.root / LAUNCHER),
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": f"{root}/haproxy.cfg",
            "RAY_SERVE_HAPROXY_SOCKET_PATH": f"{root}/admin.sock",
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": f"{root}/metrics.sock",
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": root,
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": f"{root}/server-state",
        }

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            shutil.rmtree(self.root)


def guard_haproxy(environ: MutableMapping[str, str] = os.environ) -> PrivateHAProxy | None:
    """For a Ray about to start with ``environ`` (its processes inherit it) in HAProxy
    mode: a ``PrivateHAProxy`` set up in it; None where HAProxy mode is off. Paths
    already set in ``environ`` win; the launcher wraps whichever binary Serve would run."""
    if environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        return None
    from ray.serve._private.haproxy import _resolve_haproxy_binary

    private = PrivateHAProxy.create(_resolve_haproxy_binary())
    for name, value in private.env().items():
        if name == "RAY_SERVE_HAPROXY_BINARY_PATH":
            environ[name] = value
        else:
            environ.setdefault(name, value)
    return private
