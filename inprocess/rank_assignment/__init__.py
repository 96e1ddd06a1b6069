"""Rank assignment: gives the surviving ranks a gap-free numbering after a fault.

After a restart iteration ends, some ranks of that iteration may be dead,
unhealthy or otherwise unable to continue (``terminated_ranks``, numbered as in
the iteration that just ended). A :class:`RankAssignment` runs on every rank and
computes, from the same inputs, the same new world size and a new rank for each
survivor, so that the next iteration again sees ranks ``0 .. world_size-1``.

Two kinds of assignment exist and are chained with :class:`inprocess.Compose`
(the last listed runs first):

* filters (:class:`FilterGroupedByKey`) add ranks to the terminated set and
  leave the numbering alone;
* final assignments (:class:`ShiftRanks`, :class:`FillGaps`) renumber the
  survivors and return an empty set: nothing is left to handle.

A rank that finds itself among the terminated ranks raises
:class:`RankDiscarded`; the Wrapper then removes it from the job.

Rank filters (:mod:`.filter`, public as :mod:`inprocess.rank_filter`) then
decide how many of the renumbered ranks are active.

The API's newer generation calls an assignment with one
:class:`RankAssignmentCtx` and expects one back (``ctx -> ctx``); its filters
(:class:`RankFilter`, :class:`ActivateAllRanks`, :class:`MaxActiveWorldSize`,
:class:`ActiveWorldSizeDivisibleBy`) are steps of the assignment, and its
default is ``Compose(ActivateAllRanks(), ShiftRanks())``. The built-in
assignments and filters serve both shapes; :class:`FilterGroupedByKey` is the
usage guide's, :class:`FilterCountGroupedByKey` the newer generation's.

Modules: :mod:`.base` (the base class), :mod:`.renumber` (final assignments),
:mod:`.grouped` (group filters), :mod:`.filter` (rank filters), :mod:`.tree`
(topology-aware :class:`Tree`).
"""

from .base import RankAssignment, RankAssignmentCtx, RankDiscarded
from .filter import (
    ActivateAllRanks,
    ActiveWorldSizeDivisibleBy,
    RankFilter,
    WorldSizeDivisibleBy,
)
from .filter import MaxActiveWorldSizeOrNone as MaxActiveWorldSize
from .grouped import FilterCountGroupedByKey, FilterGroupedByKey
from .renumber import FillGaps, ShiftRanks
from .tree import Layer, LayerFlag, Tree

__all__ = [
    "ActivateAllRanks",
    "ActiveWorldSizeDivisibleBy",
    "FillGaps",
    "FilterCountGroupedByKey",
    "FilterGroupedByKey",
    "Layer",
    "LayerFlag",
    "MaxActiveWorldSize",
    "RankAssignment",
    "RankAssignmentCtx",
    "RankDiscarded",
    "RankFilter",
    "ShiftRanks",
    "Tree",
    "WorldSizeDivisibleBy",
]
