"""A torchrun-style job without the Wrapper: a failure needs a cold restart.

One rank crashes once (in generation 0); the job then runs to the end.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--result-dir", type=Path, required=True)
parser.add_argument("--crash-rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=30)
args = parser.parse_args()
rank = int(os.environ["RANK"])
generation = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
args.result_dir.mkdir(parents=True, exist_ok=True)

dist.init_process_group("gloo")
for step in range(args.steps):
    if rank == args.crash_rank and generation == 0 and step == 5:
        os._exit(5)
    t = torch.ones(1)
    dist.all_reduce(t)
    time.sleep(0.02)
dist.destroy_process_group()
with open(args.result_dir / "events.jsonl", "a") as f:
    f.write(json.dumps({"kind": "finish", "rank": rank, "generation": generation}) + "\n")
