"""A small etcd v3 client on the standard library only.

The launcher keeps its coordinator's durable state in etcd and elects the
coordinator through an etcd lease (``--rdzv-backend etcd``). The core install
pulls no etcd package: this client speaks to etcd's v3 HTTP/JSON gateway
(served at ``/v3/...`` by etcd >= 3.4) with :mod:`http.client`.

What the gateway does, and this module hides:

* keys and values travel base64-encoded; int64 fields (revisions, lease ids,
  TTLs) are JSON strings;
* a field at its zero value is left out: no ``"kvs"`` means no key, no
  ``"succeeded"`` means the transaction's compare failed, no ``"TTL"`` in a
  keepalive's answer means the lease is gone;
* errors come back as HTTP 4xx/5xx with ``{"error": "...", "message": "...",
  "code": N}`` (``N`` a gRPC code), or, from the streaming keepalive endpoint,
  ``{"error": {"grpc_code": N, "message": "...", ...}}``;
* a request to a member without a quorum hangs until the gateway's own
  deadline (about 6 s) before it answers "request timed out" or "context
  deadline exceeded": the client gives up on that member earlier.

Each call goes to the endpoint that answered last and fails over to the next
when one is refused, times out, or answers "unavailable" (no leader, request
timed out, HTTP 5xx), all within ``timeout`` seconds per call; then it raises
:class:`EtcdUnavailable`. Reads are linearizable (etcd's default): a member cut
off from the quorum answers none, rather than a stale one.

A call that failed over after a timeout may have been applied by the member
that did not answer in time (a put, a transaction, a lease grant): the caller
guards what matters with :meth:`Etcd.txn` on revisions, and a lease granted
twice expires unused.

Values are never logged (they carry signed job state); the log is at debug level.
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import json
import logging
import math
import threading
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

#: etcd's client port, when an endpoint names none
DEFAULT_PORT = 2379

#: gRPC codes that mean "try another member": DEADLINE_EXCEEDED, UNAVAILABLE
_RETRY_CODES = frozenset({4, 14})
#: gRPC code NOT_FOUND (a lease that is gone)
_NOT_FOUND = 5
#: words of an error message that mean "this member cannot serve now"
_RETRY_WORDS = (
    "no leader",
    "timed out",
    "timeout",
    "leader changed",
    "unavailable",
    "deadline exceeded",
    "not capable",
    "too many requests",
)


class EtcdError(Exception):
    """etcd answered, with an error; the message carries etcd's own text.

    ``code`` is the gRPC code etcd gave (None when none), ``status`` the HTTP
    status and ``endpoint`` the member that answered."""

    def __init__(
        self, message: str, code: int | None = None, status: int | None = None,
        endpoint: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.code = code
        self.status = status
        self.endpoint = endpoint


class EtcdUnavailable(EtcdError):
    """No endpoint gave an answer within the call's timeout; the message names
    every endpoint and what each did ("refused", "timed out", "etcdserver: no
    leader", ...) on one line."""


# -- endpoints ----------------------------------------------------------------

_ENDPOINT_FORM = "HOST[:PORT] or http(s)://HOST[:PORT], comma-separated (PORT defaults to 2379)"


def _parse_one(item: str, what: str) -> str:
    def bad(why: str) -> ValueError:
        return ValueError(f"{what}: bad etcd endpoint {item!r} ({why}); expected {_ENDPOINT_FORM}")

    text = item.strip()
    if not text:
        raise bad("empty")
    if any(c.isspace() for c in text):
        raise bad("contains whitespace")
    if "://" not in text:
        text = f"http://{text}"
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port
    except ValueError as e:
        raise bad(str(e)) from None
    if parts.scheme not in ("http", "https"):
        raise bad(f"scheme {parts.scheme!r} is not http or https")
    if parts.username is not None or parts.password is not None:
        raise bad("credentials in the address are not supported")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise bad("a path, query or fragment is not allowed")
    host = parts.hostname
    if not host:
        raise bad("no host")
    if parts.netloc.endswith(":"):
        raise bad("empty port")
    if port is None:
        port = DEFAULT_PORT
    if not 1 <= port <= 65535:
        raise bad(f"port {port} outside 1..65535")
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return f"{parts.scheme}://{host}:{port}"


def parse_endpoints(text: str, what: str = "--rdzv-endpoint") -> list[str]:
    """The etcd endpoints of ``text`` (``"h1:2379,h2:2379"``, each optionally
    with an ``http://`` or ``https://`` scheme; a missing port is 2379) as
    normalized URLs ``"http://h:p"``, in order, duplicates dropped.

    Raises ValueError naming ``what``, the bad item and the allowed form."""
    if not isinstance(text, str):
        raise ValueError(f"{what}: expected a string of {_ENDPOINT_FORM}, got {text!r}")
    if not text.strip():
        raise ValueError(f"{what}: no etcd endpoint given; expected {_ENDPOINT_FORM}")
    found: list[str] = []
    for item in text.split(","):
        url = _parse_one(item, what)
        if url not in found:
            found.append(url)
    return found


# -- data ---------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _key_bytes(key: str) -> bytes:
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, got {type(key).__name__}")
    return key.encode("utf-8", "surrogateescape")


def _value_bytes(value: bytes | str, what: str = "value") -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{what} must be bytes or str, got {type(value).__name__}")


def _lease_id(lease: int, what: str = "lease") -> int:
    if isinstance(lease, bool) or not isinstance(lease, int) or lease < 0:
        raise ValueError(f"{what} must be an int >= 0 (a lease id; 0: none), got {lease!r}")
    return lease


def _prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


def _int(message: dict, field: str) -> int:
    """An int64 field of the gateway's JSON: a string, or absent for zero."""
    return int(message.get(field, 0) or 0)


@dataclasses.dataclass(frozen=True)
class KeyValue:
    """One key as etcd stores it: its value and revisions (``create_revision``:
    the revision that created it; ``mod_revision``: the last change; ``version``:
    changes since creation; ``lease``: the lease it is attached to, 0 for none)."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_json(cls, kv: dict) -> KeyValue:
        return cls(
            key=base64.b64decode(kv.get("key", "")).decode("utf-8", "surrogateescape"),
            value=base64.b64decode(kv.get("value", "")),
            create_revision=_int(kv, "create_revision"),
            mod_revision=_int(kv, "mod_revision"),
            version=_int(kv, "version"),
            lease=_int(kv, "lease"),
        )

    def __repr__(self) -> str:  # never the value: it may carry signed job state
        return (
            f"KeyValue(key={self.key!r}, value=<{len(self.value)} bytes>, "
            f"create_revision={self.create_revision}, mod_revision={self.mod_revision}, "
            f"version={self.version}, lease={self.lease})"
        )


_TARGETS = {
    "create": ("CREATE", "create_revision"),
    "mod": ("MOD", "mod_revision"),
    "version": ("VERSION", "version"),
    "value": ("VALUE", "value"),
    "lease": ("LEASE", "lease"),
}
_RESULTS = {"=": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}


@dataclasses.dataclass(frozen=True)
class Compare:
    """One condition of a transaction: the ``target`` of ``key`` (``"create"``
    revision, ``"mod"`` revision, ``"version"``, ``"value"`` or ``"lease"``)
    compared by ``result`` (``"="``, ``"!="``, ``"<"``, ``">"``) with
    ``operand``. An absent key has create and mod revision 0 and version 0."""

    key: str
    target: str
    result: str
    operand: int | bytes

    def __post_init__(self) -> None:
        _key_bytes(self.key)
        if self.target not in _TARGETS:
            raise ValueError(
                f"Compare target must be one of {sorted(_TARGETS)}, got {self.target!r}"
            )
        if self.result not in _RESULTS:
            raise ValueError(
                f"Compare result must be one of {sorted(_RESULTS)}, got {self.result!r}"
            )
        if self.target == "value":
            if not isinstance(self.operand, bytes):
                raise ValueError(
                    f"Compare on value needs a bytes operand, got {type(self.operand).__name__}"
                )
        elif isinstance(self.operand, bool) or not isinstance(self.operand, int):
            raise ValueError(f"Compare on {self.target} needs an int operand, got {self.operand!r}")

    @classmethod
    def create_revision(cls, key: str, result: str, revision: int) -> Compare:
        """``key``'s create revision against ``revision`` (``= 0``: the key is absent)."""
        return cls(key, "create", result, revision)

    @classmethod
    def mod_revision(cls, key: str, result: str, revision: int) -> Compare:
        """``key``'s last modification revision against ``revision``."""
        return cls(key, "mod", result, revision)

    @classmethod
    def version(cls, key: str, result: str, version: int) -> Compare:
        """``key``'s version (changes since creation; 0: absent) against ``version``."""
        return cls(key, "version", result, version)

    @classmethod
    def value(cls, key: str, result: str, value: bytes | str) -> Compare:
        """``key``'s value against ``value``."""
        return cls(key, "value", result, _value_bytes(value))

    @classmethod
    def lease(cls, key: str, result: str, lease: int) -> Compare:
        """The lease ``key`` is attached to (0: none) against ``lease``."""
        return cls(key, "lease", result, lease)

    def to_json(self) -> dict:
        target, field = _TARGETS[self.target]
        operand = _b64(self.operand) if isinstance(self.operand, bytes) else str(self.operand)
        return {
            "key": _b64(_key_bytes(self.key)),
            "target": target,
            "result": _RESULTS[self.result],
            field: operand,
        }

    def __repr__(self) -> str:
        operand = (
            f"<{len(self.operand)} bytes>" if isinstance(self.operand, bytes) else self.operand
        )
        return f"Compare({self.key!r} {self.target} {self.result} {operand})"


@dataclasses.dataclass(frozen=True)
class Op:
    """One request of a transaction: :meth:`put`, :meth:`get` or :meth:`delete`
    (the last two of one key, or of every key under it with ``prefix``)."""

    kind: str
    key: str
    value: bytes = b""
    lease: int = 0
    prefix: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("put", "get", "delete"):
            raise ValueError(f"Op kind must be 'put', 'get' or 'delete', got {self.kind!r}")
        _key_bytes(self.key)
        _lease_id(self.lease)

    @classmethod
    def put(cls, key: str, value: bytes | str, lease: int = 0) -> Op:
        """Sets ``key`` to ``value``, attached to ``lease`` (0: none)."""
        return cls("put", key, _value_bytes(value), _lease_id(lease))

    @classmethod
    def get(cls, key: str, prefix: bool = False) -> Op:
        """Reads ``key`` (every key under it with ``prefix``)."""
        return cls("get", key, prefix=prefix)

    @classmethod
    def delete(cls, key: str, prefix: bool = False) -> Op:
        """Deletes ``key`` (every key under it with ``prefix``)."""
        return cls("delete", key, prefix=prefix)

    def _range(self) -> dict:
        key = _key_bytes(self.key)
        body = {"key": _b64(key)}
        if self.prefix:
            body["range_end"] = _b64(_prefix_end(key))
        return body

    def to_json(self) -> dict:
        if self.kind == "put":
            body = {"key": _b64(_key_bytes(self.key)), "value": _b64(self.value)}
            if self.lease:
                body["lease"] = str(self.lease)
            return {"request_put": body}
        if self.kind == "get":
            return {"request_range": self._range()}
        return {"request_delete_range": self._range()}

    def __repr__(self) -> str:
        extra = f", <{len(self.value)} bytes>, lease={self.lease}" if self.kind == "put" else ""
        return f"Op.{self.kind}({self.key!r}{extra}{', prefix' if self.prefix else ''})"


@dataclasses.dataclass(frozen=True)
class TxnResult:
    """What a transaction did: whether the compare held (``succeeded``: the
    success branch ran, else the failure branch), the store's revision after
    it, and one response per op of the branch that ran: a get gives its
    KeyValues, a put None, a delete the number of keys deleted."""

    succeeded: bool
    revision: int
    responses: list[list[KeyValue] | int | None]


# -- the client ---------------------------------------------------------------


class _Retry(Exception):
    """This endpoint cannot serve now (why: the message); try the next one."""


class Etcd:
    """A client of an etcd cluster through its v3 JSON gateway.

    ``endpoints``: a list of endpoints, or the comma-separated text
    (:func:`parse_endpoints`). ``timeout``: the seconds one call may take,
    every failover included, before it raises :class:`EtcdUnavailable`.

    Thread safe: each call opens a connection of its own; the one state shared
    between calls, the endpoint to try first, is read and set under a lock.
    """

    def __init__(self, endpoints: Sequence[str] | str, timeout: float = 2.0) -> None:
        if isinstance(endpoints, str):
            parsed = parse_endpoints(endpoints, "endpoints")
        elif isinstance(endpoints, Sequence) and endpoints:
            parsed = []
            for item in endpoints:
                if not isinstance(item, str):
                    raise ValueError(
                        f"endpoints: each must be a str ({_ENDPOINT_FORM}), got {item!r}"
                    )
                for url in parse_endpoints(item, "endpoints"):
                    if url not in parsed:
                        parsed.append(url)
        else:
            raise ValueError(
                f"endpoints: expected a non-empty list or text of {_ENDPOINT_FORM}, "
                f"got {endpoints!r}"
            )
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not (math.isfinite(timeout) and timeout > 0)
        ):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.endpoints: list[str] = parsed
        self.timeout = float(timeout)
        self._lock = threading.Lock()
        self._first = 0  # guarded by _lock: the endpoint that answered last
        self._closed = False

    def __repr__(self) -> str:
        return f"Etcd({','.join(self.endpoints)}, timeout={self.timeout:g})"

    # -- transport ------------------------------------------------------------

    def _attempt(self, endpoint: str, path: str, body: bytes, timeout: float) -> dict:
        """One request to one endpoint: its JSON answer; raises _Retry where
        another endpoint may do better, EtcdError where etcd refused the request."""
        parts = urllib.parse.urlsplit(endpoint)
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = cls(parts.hostname, parts.port, timeout=timeout)
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            status, raw = response.status, response.read()
        except ConnectionRefusedError:
            raise _Retry("refused") from None
        except TimeoutError:
            raise _Retry("timed out") from None
        except (OSError, http.client.HTTPException) as e:
            raise _Retry(f"{type(e).__name__}: {e}".strip()) from None
        finally:
            conn.close()
        # the keepalive endpoint streams: one JSON message per line
        text = raw.decode("utf-8", "replace").strip()
        try:
            answer = json.loads(text.splitlines()[0]) if text else {}
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            if status >= 500:
                raise _Retry(f"HTTP {status}")
            raise EtcdError(
                f"etcd at {endpoint} answered {path} with HTTP {status} and no JSON "
                f"({text[:100]!r}): is it etcd >= 3.4 with its v3 gateway?",
                status=status, endpoint=endpoint,
            )  # fmt: skip
        error = answer.get("error")
        if status >= 400 or (error and path == "/v3/lease/keepalive"):
            if isinstance(error, dict):  # the streaming endpoints' form
                message = str(error.get("message", error))
                code = error.get("grpc_code")
            else:
                message = str(error or answer.get("message") or f"HTTP {status}")
                code = answer.get("code")
            code = int(code) if isinstance(code, (int, str)) and str(code).isdigit() else None
            retry = (
                status >= 500
                or code in _RETRY_CODES
                or any(w in message.lower() for w in _RETRY_WORDS)
            )
            if retry:
                raise _Retry(message)
            raise EtcdError(
                f"etcd at {endpoint}: {message} (code {code}, HTTP {status}, {path})",
                code=code, status=status, endpoint=endpoint,
            )  # fmt: skip
        return answer

    def _call(self, path: str, request: dict) -> dict:
        """``request`` to the first endpoint that serves it within the timeout.

        Order: the endpoint that answered last, then the others in turn, again
        and again until the deadline. Each attempt gets at least half the time
        left (all of it when it is the last endpoint of a round): a member that
        hangs (stopped, cut off) costs part of the budget, not all of it."""
        if self._closed:
            raise EtcdError(f"{self!r} is closed")
        body = json.dumps(request).encode()
        deadline = time.monotonic() + self.timeout
        with self._lock:
            first = self._first
        n = len(self.endpoints)
        what: dict[str, str] = {}  # endpoint -> what its last attempt did
        round_ = 0
        while True:
            for i in range(n):
                index = (first + i) % n
                endpoint = self.endpoints[index]
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                attempt = min(left, max(left / (n - i), self.timeout / 2))
                try:
                    answer = self._attempt(endpoint, path, body, attempt)
                except _Retry as e:
                    what[endpoint] = str(e)
                    log.debug("etcd %s %s: %s; trying the next endpoint", endpoint, path, e)
                    continue
                except EtcdError:
                    self._answered(index)
                    raise
                self._answered(index)
                return answer
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(left, 0.05 * 2**round_, 0.25))  # an election takes ~a second
            round_ += 1
        report = ", ".join(f"{e} ({what.get(e, 'not tried')})" for e in self.endpoints)
        raise EtcdUnavailable(
            f"no etcd endpoint answered {path} within {self.timeout:g}s: {report}"
        )

    def _answered(self, index: int) -> None:
        with self._lock:
            self._first = index

    # -- keys -----------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        """``key``'s current KeyValue, None when absent (a linearizable read)."""
        answer = self._call("/v3/kv/range", Op.get(key)._range())
        kvs = answer.get("kvs") or []
        return KeyValue.from_json(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        """Every key starting with ``prefix``, in key order (a linearizable read)."""
        answer = self._call("/v3/kv/range", Op.get(prefix, prefix=True)._range())
        return [KeyValue.from_json(kv) for kv in answer.get("kvs") or []]

    def put(self, key: str, value: bytes | str, lease: int = 0) -> int:
        """Sets ``key`` to ``value`` (attached to ``lease``; 0: none); returns the
        store's revision after the put."""
        request = Op.put(key, value, lease).to_json()["request_put"]
        return _int(self._call("/v3/kv/put", request).get("header", {}), "revision")

    def delete(self, key: str) -> int:
        """Deletes ``key``; returns how many keys were deleted (0 or 1)."""
        return _int(self._call("/v3/kv/deleterange", Op.delete(key)._range()), "deleted")

    def delete_prefix(self, prefix: str) -> int:
        """Deletes every key starting with ``prefix``; returns how many."""
        request = Op.delete(prefix, prefix=True)._range()
        return _int(self._call("/v3/kv/deleterange", request), "deleted")

    def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        """Runs ``success`` if every condition of ``compare`` holds, else
        ``failure``, atomically. etcd refuses (EtcdError) a branch that
        changes one key twice."""
        for name, items, cls in (("compare", compare, Compare), ("success", success, Op),
                                 ("failure", failure, Op)):  # fmt: skip
            bad = [x for x in items if not isinstance(x, cls)]
            if bad:
                raise ValueError(f"txn {name} must hold {cls.__name__} items only, got {bad[0]!r}")
        request = {
            "compare": [c.to_json() for c in compare],
            "success": [op.to_json() for op in success],
            "failure": [op.to_json() for op in failure],
        }
        answer = self._call("/v3/kv/txn", request)
        succeeded = bool(answer.get("succeeded", False))
        ops = success if succeeded else failure
        raw = answer.get("responses") or []
        if len(raw) != len(ops):
            raise EtcdError(
                f"etcd answered a transaction of {len(ops)} ops with {len(raw)} responses"
            )
        responses: list[list[KeyValue] | int | None] = []
        for op, response in zip(ops, raw, strict=True):
            if op.kind == "get":
                kvs = response.get("response_range", {}).get("kvs") or []
                responses.append([KeyValue.from_json(kv) for kv in kvs])
            elif op.kind == "delete":
                responses.append(_int(response.get("response_delete_range", {}), "deleted"))
            else:
                responses.append(None)
        revision = _int(answer.get("header", {}), "revision")
        return TxnResult(succeeded, revision, responses)

    # -- leases ---------------------------------------------------------------

    def lease_grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` whole seconds (>= 1); returns its id. etcd may
        raise a very short TTL to its minimum."""
        if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1:
            raise ValueError(f"ttl must be an int of seconds >= 1, got {ttl!r}")
        answer = self._call("/v3/lease/grant", {"TTL": str(ttl)})
        if answer.get("error"):  # LeaseGrantResponse carries an error string of its own
            raise EtcdError(f"etcd refused a lease of {ttl}s: {answer['error']}")
        return _int(answer, "ID")

    def lease_keepalive(self, lease: int) -> int:
        """Renews ``lease`` once; returns its TTL left, 0 when it is gone (expired
        or revoked: the keys attached to it are gone too)."""
        answer = self._call("/v3/lease/keepalive", {"ID": str(_lease_id(lease))})
        return _int(answer.get("result", {}), "TTL")

    def lease_revoke(self, lease: int) -> None:
        """Revokes ``lease`` and deletes the keys attached to it; a lease already
        gone is not an error."""
        try:
            self._call("/v3/lease/revoke", {"ID": str(_lease_id(lease))})
        except EtcdUnavailable:
            raise
        except EtcdError as e:
            if e.code != _NOT_FOUND and "not found" not in str(e):
                raise

    def lease_ttl(self, lease: int) -> int:
        """``lease``'s TTL left in seconds, -1 when it is gone."""
        return _int(self._call("/v3/lease/timetolive", {"ID": str(_lease_id(lease))}), "TTL")

    # -- the rest -------------------------------------------------------------

    def check(self) -> None:
        """One cheap linearizable read: returns when the cluster serves, raises
        :class:`EtcdUnavailable` (naming every endpoint) when it does not."""
        self._call("/v3/kv/range", {"key": _b64(b"\0"), "count_only": True})

    def close(self) -> None:
        """Ends the client: a later call raises EtcdError. Holds no connection
        between calls, so nothing else is released."""
        self._closed = True

    def __enter__(self) -> Etcd:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
