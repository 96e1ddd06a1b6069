"""The public import paths of the usage guide, and the job layer's backend factory."""

from __future__ import annotations

import importlib

import pytest

import inprocess
from inprocess.failover.backends import DEFAULT_BACKEND, Backend, create_backend

pytestmark = pytest.mark.timeout(60)

PUBLIC = {
    "inprocess": ["Wrapper", "CallWrapper", "Compose"],
    "inprocess.abort": ["Abort", "AbortTorchDistributed"],
    "inprocess.health_check": [
        "HealthCheck",
        "CudaHealthCheck",
        "NVMLHealthCheck",
        "FaultCounter",
        "FaultCounterExceeded",
    ],
    "inprocess.rank_assignment": [
        "RankAssignment",
        "RankDiscarded",
        "ShiftRanks",
        "FillGaps",
        "FilterGroupedByKey",
    ],
    "inprocess.rank_filter": ["RankFilter", "MaxActiveWorldSize", "WorldSizeDivisibleBy"],
    "inprocess.initialize": ["Initialize", "RetryController"],
    "inprocess.finalize": ["Finalize"],
    "inprocess.store": ["StoreMixin", "TCPStore", "PrefixStore"],
    "inprocess.state": ["State", "Mode"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_import(module):
    imported = importlib.import_module(module)
    assert all(hasattr(imported, name) for name in PUBLIC[module]), module


def test_rank_filter_is_the_rank_assignment_filter():
    from inprocess.rank_assignment import filter as filters

    assert inprocess.rank_filter.RankFilter is filters.RankFilter


def test_create_backend_by_name(tmp_path):
    backend = create_backend(DEFAULT_BACKEND, tmp_path)
    try:
        for method in Backend.__dict__:
            if not method.startswith("_"):
                assert callable(getattr(backend, method)), method
        assert backend.exit_of(2**22 + 7).exit_code is None  # nothing recorded
    finally:
        backend.clear_exit_records()
        backend.close()
    with pytest.raises(ValueError, match=r"backend must be one of \['local', 'ray'\], got 'k8s'"):
        create_backend("k8s", tmp_path)
