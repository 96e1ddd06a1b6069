"""The public import paths of the usage guide, the job layer's backend factory, and the
package's layering (which module may import which; no import cycle)."""

from __future__ import annotations

import ast
import functools
import importlib
from collections.abc import Collection
from pathlib import Path

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
    with pytest.raises(
        ValueError, match=r"backend must be one of \['local', 'nodes', 'ray'\], got 'k8s'"
    ):
        create_backend("k8s", tmp_path)


# --- layering ---------------------------------------------------------------------
#
# The import graph of the package, read from the source (nothing is imported): which
# module may import which. Every ``import`` statement counts, at module level, under
# ``if TYPE_CHECKING:`` and inside functions alike: a lazy import inside a function
# is still a dependency, and a cycle closed by one is still a cycle (two modules that
# cannot be understood, tested or moved one without the other). A module that needs
# a lazy import only to dodge a cycle has a helper in the wrong place.
# A package is its ``__init__`` (named like the package) and its modules; importing a
# submodule from outside the package runs that ``__init__`` first, and the cycle
# check counts it so.

#: top-level drivers that sit above every layer (tools run jobs through the launcher)
DRIVERS = ("inprocess.tools.",)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path, package: str = "inprocess") -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (relative imports resolved;
    ``from pkg import sub`` counts ``pkg.sub`` where ``sub`` is a module)."""
    files = {module_name(root, p): p for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here.split(".")
                if node.level:
                    base = base[: len(base) - (node.level - 1)]
                    found_base = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    found_base = node.module or ""
                found = [
                    f"{found_base}.{a.name}" if f"{found_base}.{a.name}" in files else found_base
                    for a in node.names
                ]
            else:
                continue
            for target in found:
                while target and target not in files:  # a name inside a module
                    target = target.rpartition(".")[0]
                if target and target != name and target.split(".")[0] == package:
                    targets.add(target)
        graph[name] = targets
    return graph


def entered_packages(importer: str, target: str, modules: Collection[str]) -> list[str]:
    """The packages whose ``__init__`` an import of ``target`` by ``importer`` runs
    first: ``target``'s enclosing packages, but those that enclose ``importer`` (they
    ran before it) and ``importer`` itself (a package's ``__init__`` importing its own
    submodule)."""
    parts = target.split(".")
    return [
        parent
        for parent in (".".join(parts[:i]) for i in range(1, len(parts)))
        if parent in modules and parent != importer and not importer.startswith(parent + ".")
    ]


def runtime_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` with what Python runs on each import: importing a submodule from
    outside its package runs the package's ``__init__`` first (a cycle through it
    is a cycle, though no module names the package)."""
    return {
        module: targets.union(*(entered_packages(module, t, graph) for t in targets))
        for module, targets in graph.items()
    }


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(cycles)


def layering_violations(root: Path, package: str = "inprocess") -> list[str]:
    """What breaks the package's layering, one line each (empty: none)."""
    graph = import_graph(root, package)
    failover = f"{package}.failover"
    drivers = tuple(d.replace("inprocess", package, 1) for d in DRIVERS)
    allowed_by = {  # module -> the only modules of the package it may import
        f"{package}.failover.policy": {f"{package}.failover.spec", f"{package}.failover.state"},
        f"{package}.protocol": {f"{package}.security"},
    }
    problems = []
    for module, targets in sorted(graph.items()):
        inside = module == failover or module.startswith(failover + ".")
        if not inside and not module.startswith(drivers):
            for target in sorted(targets):
                if target == failover or target.startswith(failover + "."):
                    problems.append(f"{module} imports {target} (the launcher's layer)")
        if module in allowed_by:
            for target in sorted(targets - allowed_by[module]):
                allowed = sorted(allowed_by[module])
                problems.append(f"{module} imports {target} (allowed: {allowed})")
    for cycle in import_cycles(runtime_graph(graph)):
        problems.append(f"import cycle: {' <-> '.join(cycle)}")
    return problems


def test_layering_holds():
    root = Path(inprocess.__file__).resolve().parent.parent
    assert layering_violations(root) == []


def _plant(root: Path, path: str, text: str = "") -> None:
    """Writes module ``inprocess/<path>`` under ``root``: a layout planted for the check."""
    file = root / "inprocess" / path
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(text)


def test_layering_check_reports_a_planted_violation(tmp_path):
    module = functools.partial(_plant, tmp_path)

    module("__init__.py")
    module("security.py")
    module("protocol.py", "from .security import reject\nfrom . import store\n")
    module("store.py", "def f():\n    from .relay import RelayClient\n")  # lazy: still counts
    module("relay.py", "from .store import WakeWait\n")
    module("node.py", "from .failover.processes import process_start_time\n")
    module("failover/__init__.py")
    module("failover/processes.py", "import os\nfrom ..security import reject\n")
    module("failover/spec.py")
    module("failover/state.py")
    policy = "from .spec import JobSpec\nfrom .state import Stage\nimport inprocess.node\n"
    module("failover/policy.py", policy)
    module("tools/__init__.py")
    module("tools/local_job.py", "from ..failover import processes\n")  # a driver: allowed
    assert layering_violations(tmp_path) == [
        "inprocess.failover.policy imports inprocess.node "
        "(allowed: ['inprocess.failover.spec', 'inprocess.failover.state'])",
        "inprocess.node imports inprocess.failover.processes (the launcher's layer)",
        "inprocess.protocol imports inprocess.store (allowed: ['inprocess.security'])",
        "import cycle: inprocess.relay <-> inprocess.store",
    ]


def test_layering_check_reads_a_package_as_its_modules(tmp_path):
    """A package (``store/__init__.py`` and its submodules): relative imports resolve
    from inside it, a submodule imported from outside brings its package's
    ``__init__`` along, and a package importing its own submodules is no cycle."""

    module = functools.partial(_plant, tmp_path)

    module("__init__.py")
    module("security.py")
    module("protocol.py", "from .security import reject\n")
    module("waiting.py", "from . import protocol as P\n")
    module("store/__init__.py", "from .helpers import key_path\nfrom .stores import TCPStore\n")
    module("store/helpers.py", "from ..security import seal\n")
    module("store/stores.py", "from . import helpers\nfrom .rendezvous import RendezvousMixin\n")
    module("store/rendezvous.py", "from .. import protocol as P\nfrom ..waiting import WakeWait\n")
    assert layering_violations(tmp_path) == []
    graph = import_graph(tmp_path)
    assert graph["inprocess.store"] == {"inprocess.store.helpers", "inprocess.store.stores"}
    assert graph["inprocess.store.stores"] == {
        "inprocess.store.helpers",
        "inprocess.store.rendezvous",
    }
    assert graph["inprocess.store.rendezvous"] == {"inprocess.protocol", "inprocess.waiting"}

    # the relay reaches the package through a submodule only; the package's
    # rendezvous imports the relay lazily: still a cycle, through the __init__
    module("relay.py", "from .store.helpers import key_path\n")
    module("store/rendezvous.py", "def f():\n    from ..relay import RelayClient\n")
    graph = import_graph(tmp_path)
    assert graph["inprocess.relay"] == {"inprocess.store.helpers"}
    assert runtime_graph(graph)["inprocess.relay"] == {
        "inprocess.store",
        "inprocess.store.helpers",
    }
    assert runtime_graph(graph)["inprocess.store.stores"] == graph["inprocess.store.stores"]
    assert layering_violations(tmp_path) == [
        "import cycle: inprocess.relay <-> inprocess.store <-> inprocess.store.rendezvous "
        "<-> inprocess.store.stores",
    ]

    # a submodule that imports its package's names (not a sibling module) closes a cycle
    module("relay.py")
    module("store/rendezvous.py")
    module("store/helpers.py", "from . import TCPStore\n")
    assert layering_violations(tmp_path) == [
        "import cycle: inprocess.store <-> inprocess.store.helpers <-> inprocess.store.stores",
    ]
