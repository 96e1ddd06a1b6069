"""What a local job's start costs: ranks spawned (``python SCRIPT``) against ranks
forked from a :class:`~inprocess.tools.fork_template.ForkTemplate`, side by side.

Each round runs one job of ``--ranks`` processes that import torch and inprocess,
form a gloo group, all-reduce once and exit; the figure is the job's wall time
from start to the last rank's exit (and its leftovers' check). The
template's own start (one ``import torch``) is paid once and shown apart.

    .venv/bin/python benchmarks/job_start.py --ranks 4 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import textwrap
import time
from pathlib import Path

from inprocess.tools import local_job
from inprocess.tools.fork_template import ForkTemplate

RANK = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist

    import inprocess  # noqa: F401

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    dist.destroy_process_group()
    """
)


def one_job(script: Path, ranks: int, workdir: Path, template: ForkTemplate | None) -> float:
    start = time.monotonic()
    result = local_job.run_job(script, ranks, workdir, timeout=600, template=template)
    elapsed = time.monotonic() - start
    assert result.returncodes == [0] * ranks, result.describe()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "rank.py"
        script.write_text(RANK)
        began = time.monotonic()
        with ForkTemplate(local_job.base_env()) as template:
            template_start = time.monotonic() - began
            times: dict[str, list[float]] = {"spawned": [], "forked": []}
            for n in range(args.rounds):  # interleaved: both see the same machine
                for way, tpl in (("spawned", None), ("forked", template)):
                    times[way].append(one_job(script, args.ranks, Path(tmp) / f"{way}{n}", tpl))
    print(f"{args.ranks} ranks, {args.rounds} rounds; template start {template_start:.1f} s (once)")
    for way, values in times.items():
        print(
            f"{way:>8}: job median {statistics.median(values):6.2f} s"
            f"  (min {min(values):.2f}, max {max(values):.2f})"
        )
    ratio = statistics.median(times["forked"]) / statistics.median(times["spawned"])
    print(f"forked/spawned median ratio: {ratio:.2f}")


if __name__ == "__main__":
    main()
