"""Who may pull KV blocks, and from whom a decode worker takes them: the cluster's
secret and the two proofs a pull exchanges.

The launcher generates one ``ClusterSecret`` per cluster and hands it to every worker
actor in its ``KVTransferConfig`` (Ray keeps an actor's arguments for its restarts).
The secret itself never travels on the KV path::

    decode worker                                   prefill worker <worker id>
    metadata tessera-kv-auth: "<ts>.<nonce>.<mac>"  -> checked first, in constant time:
      mac = HMAC(secret, "pull", worker id, ts, nonce)  the mac, then ts within
                                                        REPLAY_WINDOW_S, then the nonce
                                                        unused (single use)
    <- initial metadata tessera-kv-proof: HMAC(secret, "serve", worker id, nonce)
       checked before the first block is taken

A pull token names the prefill worker it is for, so a worker refuses tokens meant for
another; the proof names it too, so a decode worker takes blocks only from the worker
the scheduler named, not from whoever answers at its address. The secret authenticates;
it does not encrypt: on a network others can read, add mutual TLS.

This module imports nothing heavy: the cluster layer builds the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

#: gRPC metadata keys (lower case, as gRPC requires).
AUTH_KEY = "tessera-kv-auth"
PROOF_KEY = "tessera-kv-proof"
#: How far a pull token's time may be from the server's clock; also how long a server
#: remembers the nonces it has seen (each is taken once).
REPLAY_WINDOW_S = 300
#: Bytes of a generated secret, and the fewest a given one may have.
SECRET_BYTES = 32
_NONCE_BYTES = 16


class ClusterSecret:
    """The key the cluster's workers share. Its ``repr`` hides it, so a logged config
    does not show it."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if len(key) < SECRET_BYTES:
            raise ValueError(f"a cluster secret has at least {SECRET_BYTES} bytes")
        self._key = bytes(key)

    @classmethod
    def generate(cls) -> ClusterSecret:
        return cls(secrets.token_bytes(SECRET_BYTES))

    def __repr__(self) -> str:
        return "ClusterSecret(<hidden>)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSecret) and hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return hash(ClusterSecret)

    def __getstate__(self) -> bytes:
        return self._key

    def __setstate__(self, state: bytes) -> None:
        self._key = state

    def _mac(self, *parts: str) -> str:
        message = "\0".join(parts).encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def pull_token(self, worker_id: str, now: float | None = None) -> tuple[str, str]:
        """(the ``AUTH_KEY`` value for a pull from ``worker_id``, its nonce)."""
        ts = str(int(time.time() if now is None else now))
        nonce = secrets.token_hex(_NONCE_BYTES)
        return f"{ts}.{nonce}.{self._mac('pull', worker_id, ts, nonce)}", nonce

    def server_proof(self, worker_id: str, nonce: str) -> str:
        """What worker ``worker_id`` answers a pull with nonce ``nonce``."""
        return self._mac("serve", worker_id, nonce)

    def check_proof(self, worker_id: str, nonce: str, proof: str | None) -> bool:
        expected = self.server_proof(worker_id, nonce)
        return proof is not None and hmac.compare_digest(expected.encode(), proof.encode())


class PullGate:
    """A prefill worker's check of pull tokens: its id, the secret, the nonces seen."""

    def __init__(self, worker_id: str, secret: ClusterSecret) -> None:
        self.worker_id = worker_id
        self.secret = secret
        self._seen: dict[str, float] = {}  # nonce -> when it may be forgotten

    def admit(self, token: str | None, now: float | None = None) -> str | None:
        """The token's nonce if it admits a pull here, else None. The mac is compared
        first (constant time); only an authentic token's time and nonce are looked at."""
        if token is None or len(token) > 256:
            return None
        parts = token.split(".")
        if len(parts) != 3:
            return None
        ts, nonce, mac = parts
        expected = self.secret._mac("pull", self.worker_id, ts, nonce)
        if not hmac.compare_digest(expected.encode(), mac.encode("ascii", "replace")):
            return None
        now = time.time() if now is None else now
        if not ts.isdigit() or abs(now - int(ts)) > REPLAY_WINDOW_S:
            return None
        self._forget(now)
        if nonce in self._seen:
            return None  # a replay
        self._seen[nonce] = now + 2 * REPLAY_WINDOW_S
        return nonce

    def _forget(self, now: float) -> None:
        # Insertion order is expiry order (a constant window), so stop at the first live.
        for nonce, expiry in list(self._seen.items()):
            if expiry > now:
                break
            del self._seen[nonce]


def metadata_value(metadata, key: str) -> str | None:
    """The one value of ``key`` in gRPC metadata; None when absent or repeated."""
    values = [value for name, value in metadata or () if name == key]
    if len(values) != 1 or not isinstance(values[0], str):
        return None
    return values[0]
