"""The channel between a job's coordinator and its node agents: TCP, mutually
authenticated with the job's secret, every frame sealed.

Why not the job's store: an agent must be told apart from a stranger before it
may start processes on a machine or read the job's state, and a store has no
notion of who writes. Why not plain pickles: a frame is JSON, so a peer that
holds the secret still cannot make the other side run code by sending one.

The handshake (:func:`accept` on the coordinator, :func:`connect` on an agent):

1. the coordinator sends a fresh nonce ``Nc`` (and the job's id, in the clear);
2. the agent sends its hello (its job id, node rank, arguments...) with a fresh
   nonce ``Na`` and ``HMAC(secret, "agent" Nc Na hello)``;
3. the coordinator checks the MAC (else refuses: one clear frame, then it closes)
   and answers with ``HMAC(secret, "coordinator" Na Nc reply)``, which the agent
   checks in turn: an agent never obeys a coordinator without the secret.

Both then derive a session key from the secret and both nonces; every later
frame carries ``HMAC(session key, direction, sequence number, payload)``: a
frame that is forged, replayed, reordered or sent the wrong way ends the link.
The secret itself never travels.

Invariants: :meth:`Link.send` may be called from any thread (one lock orders
the frames and their sequence numbers); :meth:`Link.recv` and
:meth:`Link.poll` only from the one thread that owns the link's reading side.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import threading
import time
from typing import Any

#: seconds between two beats on an idle link (each side beats)
BEAT_INTERVAL = 0.2
#: largest frame accepted (bytes): a hello, a worker's environment, a batch of exits
MAX_FRAME = 4 << 20
#: seconds a handshake may take before the other side is dropped
HANDSHAKE_TIMEOUT = 5.0
_HEADER = struct.Struct("!I")
_MAC_SIZE = 32
_PROTOCOL = "inprocess-link/1"


class LinkError(Exception):
    """The link failed: closed, timed out, or a frame that is not authentic."""


class Refused(LinkError):
    """The other side refused this one (its reason is the message; ``surplus``:
    only because the job has all the machines it can use)."""

    def __init__(self, reason: str, surplus: bool = False) -> None:
        super().__init__(reason)
        self.surplus = surplus


def _digest(key: bytes, *parts: bytes) -> bytes:
    return hmac.digest(key, b"\0".join(parts), hashlib.sha256)


def _secret_key(secret: str) -> bytes:
    return hashlib.sha256(b"inprocess/link/v1\0" + secret.encode()).digest()


def _send_raw(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = sock.recv(size)
        if not chunk:
            raise LinkError("the connection was closed")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _recv_raw(sock: socket.socket) -> bytes:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > MAX_FRAME:
        raise LinkError(f"a frame of {size} bytes (at most {MAX_FRAME})")
    return _recv_exact(sock, size)


def _json(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError as ex:
        raise LinkError(f"a frame that is not JSON: {ex}") from None
    if not isinstance(value, dict):
        raise LinkError("a frame that is not a JSON object")
    return value


class Link:
    """One authenticated connection; frames are JSON objects."""

    def __init__(self, sock: socket.socket, key: bytes, outgoing: bytes, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self._key = key
        self._out = outgoing
        self._in = b"c" if outgoing == b"a" else b"a"
        self._send_seq = 0
        self._recv_seq = 0
        self._send_lock = threading.Lock()
        self._buffer = b""
        self.last_heard = time.monotonic()
        self.closed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: dict[str, Any]) -> None:
        """Sends one frame (any thread). Raises :class:`LinkError` if it cannot."""
        payload = json.dumps(message, separators=(",", ":")).encode()
        with self._send_lock:
            if self.closed:
                raise LinkError("the link is closed")
            seq = str(self._send_seq).encode()
            self._send_seq += 1
            mac = _digest(self._key, self._out, seq, payload)
            try:
                _send_raw(self.sock, mac + payload)
            except OSError as ex:
                raise LinkError(f"cannot send to {self.peer}: {ex}") from None

    def beat(self) -> None:
        self.send({"t": "beat"})

    def _open(self, data: bytes) -> dict[str, Any]:
        if len(data) < _MAC_SIZE:
            raise LinkError(f"a short frame from {self.peer}")
        mac, payload = data[:_MAC_SIZE], data[_MAC_SIZE:]
        seq = str(self._recv_seq).encode()
        if not hmac.compare_digest(mac, _digest(self._key, self._in, seq, payload)):
            raise LinkError(f"a frame from {self.peer} that is not authentic")
        self._recv_seq += 1
        self.last_heard = time.monotonic()
        return _json(payload)

    def poll(self) -> list[dict[str, Any]]:
        """The frames that arrived, without blocking (beats included).

        Raises:
            LinkError: the peer closed the connection, or sent a bad frame.
        """
        frames = []
        while True:
            try:
                chunk = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as ex:
                raise LinkError(f"the link to {self.peer} failed: {ex}") from None
            if not chunk:
                self._drain(frames)
                raise LinkError(f"{self.peer} closed the link")
            self._buffer += chunk
        self._drain(frames)
        return frames

    def _drain(self, frames: list[dict[str, Any]]) -> None:
        while len(self._buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buffer)
            if size > MAX_FRAME:
                raise LinkError(f"a frame of {size} bytes from {self.peer}")
            if len(self._buffer) < _HEADER.size + size:
                break
            data = self._buffer[_HEADER.size : _HEADER.size + size]
            self._buffer = self._buffer[_HEADER.size + size :]
            frames.append(self._open(data))

    def close(self) -> None:
        with self._send_lock:
            self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def connect(
    address: tuple[str, int], secret: str, hello: dict[str, Any], timeout: float
) -> tuple[Link, dict[str, Any]]:
    """An agent's link to the coordinator at ``address``, and the coordinator's reply.

    Raises:
        Refused: the coordinator refused this agent (its reason is the message).
        LinkError: no authentic coordinator answered (closed, wrong secret, timeout).
        OSError: nobody listens at ``address`` (yet).
    """
    sock = socket.create_connection(address, timeout=timeout)
    peer = f"{address[0]}:{address[1]}"
    try:
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        first = _json(_recv_raw(sock))
        if first.get("protocol") != _PROTOCOL:
            raise LinkError(f"{peer} is not an inprocess-run coordinator")
        theirs = bytes.fromhex(str(first.get("nonce", "")))
        ours = os.urandom(16)
        key = _secret_key(secret)
        body = json.dumps(hello, sort_keys=True).encode()
        proof = _digest(key, b"agent", theirs, ours, body)
        _send_raw(
            sock, json.dumps({"hello": hello, "nonce": ours.hex(), "mac": proof.hex()}).encode()
        )
        answer = _json(_recv_raw(sock))
        if "refused" in answer:
            raise Refused(str(answer["refused"]), bool(answer.get("surplus")))
        reply = answer.get("reply")
        body = json.dumps(reply, sort_keys=True).encode()
        expected = _digest(key, b"coordinator", ours, theirs, body)
        if not isinstance(reply, dict) or not hmac.compare_digest(
            bytes.fromhex(str(answer.get("mac", ""))), expected
        ):
            raise LinkError(f"the coordinator at {peer} does not hold this job's secret")
        sock.settimeout(None)
        session = _digest(key, b"session", theirs, ours)
        return Link(sock, session, b"a", peer), reply
    except (OSError, ValueError, struct.error) as ex:
        sock.close()
        if isinstance(ex, LinkError):
            raise
        raise LinkError(f"the handshake with {peer} failed: {ex}") from None
    except BaseException:
        sock.close()
        raise


class Handshake:
    """The coordinator's side of one agent's handshake (:func:`accept`)."""

    def __init__(self, sock: socket.socket, peer: str, secret: str, job_id: str) -> None:
        self.sock = sock
        self.peer = peer
        self._key = _secret_key(secret)
        self._ours = os.urandom(16)
        self._theirs = b""
        sock.settimeout(HANDSHAKE_TIMEOUT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _send_raw(
            sock,
            json.dumps({"protocol": _PROTOCOL, "nonce": self._ours.hex(), "job": job_id}).encode(),
        )

    def hello(self) -> dict[str, Any]:
        """The agent's hello, once its MAC is checked.

        Raises:
            LinkError: no authentic hello in time (the connection is refused and closed).
        """
        try:
            frame = _json(_recv_raw(self.sock))
            hello = frame.get("hello")
            self._theirs = bytes.fromhex(str(frame.get("nonce", "")))
            body = json.dumps(hello, sort_keys=True).encode()
            expected = _digest(self._key, b"agent", self._ours, self._theirs, body)
            mac = bytes.fromhex(str(frame.get("mac", "")))
        except (OSError, ValueError, struct.error) as ex:
            self.sock.close()
            raise LinkError(f"no hello from {self.peer}: {ex}") from None
        except LinkError:
            self.sock.close()
            raise
        if not isinstance(hello, dict) or not hmac.compare_digest(mac, expected):
            self.refuse(
                "this machine's INPROCESS_JOB_SECRET is not the coordinator's (give every "
                "machine of the job the same secret)"
            )
            raise LinkError(f"{self.peer} does not hold this job's secret")
        return hello

    def refuse(self, reason: str, surplus: bool = False) -> None:
        """Tells the agent why, then closes (never raises)."""
        try:
            _send_raw(self.sock, json.dumps({"refused": reason, "surplus": surplus}).encode())
        except OSError:
            pass
        self.sock.close()

    def welcome(self, reply: dict[str, Any]) -> Link:
        """Accepts the agent: the reply, proven with the secret; the link from now on."""
        body = json.dumps(reply, sort_keys=True).encode()
        mac = _digest(self._key, b"coordinator", self._theirs, self._ours, body)
        try:
            _send_raw(self.sock, json.dumps({"reply": reply, "mac": mac.hex()}).encode())
        except OSError as ex:
            self.sock.close()
            raise LinkError(f"cannot answer {self.peer}: {ex}") from None
        self.sock.settimeout(None)
        session = _digest(self._key, b"session", self._ours, self._theirs)
        return Link(self.sock, session, b"c", self.peer)


def accept(listener: socket.socket, secret: str, job_id: str) -> Handshake:
    """Accepts one connection on ``listener`` and starts its handshake.

    Raises:
        OSError: no connection, or it failed at once.
    """
    sock, address = listener.accept()
    try:
        return Handshake(sock, f"{address[0]}:{address[1]}", secret, job_id)
    except OSError:
        sock.close()
        raise
