"""``fresh_env_rendezvous`` when the restart exception lands in its own setup or cleanup.

The monitor thread raises the restart exception asynchronously, at any bytecode
of the iteration. An ``env://`` handler left installed by an iteration cut short
there must not be wrapped by the next iteration's: this rank's group keys would
then carry two prefixes, and every rank would wait in the group's rendezvous
for the address of another (seen end to end: a joiner interrupted right at the
start of its first iteration hung the next iterations of the whole job).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from inprocess.abort import rendezvous
from inprocess.store import AGENT_STORE_ENV, PrefixStore

pytestmark = pytest.mark.timeout(60)

RDZV = importlib.import_module("torch.distributed.rendezvous")


class Interrupt(Exception):
    """Stands for the restart exception, landing where the test makes it land."""


@pytest.fixture
def user_store(monkeypatch):
    """Torch's ``env://`` handler replaced by one that yields an in-memory store."""
    store = dist.HashStore()

    def env_handler(url, timeout=None, **kwargs):
        yield store, 0, 1

    monkeypatch.setitem(RDZV._rendezvous_handlers, "env", env_handler)
    monkeypatch.setenv(AGENT_STORE_ENV, "user's")
    return store, env_handler


def rendezvous_store():
    """What ``init_process_group("gloo")`` would rendezvous in (the ``env://`` handler's store)."""
    store, _, _ = next(RDZV._rendezvous_handlers["env"]("env://"))
    return store


def test_exception_in_the_setup_leaves_nothing_installed(user_store, monkeypatch):
    _, env_handler = user_store
    wrapper_store = PrefixStore("ns", dist.HashStore())
    torch_destroy = c10d.destroy_process_group

    def interrupted():
        raise Interrupt

    monkeypatch.setattr(rendezvous, "socket_inodes", interrupted)
    with pytest.raises(Interrupt):
        with rendezvous.fresh_env_rendezvous(wrapper_store, 3):
            pytest.fail("the block must not run")
    assert RDZV._rendezvous_handlers["env"] is env_handler
    assert os.environ[AGENT_STORE_ENV] == "user's"
    assert rendezvous._baseline is None
    assert c10d.destroy_process_group is torch_destroy


def test_an_iteration_whose_cleanup_never_ran_is_replaced_not_wrapped(user_store):
    store, env_handler = user_store
    wrapper_store = PrefixStore("ns", dist.HashStore())
    torch_destroy = c10d.destroy_process_group
    # iteration 6 is cut short where its cleanup does not run (here: never exited)
    left_behind = rendezvous.fresh_env_rendezvous(wrapper_store, 6)
    left_behind.__enter__()
    try:
        os.environ[AGENT_STORE_ENV] = "left behind"  # (as if set by iteration 6)
        for iteration in (7, 8):
            with rendezvous.fresh_env_rendezvous(wrapper_store, iteration):
                assert c10d.destroy_process_group.__wrapped__ is torch_destroy
                assert dist.destroy_process_group is c10d.destroy_process_group
                rendezvous_store().set("rank_0", b"address")
            # this iteration's key alone, under this iteration's prefix alone
            key = f"ns/i{iteration}/env/rank_0"
            assert store.check([key]), f"{key} not in the store"
            assert store.num_keys() == iteration - 6
            # what the iteration replaced is back: torch's own, the user's value
            assert RDZV._rendezvous_handlers["env"] is env_handler
            assert os.environ[AGENT_STORE_ENV] == "user's"
            assert c10d.destroy_process_group is torch_destroy
            assert dist.destroy_process_group is torch_destroy
    finally:
        left_behind.__exit__(None, None, None)
    # the late cleanup of iteration 6 puts back nothing of its own
    assert RDZV._rendezvous_handlers["env"] is env_handler
    assert c10d.destroy_process_group is torch_destroy
    assert os.environ[AGENT_STORE_ENV] == "user's"


def test_the_end_of_a_call_puts_back_what_an_interrupted_iteration_left(user_store):
    _, env_handler = user_store
    torch_destroy = c10d.destroy_process_group
    left_behind = rendezvous.fresh_env_rendezvous(PrefixStore("ns", dist.HashStore()), 6)
    left_behind.__enter__()  # (never exited: the interrupt landed in its cleanup)
    assert RDZV._rendezvous_handlers["env"] is not env_handler
    rendezvous.put_back_what_iterations_replaced()
    assert RDZV._rendezvous_handlers["env"] is env_handler
    assert c10d.destroy_process_group is torch_destroy
    assert dist.destroy_process_group is torch_destroy
    rendezvous.put_back_what_iterations_replaced()  # (nothing left: nothing done)
    assert RDZV._rendezvous_handlers["env"] is env_handler
    rendezvous._baseline = None
