"""Moving snapshots between ranks over the job's own process group (never the store).

The group is the one the wrapped function created (a new one after every
restart): its default group when that runs on CPU tensors (gloo), else a gloo
group made for the purpose (one ``new_group`` per restore). Small metadata
goes through ``all_gather_object``; a snapshot moves as two point-to-point
messages (its pickled skeleton and its flat buffer), whose sizes the receiver
learned from the exchange before, so it receives straight into its slot.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from .buffers import HostSnapshot

_CPU_BACKENDS = ("gloo",)


def group() -> Any:
    """The process group to move host tensors over (``None``: not distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    backend = str(dist.get_backend())
    if backend in _CPU_BACKENDS or "cpu:gloo" in backend:
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


def all_gather(value: Any, pg: Any) -> list[Any]:
    import torch.distributed as dist

    if pg is None:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(out, value, group=pg)
    return out


def header(snapshot: HostSnapshot) -> tuple[int, int, bytes]:
    """``(step, nbytes, skeleton bytes)`` that a receiver needs before the data."""
    assert snapshot.step is not None
    return snapshot.step, snapshot.nbytes, pickle.dumps((snapshot.skeleton, snapshot.refs))


def exchange(
    sends: list[tuple[int, HostSnapshot]],
    receives: list[tuple[int, HostSnapshot]],
    pg: Any,
    tag: int = 0,
) -> int:
    """Sends each ``(peer, snapshot)`` of ``sends`` and receives into each slot of
    ``receives`` (already :meth:`HostSnapshot.assign`-ed); returns bytes received.

    All sends and receives are posted before any is waited for: two ranks that
    send to each other (a ring) never deadlock.
    """
    import torch.distributed as dist

    works = []
    received = 0
    # A state without tensors has no bytes: both sides know it from the header.
    for peer, snap in sends:
        snap.wait()
        if snap.nbytes:
            data = snap.data[: snap.nbytes]
            works.append(dist.isend(data, _global(peer, pg), group=pg, tag=tag))
    for peer, slot in receives:
        if slot.nbytes:
            region = slot.data[: slot.nbytes]
            works.append(dist.irecv(region, _global(peer, pg), group=pg, tag=tag))
            received += slot.nbytes
    for w in works:
        w.wait()
    return received


def _global(rank: int, pg: Any) -> int:
    import torch.distributed as dist

    if pg is None or pg is dist.group.WORLD:
        return rank
    return dist.get_global_rank(pg, rank)


def empty_u8(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def ring_exchange(
    snapshot: HostSnapshot, to: int, frm: int, into: HostSnapshot, pg: Any, tag: int = 100
) -> int:
    """Sends ``snapshot`` to rank ``to`` and receives rank ``frm``'s into ``into``
    (a ring: every rank does both at once); returns the bytes received.

    The receiver learns the size and layout from a header sent first; every
    send is posted before any receive is waited for.
    """
    import torch.distributed as dist

    snapshot.wait()
    head = pickle.dumps((snapshot.step, snapshot.shard, snapshot.skeleton, snapshot.refs))
    head_t = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    size_t = torch.tensor([len(head), snapshot.nbytes], dtype=torch.int64)
    dst, src = _global(to, pg), _global(frm, pg)
    sends = [
        dist.isend(size_t, dst, group=pg, tag=tag),
        dist.isend(head_t, dst, group=pg, tag=tag + 1),
    ]
    if snapshot.nbytes:
        sends.append(dist.isend(snapshot.data[: snapshot.nbytes], dst, group=pg, tag=tag + 2))
    peer_size = torch.empty(2, dtype=torch.int64)
    dist.irecv(peer_size, src, group=pg, tag=tag).wait()
    head_len, nbytes = (int(x) for x in peer_size.tolist())
    peer_head = torch.empty(head_len, dtype=torch.uint8)
    dist.irecv(peer_head, src, group=pg, tag=tag + 1).wait()
    step, shard, skeleton, refs = pickle.loads(peer_head.numpy().tobytes())
    region = into.assign(step, shard, skeleton, refs)
    if nbytes:
        dist.irecv(region, src, group=pg, tag=tag + 2).wait()
    into.seal()
    for w in sends:
        w.wait()
    return nbytes


def group_if_default() -> Any:
    """The default group when it can move host tensors, else ``None`` (no new group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    backend = str(dist.get_backend())
    if backend in _CPU_BACKENDS or "cpu:gloo" in backend:
        return dist.group.WORLD
    return None
