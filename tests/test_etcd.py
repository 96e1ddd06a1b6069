"""The standard-library etcd client (inprocess/failover/etcd.py) against a real
3-member etcd cluster (tests/etcd_cluster.py): keys, transactions, leases, and
members lost, stopped and restarted."""

from __future__ import annotations

import threading
import time

import pytest
from launcher import free_port

from inprocess.failover.etcd import (
    Compare,
    Etcd,
    EtcdError,
    EtcdUnavailable,
    KeyValue,
    Op,
    TxnResult,
    parse_endpoints,
)

# -- endpoints ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("h1:2379", ["http://h1:2379"]),
        ("h1", ["http://h1:2379"]),
        ("h1:1,h2:2", ["http://h1:1", "http://h2:2"]),
        (" h1:1 , h2 ", ["http://h1:1", "http://h2:2379"]),
        ("http://h1:1,https://h2", ["http://h1:1", "https://h2:2379"]),
        ("http://h1:1/", ["http://h1:1"]),
        ("127.0.0.1:23790", ["http://127.0.0.1:23790"]),
        ("[::1]:2379", ["http://[::1]:2379"]),
        ("h1:1,h1:1", ["http://h1:1"]),
    ],
)
def test_parse_endpoints(text, expected):
    assert parse_endpoints(text) == expected


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "no etcd endpoint"),
        ("  ", "no etcd endpoint"),
        ("h1:1,,h2:2", "empty"),
        ("h1:", "empty port"),
        ("h1:0", "outside"),
        ("h1:65536", "65536"),
        ("h1:abc", "h1:abc"),
        ("h1:1/v3", "path"),
        ("h1:1?x=1", "query"),
        ("ftp://h1:1", "scheme"),
        ("http://", "no host"),
        ("user:pw@h1:1", "credentials"),
        ("h 1:1", "whitespace"),
    ],
)
def test_parse_endpoints_refuses(text, why):
    with pytest.raises(ValueError, match="--rdzv-endpoint") as info:
        parse_endpoints(text)
    message = str(info.value)
    assert why in message
    assert "HOST[:PORT]" in message


def test_bad_arguments():
    with pytest.raises(ValueError, match="--etcd"):
        parse_endpoints("h:x", what="--etcd")
    with pytest.raises(ValueError, match="endpoints"):
        Etcd([])
    with pytest.raises(ValueError, match="endpoints"):
        Etcd(["h1:1", 2])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="timeout"):
        Etcd("h1:1", timeout=0)
    client = Etcd(["h1:1", "http://h2:2,h1:1"])
    assert client.endpoints == ["http://h1:1", "http://h2:2"]
    with pytest.raises(ValueError, match="ttl"):
        client.lease_grant(0)
    with pytest.raises(ValueError, match="lease"):
        client.put("k", b"v", lease=-1)
    with pytest.raises(ValueError, match="target"):
        Compare("k", "size", "=", 1)
    with pytest.raises(ValueError, match="result"):
        Compare.mod_revision("k", "==", 1)
    with pytest.raises(ValueError, match="int operand"):
        Compare.version("k", "=", b"1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Op"):
        client.txn([], [Compare.version("k", "=", 0)])  # type: ignore[list-item]


def test_nothing_listening_fails_quickly():
    ports = [free_port(), free_port()]
    client = Etcd(",".join(f"127.0.0.1:{p}" for p in ports), timeout=1.0)
    began = time.monotonic()
    with pytest.raises(EtcdUnavailable) as info:
        client.check()
    assert time.monotonic() - began < 10
    message = str(info.value)
    assert "\n" not in message
    for port in ports:
        assert f"http://127.0.0.1:{port} (refused)" in message


# -- one cluster for the module -----------------------------------------------


@pytest.fixture
def etcd(shared_etcd_cluster, request):
    """A client of the shared cluster; every key under a prefix of the test's own."""
    client = Etcd(shared_etcd_cluster.endpoints, timeout=5.0)
    yield client
    client.delete_prefix(f"/{request.node.name}/")
    client.close()


def test_keys(etcd, request):
    p = f"/{request.node.name}/"
    assert etcd.get(p + "absent") is None
    r1 = etcd.put(p + "a", b"\x00\xff binary")
    r2 = etcd.put(p + "b", "text")
    r3 = etcd.put(p + "a/x", b"")
    assert r1 < r2 < r3
    a = etcd.get(p + "a")
    assert isinstance(a, KeyValue)
    assert (a.key, a.value, a.create_revision, a.mod_revision, a.version, a.lease) == (
        p + "a", b"\x00\xff binary", r1, r1, 1, 0,
    )  # fmt: skip
    assert "binary" not in repr(a)  # values are never shown
    assert etcd.get(p + "a/x").value == b""  # the gateway leaves an empty value out
    r4 = etcd.put(p + "a", b"two")
    a = etcd.get(p + "a")
    assert (a.value, a.create_revision, a.mod_revision, a.version) == (b"two", r1, r4, 2)
    assert [kv.key for kv in etcd.get_prefix(p)] == [p + "a", p + "a/x", p + "b"]
    assert [kv.key for kv in etcd.get_prefix(p + "a")] == [p + "a", p + "a/x"]
    assert etcd.get_prefix(p + "none/") == []
    assert etcd.delete(p + "b") == 1
    assert etcd.delete(p + "b") == 0
    assert etcd.delete_prefix(p + "a") == 2
    assert etcd.get_prefix(p) == []
    etcd.check()


def test_txn(etcd, request):
    k = f"/{request.node.name}/leader"

    def claim(value: bytes) -> TxnResult:
        return etcd.txn(
            [Compare.create_revision(k, "=", 0)],  # the key is absent
            [Op.put(k, value)],
            [Op.get(k)],
        )

    first = claim(b"me")
    assert first.succeeded and first.responses == [None]
    second = claim(b"other")
    assert not second.succeeded  # the gateway leaves "succeeded": false out
    [[held]] = second.responses
    assert held.value == b"me" and held.mod_revision == first.revision
    assert second.revision == first.revision

    # compare-and-swap on the revision read
    swapped = etcd.txn([Compare.mod_revision(k, "=", held.mod_revision)], [Op.put(k, b"next")])
    assert swapped.succeeded
    stale = etcd.txn(
        [Compare.mod_revision(k, "=", held.mod_revision)], [Op.put(k, b"late")], [Op.get(k)]
    )
    assert not stale.succeeded and stale.responses[0][0].value == b"next"
    assert etcd.txn([Compare.value(k, "=", "next"), Compare.version(k, ">", 1)], []).succeeded
    assert not etcd.txn([Compare.value(k, "!=", b"next")], []).succeeded
    assert etcd.txn([Compare.lease(k, "=", 0)], [Op.delete(k), Op.get(k + "/none")]).responses == [
        1, [],
    ]  # fmt: skip
    assert etcd.get(k) is None
    empty = etcd.txn([], [], [])
    assert empty.succeeded and empty.responses == []
    with pytest.raises(EtcdError, match="duplicate key") as info:
        etcd.txn([], [Op.put(k, b"1"), Op.delete(k)])
    assert not isinstance(info.value, EtcdUnavailable)


def test_leases(etcd, request):
    p = f"/{request.node.name}/"
    lease = etcd.lease_grant(30)
    assert lease > 0
    assert 0 < etcd.lease_ttl(lease) <= 30
    etcd.put(p + "held", b"x", lease=lease)
    assert etcd.get(p + "held").lease == lease
    assert 0 < etcd.lease_keepalive(lease) <= 30
    etcd.lease_revoke(lease)
    assert etcd.get(p + "held") is None
    assert etcd.lease_ttl(lease) == -1
    assert etcd.lease_keepalive(lease) == 0
    etcd.lease_revoke(lease)  # gone already: not an error
    with pytest.raises(EtcdError, match="lease not found") as info:
        etcd.put(p + "orphan", b"x", lease=lease)
    assert not isinstance(info.value, EtcdUnavailable)

    # a short lease kept alive keeps its key; the one left alone expires with its key
    kept, left = etcd.lease_grant(3), etcd.lease_grant(1)
    etcd.put(p + "kept", b"k", lease=kept)
    etcd.put(p + "left", b"l", lease=left)
    deadline = time.monotonic() + 30
    while etcd.get(p + "left") is not None:
        assert etcd.lease_keepalive(kept) > 0
        assert time.monotonic() < deadline, "a 1 s lease never expired"
        time.sleep(0.3)
    assert etcd.lease_keepalive(left) == 0
    assert etcd.lease_ttl(left) == -1
    began = time.monotonic()
    while time.monotonic() - began < 4:  # longer than the kept lease's TTL
        assert etcd.lease_keepalive(kept) > 0
        time.sleep(0.3)
    assert etcd.get(p + "kept").value == b"k"
    etcd.lease_revoke(kept)


def test_threads_share_a_client(etcd, request):
    p = f"/{request.node.name}/"
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(10):
                etcd.put(f"{p}{n}/{i}", str(i))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert len(etcd.get_prefix(p)) == 40


# -- members lost -------------------------------------------------------------


def _every_operation(client: Etcd, tag: str) -> None:
    k = f"/faults/{tag}"
    client.check()
    revision = client.put(k, tag)
    assert client.get(k).mod_revision == revision
    assert [kv.key for kv in client.get_prefix(k)] == [k]
    result = client.txn([Compare.mod_revision(k, "=", revision)], [Op.put(k, b"2")], [Op.get(k)])
    assert result.succeeded
    lease = client.lease_grant(30)
    assert client.lease_keepalive(lease) > 0
    assert client.lease_ttl(lease) > 0
    client.lease_revoke(lease)
    assert client.delete(k) == 1


def test_members_lost_and_back(etcd_cluster):
    c = etcd_cluster
    # every endpoint, the one killed first: the client skips it
    client = Etcd(c.endpoints, timeout=5.0)
    c.kill(0)
    _every_operation(client, "one-killed")
    _every_operation(Etcd(c.endpoint_arg(), timeout=5.0), "fresh-client")

    c.kill(1)  # no quorum left: no write, and no read (linearizable: never a stale one)
    lost = Etcd(c.endpoints, timeout=2.0)
    for call in (lambda: client.put("/faults/no-quorum", b"x"), lambda: lost.get("/faults/x")):
        began = time.monotonic()
        with pytest.raises(EtcdUnavailable) as info:
            call()
        assert time.monotonic() - began < 15
        message = str(info.value)
        for endpoint in c.endpoints:
            assert f"http://{endpoint}" in message
        assert "refused" in message

    c.restart(0)
    c.restart(1)
    _every_operation(client, "restarted")

    # a member that holds its port and answers nothing (stopped), listed first
    c.stop(2)
    try:
        stalled = Etcd([c.endpoints[2], *c.endpoints[:2]], timeout=5.0)
        _every_operation(stalled, "one-stopped")
    finally:
        c.cont(2)
