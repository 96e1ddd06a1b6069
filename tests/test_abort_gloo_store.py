"""Releasing blocked gloo collectives does not wait on a busy store client."""

from __future__ import annotations

import datetime
import logging
import threading
import time

import pytest
import torch.distributed as dist

from inprocess.abort import gloo


@pytest.mark.timeout(120)
def test_the_group_addresses_are_read_while_another_thread_holds_the_store(caplog):
    """A TCPStore client runs one operation at a time: an application thread blocked
    in a ``wait`` on the store its process group was made with held the abort's read
    of the group's addresses until its timeout, and no blocked collective was
    released. The read goes through a connection of its own then."""
    timeout = datetime.timedelta(seconds=60)
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timeout)
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timeout)
    dist.init_process_group("gloo", store=client, rank=0, world_size=1)
    started = threading.Event()

    def application_wait(store: dist.Store) -> None:
        started.set()
        try:
            store.wait(["never set"], datetime.timedelta(seconds=6))
        except dist.DistStoreError:  # its timeout
            pass

    waiter = threading.Thread(target=application_wait, args=(client,))
    group = None
    try:
        (group,) = gloo.gloo_groups()
        assert gloo._gloo_address_blobs(*group, timeout=2.0)  # idle: the group's store
        waiter.start()
        started.wait(30)
        time.sleep(0.3)  # (inside its wait now)
        assert waiter.is_alive()
        with caplog.at_level(logging.WARNING, logger=gloo.__name__):
            blobs = gloo._gloo_address_blobs(*group, timeout=2.0)
        assert blobs, caplog.text
        assert "timed out" not in caplog.text
        assert waiter.is_alive()  # read while the store was held
    finally:
        if waiter.ident is not None:
            waiter.join(30)
        dist.destroy_process_group()
        del group, client, server
