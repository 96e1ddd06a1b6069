"""Rank filters: how many ranks are active (the public home the usage guide names).

The code lives in :mod:`inprocess.rank_assignment.filter`.
"""

from .rank_assignment.filter import (
    ActivateAllRanks,
    ActiveWorldSizeDivisibleBy,
    MaxActiveWorldSize,
    RankFilter,
    WorldSizeDivisibleBy,
)

__all__ = [
    "ActivateAllRanks",
    "ActiveWorldSizeDivisibleBy",
    "MaxActiveWorldSize",
    "RankFilter",
    "WorldSizeDivisibleBy",
]
