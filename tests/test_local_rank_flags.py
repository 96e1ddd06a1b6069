"""Local ranks in ``--redirects``, ``--tee`` and ``--local-ranks-filter`` must be
ranks a node has, each at most once (else one clear line names the flag, the
value and the allowed ranks); and a worker's exit code 75 is called a GPU fault
only for a worker that had a GPU."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_failover_e2e import ENV, RUN
from test_launcher_inputs import STARTED, no_start, refused, run  # noqa: F401 (fixture)

from inprocess.failover.backends.local import gpu_visible
from inprocess.failover.policy import WorkerExited


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_start")
@pytest.mark.parametrize(
    ("flags", "names", "says"),
    [
        (["--redirects", "9:1"], "--redirects", "names local rank 9 in '9:1', but a node has "
         "1 worker: local ranks are 0..0"),
        (["--tee", "0:3,2:1", "--nproc-per-node", "2"], "--tee",
         "names local rank 2 in '0:3,2:1', but a node has 2 workers: local ranks are 0..1"),
        (["--redirects", "0:1,0:2"], "--redirects",
         "names local rank 0 more than once in '0:1,0:2': give each local rank at most once"),
        (["--local-ranks-filter", "99"], "--local-ranks-filter",
         "must name local ranks in 0..0 (a node has 1 worker), each at most once, got '99'"),
        (["--local-ranks-filter", "1,1", "--nproc-per-node", "2"], "--local-ranks-filter",
         "must name local ranks in 0..1 (a node has 2 workers), each at most once, got '1,1'"),
    ],
)  # fmt: skip
def test_local_ranks_a_node_lacks_or_named_twice_are_refused(
    flags, names, says, tmp_path
):
    err = refused(tmp_path, *flags, names=names)
    assert says in err, err


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_start")
def test_local_ranks_a_node_has_are_accepted(tmp_path):
    code, err = run(
        tmp_path, "--nproc-per-node", "2", "--redirects", "1:3", "--tee", "0:1",
        "--local-ranks-filter", "1,0",
    )  # fmt: skip
    assert code == STARTED, err


def test_exit_code_75_says_gpu_fault_only_for_a_worker_with_a_gpu():
    assert WorkerExited(0, 1, 75, gpu=True).describe() == "exited with code 75 (its GPU faulted)"
    assert WorkerExited(0, 1, 75, gpu=False).describe() == "exited with code 75"
    assert "GPU faulted)" not in WorkerExited(0, 1, 75).describe()  # (not known: no claim)
    assert WorkerExited(0, 1, 3, gpu=True).describe() == "exited with code 3"
    with pytest.raises(ValueError, match=r"WorkerExited\.gpu must be True, False or None"):
        WorkerExited(0, 1, 75, gpu="yes")  # type: ignore[arg-type]
    for hidden in ("", "-1", "-1,0"):
        assert not gpu_visible({"CUDA_VISIBLE_DEVICES": hidden})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_cpu_worker_exiting_75_is_not_reported_as_a_gpu_fault(tmp_path: Path):
    """Through ``inprocess-run``: a worker without a GPU (none visible to it) that exits
    with code 75 is reported with its exit code, not as a GPU fault."""
    script = tmp_path / "exit75.py"
    script.write_text("import sys\nsys.exit(75)\n")
    state_dir = tmp_path / "state"
    done = subprocess.run(
        [*RUN, "--max-restarts", "0", "--job-max-restarts", "0", "--standby", "0",
         "--state-dir", str(state_dir), str(script)],
        env={**ENV, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "exited with code 75" in output, output
    assert "GPU" not in output, output
    state = json.loads((state_dir / "state.json").read_text())
    assert "exited with code 75" in state["reason"] and "GPU" not in state["reason"], state
