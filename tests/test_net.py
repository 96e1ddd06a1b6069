"""free_port: blocks that concurrent jobs (MASTER_PORT + 1, + 2) never share."""

from __future__ import annotations

import socket

import pytest

from inprocess._net import BLOCK, _ephemeral_low, free_port


def test_free_ports_are_aligned_blocks_below_the_ephemeral_range():
    ports = {free_port() for _ in range(50)}
    assert all(p % BLOCK == 0 and p + BLOCK <= _ephemeral_low() for p in ports)
    wide = free_port(following=6)
    assert wide % 7 == 0
    for offset in range(7):  # every port of the block is free now
        with socket.socket() as s:
            s.bind(("127.0.0.1", wide + offset))


def test_free_port_rejects_a_bad_argument():
    with pytest.raises(ValueError, match="following"):
        free_port(-1)
