"""Job failover ("PrimeMaster"): a controller and a launcher for a job's processes.

* :mod:`.spec`: what the job is (``JobSpec``).
* :mod:`.state`: what the controller remembers, saved on every change.
* :mod:`.policy`: every failover decision, as pure functions.
* :mod:`.controller`: the loop that observes, decides and acts.
* :mod:`.supervisor` and :mod:`.cli`: ``inprocess-run``, which keeps the
  controller alive and recovers it after a crash.
* :mod:`.backends`: where workers run (``local``: this machine; ``ray``: the
  nodes of a Ray cluster, driven by :mod:`.ray_driver`).
"""

from .spec import JobSpec
from .state import JobState, Stage

__all__ = ["JobSpec", "JobState", "Stage"]
