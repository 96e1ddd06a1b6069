"""Store arguments and absurd durations are refused when the Wrapper is built (issue 9)."""

from __future__ import annotations

import datetime

import pytest

import inprocess
from inprocess.store import FileStore

td = datetime.timedelta


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"store_kwargs": {"port": 70000}}, ValueError, ["store_kwargs", "'port'", "65535"]),
        ({"store_kwargs": {"port": -1}}, ValueError, ["store_kwargs", "'port'"]),
        ({"store_kwargs": {"port": "29500"}}, ValueError, ["store_kwargs", "'port'"]),
        ({"store_kwargs": {"prot": 29500}}, TypeError, ["store_kwargs", "'prot'", "port"]),
        (
            {"store_factory": FileStore, "store_kwargs": {"port": 1}},
            TypeError,
            ["store_kwargs", "'port'", "file_name"],
        ),
        ({"store_kwargs": {"timeout": td(days=10**6)}}, ValueError, ["store_kwargs", "30 days"]),
        ({"barrier_timeout": td(days=10**6)}, ValueError, ["barrier_timeout", "30 days"]),
        ({"completion_timeout": td(days=31)}, ValueError, ["completion_timeout", "30 days"]),
        ({"termination_grace_time": td(days=10**6)}, ValueError, ["termination_grace_time"]),
    ],
)
def test_bad_store_kwargs_and_durations(kwargs, error, words):
    with pytest.raises(error) as info:
        inprocess.Wrapper(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_good_store_kwargs_are_accepted():
    inprocess.Wrapper(store_kwargs={"host_name": "127.0.0.1", "port": 0, "timeout": td(days=30)})
    inprocess.Wrapper(store_factory=FileStore, store_kwargs={"file_name": "/tmp/x"})
