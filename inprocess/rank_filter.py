"""Rank filters: how many ranks are active (the public home the usage guide names).

The code lives in :mod:`inprocess.rank_assignment.filter`.
"""

from .rank_assignment.filter import MaxActiveWorldSize, RankFilter, WorldSizeDivisibleBy

__all__ = ["MaxActiveWorldSize", "RankFilter", "WorldSizeDivisibleBy"]
