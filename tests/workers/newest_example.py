"""A training script in the shape of the API's newest generation's examples.

``--shape basic``: the Wrapper decorates ``main()``, which builds the model,
the optimizer, its own ``TCPStore`` on ``MASTER_PORT + 1`` and the process
group in every call (the Wrapper's store on ``MASTER_PORT + 2``).
``--shape advanced``: model, optimizer and the application's ``TCPStore``
(``MASTER_PORT + 2``) are built once in ``main()`` and passed to the wrapped
``train()``, which takes a ``PrefixStore`` per restart iteration (the Wrapper's
store on ``MASTER_PORT + 1``); ``--nested-restarter`` adds the nested
restarter's callbacks as ``initialize``, ``abort`` (composed with
``AbortTorchDistributed``), ``completion`` and ``terminate``.

Both reload a ``torch.save`` checkpoint and raise at random
(``--fault-prob``); the rank that raised logs ``restart latency: <s>s`` when it
is back in the function. Run under ``torchrun``.
"""

import argparse
import datetime
import logging
import os
import pathlib
import random
import time

import torch

import inprocess

raise_timestamp = None


def parse_args():
    parser = argparse.ArgumentParser(description="newest-generation example shapes")
    parser.add_argument("--shape", choices=["basic", "advanced"], default="advanced")
    parser.add_argument("--size", default=32, type=int)
    parser.add_argument("--layers", default=2, type=int)
    parser.add_argument("--log-interval", default=50, type=int)
    parser.add_argument("--chkpt-interval", default=50, type=int)
    parser.add_argument("--total-iterations", default=300, type=int)
    parser.add_argument("--seed", default=None, type=int)
    parser.add_argument("--path", default="/tmp/", type=str)
    parser.add_argument("--fault-prob", default=0.005, type=float)
    parser.add_argument("--nested-restarter", action="store_true")
    return parser.parse_args()


def note_restart():
    global raise_timestamp
    if raise_timestamp is not None:
        logging.info(f"restart latency: {time.perf_counter() - raise_timestamp:.3f}s")
    raise_timestamp = None


def train_loop(model, opt, model_ddp, rank, world_size, args, call_wrapper):
    global raise_timestamp
    start = 0
    checkpoint_path = pathlib.Path(args.path) / "checkpoint.pt"
    if checkpoint_path.exists():
        checkpoint = torch.load(checkpoint_path)
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["opt"])
        torch.set_rng_state(checkpoint["rng"])
        start = checkpoint["iteration"]

    if args.seed is not None:
        random.seed(args.seed + start * world_size + rank + 7919 * call_wrapper.iteration)
    else:
        random.seed(time.perf_counter_ns())

    for iteration in range(start, args.total_iterations):
        if iteration % args.chkpt_interval == args.chkpt_interval - 1:
            torch.distributed.barrier()
            if rank == 0:
                checkpoint = {
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "rng": torch.get_rng_state(),
                    "iteration": iteration,
                }
                with call_wrapper.atomic():
                    torch.save(checkpoint, checkpoint_path)

        if random.random() < args.fault_prob:
            raise_timestamp = time.perf_counter()
            raise RuntimeError(f"example fault at {iteration=} from {rank=}")

        inp = torch.rand(args.size, args.size)
        model.zero_grad()
        loss = model_ddp(inp).square().mean()
        loss.backward()
        opt.step()
        if rank == 0 and iteration % args.log_interval == args.log_interval - 1:
            logging.info(f"{rank=} {iteration=} {loss.item()=}")


# --------------------------------------------------------------------- basic


@inprocess.Wrapper(
    store_kwargs={"port": int(os.getenv("MASTER_PORT", 29500)) + 2},
    health_check=inprocess.health_check.CudaHealthCheck(),
)
def basic_main(call_wrapper: inprocess.CallWrapper | None = None):
    note_restart()
    args = parse_args()
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if args.seed is not None:
        torch.manual_seed(args.seed)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(args.size, args.size) for _ in range(args.layers)]
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    store = torch.distributed.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]) + 1,
        world_size=world_size,
        is_master=rank == 0,
        multi_tenant=True,
        wait_for_workers=True,
        use_libuv=True,
    )
    torch.distributed.init_process_group(
        backend="gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=10),
    )
    model_ddp = torch.nn.parallel.DistributedDataParallel(model)
    train_loop(model, opt, model_ddp, rank, world_size, args, call_wrapper)


# ------------------------------------------------------------------ advanced


def train(base_store, model, opt, timeout, args, call_wrapper: inprocess.CallWrapper | None = None):
    note_restart()
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    store = torch.distributed.PrefixStore(str(call_wrapper.iteration), base_store)
    torch.distributed.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
    )
    model_ddp = torch.nn.parallel.DistributedDataParallel(model)
    train_loop(model, opt, model_ddp, rank, world_size, args, call_wrapper)


def advanced_main(args):
    if args.seed is not None:
        torch.manual_seed(args.seed)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(args.size, args.size) for _ in range(args.layers)]
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    store = torch.distributed.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]) + 2,
        world_size=int(os.environ["WORLD_SIZE"]),
        is_master=(int(os.environ["RANK"]) == 0),
        multi_tenant=True,
        wait_for_workers=True,
        use_libuv=True,
    )
    wrapper_kwargs = {
        "store_kwargs": {"port": int(os.getenv("MASTER_PORT", 29500)) + 1},
        "health_check": inprocess.health_check.CudaHealthCheck(),
    }
    if args.nested_restarter:
        wrapper_kwargs["initialize"] = inprocess.nested_restarter.NestedRestarterHandlingCompleted()
        wrapper_kwargs["abort"] = inprocess.Compose(
            inprocess.abort.AbortTorchDistributed(),
            inprocess.nested_restarter.NestedRestarterHandlingStarting(),
        )
        wrapper_kwargs["completion"] = inprocess.nested_restarter.NestedRestarterFinalized()
        wrapper_kwargs["terminate"] = inprocess.nested_restarter.NestedRestarterAborted()
    wrapped_train = inprocess.Wrapper(**wrapper_kwargs)(train)
    wrapped_train(store, model, opt, datetime.timedelta(seconds=10), args)


if __name__ == "__main__":
    args = parse_args()
    logging.basicConfig(
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.INFO
    )
    if args.shape == "basic":
        basic_main()
    else:
        advanced_main(args)
