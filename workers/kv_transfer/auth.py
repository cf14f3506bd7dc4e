"""Who may talk to a KV sender: holders of the deployment's secret (docs/architecture.md,
"Internal listeners").

A sender's TCPStore accepts any TCP client, so the store cannot tell decode ranks from anyone
else who reaches the pod. Every control message therefore carries an HMAC-SHA256 over its
content and the queue it was posted to, keyed by a per-deployment secret that the app builder
generates and hands to the replicas (never logged, never in stats):
- mailbox messages (connect, drop, renew, stop) carry a wall-clock stamp and a nonce, so a
  captured message cannot be replayed later or twice (`ReplayGuard`);
- pair messages (pull, probe, ack, close, replies) carry a per-direction sequence number
  bound to the pair's generation, so one cannot be replayed or moved to another pair;
- when a pair's group is built, both ends prove the secret over the group itself
  (`PairChannel.connect`), so bytes only ever flow to a peer that holds it.
No secret (`KVAuth(None)`) accepts everything: library use and single-process tests.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time
from typing import Any

# A signed mailbox message older (or newer: clock skew between nodes) than this is refused.
FRESH_S = 300.0
MAC = "mac"


class Secret:
    """Bytes that never print: repr/str say only whether a secret is set."""

    __slots__ = ("_value",)

    def __init__(self, value: bytes) -> None:
        if len(value) < 16:
            raise ValueError("a KV secret needs at least 16 bytes")
        self._value = bytes(value)

    @classmethod
    def generate(cls) -> Secret:
        return cls(secrets.token_bytes(32))

    def reveal(self) -> bytes:
        return self._value

    def __repr__(self) -> str:
        return "Secret(<redacted>)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and hmac.compare_digest(self._value, other._value)

    def __hash__(self) -> int:
        return hash(Secret)

    def __getstate__(self) -> bytes:  # picklable (Serve init args, Ray actor args)
        return self._value

    def __setstate__(self, state: bytes) -> None:
        self._value = state


class KVAuth:
    """Signs and checks control messages with the deployment's secret (or accepts all)."""

    def __init__(self, secret: Secret | bytes | None) -> None:
        if isinstance(secret, bytes):
            secret = Secret(secret)
        self._key = secret.reveal() if secret is not None else None

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def mac(self, context: str, data: bytes) -> str:
        assert self._key is not None
        return hmac.new(self._key, context.encode() + b"\0" + data, hashlib.sha256).hexdigest()

    def sign(self, msg: dict[str, Any], context: str) -> dict[str, Any]:
        """`msg` with its MAC over `context` (the queue it is posted to) and its content."""
        if self._key is None:
            return msg
        body = {k: v for k, v in msg.items() if k != MAC}
        return {**body, MAC: self.mac(context, _canonical(body))}

    def verify(self, msg: dict[str, Any], context: str) -> bool:
        if self._key is None:
            return True
        mac = msg.get(MAC)
        if not isinstance(mac, str):
            return False
        body = {k: v for k, v in msg.items() if k != MAC}
        return hmac.compare_digest(mac, self.mac(context, _canonical(body)))

    def stamp(self, msg: dict[str, Any], context: str) -> dict[str, Any]:
        """A mailbox message: signed, with a time stamp and a nonce against replays."""
        if self._key is None:
            return msg
        return self.sign({**msg, "ts": time.time(), "nonce": secrets.token_hex(12)}, context)

    def challenge_reply(self, nonce: bytes, role: str, context: str) -> bytes:
        """The proof a pair end (`role`) gives for the peer's `nonce` (32 bytes)."""
        assert self._key is not None
        return hmac.new(self._key, f"{role}:{context}".encode() + nonce,
                        hashlib.sha256).digest()


class ReplayGuard:
    """Accepts each stamped mailbox message once, and only while it is fresh."""

    def __init__(self, auth: KVAuth, context: str, fresh_s: float = FRESH_S) -> None:
        self._auth = auth
        self._context = context
        self._fresh_s = fresh_s
        self._seen: dict[str, float] = {}  # nonce -> ts
        self._lock = threading.Lock()

    def admit(self, msg: dict[str, Any]) -> bool:
        auth = self._auth
        if not auth.enabled:
            return True
        if not auth.verify(msg, self._context):
            return False
        ts, nonce = msg.get("ts"), msg.get("nonce")
        if not isinstance(ts, (int, float)) or not isinstance(nonce, str):
            return False
        now = time.time()
        if abs(now - ts) > self._fresh_s:
            return False
        with self._lock:
            if nonce in self._seen:
                return False
            self._seen[nonce] = ts
            if len(self._seen) > 4096:  # forget what can no longer pass the freshness check
                self._seen = {n: t for n, t in self._seen.items() if now - t <= self._fresh_s}
        return True


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
