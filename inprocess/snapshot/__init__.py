"""Training state that survives a fault: in-memory snapshots, healing from a peer, disk.

The machinery behind :meth:`inprocess.CallWrapper.restore` and
:meth:`inprocess.CallWrapper.commit`, one concept a module:

* :mod:`.layout`: what a snapshot holds (a state split into skeleton and tensors);
* :mod:`.buffers`: host buffers, reused and double-buffered;
* :mod:`.policy`: pure decisions (which step, which source for each rank);
* :mod:`.transfer`: moving snapshots between ranks over the job's process group;
* :mod:`.persist`: snapshots on disk with ``torch.distributed.checkpoint``;
* :mod:`.rng`: the random number generators as an opt-in state entry;
* :mod:`.manager`: one call's snapshots on one rank.
"""

from .manager import SnapshotMismatch, Snapshots, SnapshotWorldSizeError
from .persist import SnapshotCorrupt, SnapshotTrustError
from .rng import RNGState

__all__ = [
    "RNGState",
    "SnapshotCorrupt",
    "SnapshotMismatch",
    "SnapshotTrustError",
    "SnapshotWorldSizeError",
    "Snapshots",
]
