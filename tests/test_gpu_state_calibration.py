"""``benchmarks/gpu_state.py``'s batch calibration, on modelled step times: its
first GPU run asked for a 283 GiB batch (a line through two batches that both
took the GPU's fixed latency), which no GPU run may repeat."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_state.py"


@pytest.fixture(scope="module")
def calibrated_batch():
    spec = importlib.util.spec_from_file_location("gpu_state_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.calibrated_batch


def _within(measure, batch, target):
    return abs(measure(batch) / target - 1) < 0.03


@pytest.mark.parametrize("target", [0.026, 0.093])
def test_small_batches_at_the_fixed_latency_do_not_send_the_batch_off_the_scale(
    calibrated_batch, target
):
    # a GPU: every batch below 2000 takes the same 4 ms of launch latency
    seen = []

    def measure(b):
        seen.append(b)
        return max(0.004, b * 2e-6)

    batch = calibrated_batch(measure, target)
    assert _within(measure, batch, target)
    assert max(seen) <= 1 << 17 and len(seen) <= 15


def test_a_step_with_a_fixed_part_is_corrected_to_the_target(calibrated_batch):
    def measure(b):
        return 0.010 + b * 3e-6  # the optimizer step's fixed 10 ms plus the batch

    batch = calibrated_batch(measure, 0.093)
    assert _within(measure, batch, 0.093)


def test_a_start_already_too_slow_is_scaled_down(calibrated_batch):
    def measure(b):
        return b * 1e-4

    batch = calibrated_batch(measure, 0.026, start=512)
    assert _within(measure, batch, 0.026) and batch < 512


def test_the_batch_never_exceeds_its_cap(calibrated_batch):
    batch = calibrated_batch(lambda b: 0.001, 0.093, most=4096)
    assert batch == 4096
