"""WrapperConfig: the Wrapper's settings checked once, durations in seconds (issue 10)."""

from __future__ import annotations

import dataclasses
import datetime
import inspect

import pytest

import inprocess
from inprocess.config import WrapperConfig

td = datetime.timedelta


def test_durations_are_the_wrappers_timedelta_arguments_in_seconds():
    params = inspect.signature(inprocess.Wrapper).parameters
    timed = [n for n, p in params.items() if "timedelta" in str(p.annotation)]
    assert list(WrapperConfig.durations()) == timed and len(timed) == 12
    w = inprocess.Wrapper(soft_timeout=td(seconds=30), last_call_wait=td(0))
    c = w.config
    assert c.soft_timeout == 30.0 and c.last_call_wait == 0.0
    assert c.heartbeat_interval == c.heartbeat_timeout / 4 == 7.5
    assert all(isinstance(getattr(c, n), float) for n in WrapperConfig.durations())
    # the Wrapper's attributes are what it was given
    assert w.soft_timeout == td(seconds=30) and w.heartbeat_interval == td(seconds=7.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.soft_timeout = 1.0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        _ = w.no_such_setting
