"""The source tree's imports point one way: down the layers of :data:`LAYERS`, no cycles, and the
scheduling interface imports no implementation.

Every import counts, at module level, under ``TYPE_CHECKING`` and inside functions, since a
cycle hidden in a function is still a cycle in the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("advisor", "baselines", "calibration", "chunkgym", "engine", "envs", "leaderboard", "policies")
SCRIPTS = ("bench",)
"""Folders of scripts (no package): walked as ``bench.<file>``."""
INTERFACE = "envs.serving.scheduling"

LAYERS = {
    # A module may import its own rank and lower ones only.
    "chunkgym": 0,  # config, io, cli, data, backends, parallel map: what every layer stands on
    "envs": 1,  # the simulator (envs.serving) and the env over it
    "baselines": 2,  # heuristics speaking envs.serving's scheduling interface
    "policies": 3,  # learned policies, their training and teachers (which run baselines)
    "calibration": 4,  # measurements in, cost-model coefficients out: needs the cost model, no policy
    "leaderboard": 5,  # policies run in the simulator, and their result rows, tables and plots
    "advisor": 5,  # an operator's traffic and SLO searched over an engine's knobs, in the simulator
    "engine": 6,  # real engines: profile themselves with calibration's fit, replay into leaderboard rows
    "train": 7,  # the scripts: nothing imports them
    "evaluate": 7,
    "advise": 7,
    "bench": 7,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    files = [p for pkg in PACKAGES + SCRIPTS for p in (ROOT / pkg).rglob("*.py")]
    files += [p for p in ROOT.glob("*.py") if p.name != "setup.py"]
    return {_module_name(p): p for p in files}


def _imports(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """Project modules ``path`` imports anywhere in its body; ``from pkg import sub`` counts as ``pkg.sub``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(path, name, known) for name, path in known.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path of module names, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_walk_sees_the_serving_modules_and_their_imports():
    graph = import_graph()
    assert {"envs.serving.core", "envs.serving.loop", INTERFACE, "engine.serve", "policies.oracle"} <= set(
        graph
    )
    assert INTERFACE in graph["envs.serving.core"]
    assert "envs.serving.core" in graph["envs.serving.loop"]


def test_no_import_cycle_in_the_source_tree():
    assert _cycle(import_graph()) is None, " -> ".join(_cycle(import_graph()) or [])


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_the_interface_imports_no_implementation():
    graph = import_graph()
    assert graph[INTERFACE] <= {"envs.serving.request", "envs.serving.metrics", "envs.serving.traffic"}, (
        graph[INTERFACE]
    )


POLICY_SIDE = ("envs.features", "envs.actions", "policies.exported", "baselines")
IMPLEMENTATION = {"envs.serving.core", "envs.serving.loop", "envs.serving.simulator", "engine.serve"}


def test_features_masks_and_policies_import_no_implementation():
    """They read the serving state only through ``ServingView`` (another scheduler can supply one)."""
    graph = import_graph()
    side = [m for m in graph if m.startswith(POLICY_SIDE)]
    assert len(side) >= 7, side
    for m in side:
        assert not graph[m] & IMPLEMENTATION, (m, graph[m] & IMPLEMENTATION)


def _core_calls(name: str) -> set[str]:
    """The core's iteration methods (begin, run_followed, end, advance_to_work) and fast-forwards that ``name`` uses."""
    found = set()
    for node in ast.walk(ast.parse(_modules()[name].read_text())):
        if isinstance(node, ast.Attribute):
            attr, receiver = node.attr, ast.unparse(node.value)
            if attr == "fast_forward" or (
                attr in ("begin", "run_followed", "end", "advance_to_work") and receiver.endswith("core")
            ):
                found.add(attr)
    return found


def test_one_run_loop_drives_the_core():
    """Only the loop calls the core's per-iteration protocol or a fast-forward; every driver uses the loop."""
    callers = {m for m in _modules() if _core_calls(m)}
    assert callers == {"envs.serving.loop"}, callers
    assert _core_calls("envs.serving.loop") == {
        "begin",
        "run_followed",
        "end",
        "advance_to_work",
        "fast_forward",
    }


def _rank(module: str) -> int:
    return LAYERS[module.split(".")[0]]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``importer -> imported`` for every import of a higher layer than the importer's."""
    return sorted(f"{m} -> {dep}" for m, deps in graph.items() for dep in deps if _rank(dep) > _rank(m))


def test_every_package_and_script_has_a_layer():
    assert {m.split(".")[0] for m in import_graph()} == set(LAYERS)


def test_imports_run_down_the_layers():
    """Engine imports calibration, never the reverse (:data:`LAYERS`): a live engine profiles itself
    with calibration's compositions and fit; calibration reads measurements, not engines."""
    upward = upward_imports(import_graph())
    assert not upward, "imports up the layers (importer -> imported):\n" + "\n".join(upward)


def test_the_layer_check_finds_planted_upward_imports(tmp_path):
    """One under ``TYPE_CHECKING`` and one inside a function; the downward one passes."""
    planted = tmp_path / "actions.py"
    planted.write_text(
        "from typing import TYPE_CHECKING\n"
        "from chunkgym.parallel import parallel_map\n"
        "if TYPE_CHECKING:\n"
        "    from leaderboard.runs import RunSpec\n"
        "def plan():\n"
        "    import baselines.adaptive\n"
    )
    graph = import_graph()
    graph["envs.actions"] = _imports(planted, "envs.actions", _modules())
    assert upward_imports(graph) == ["envs.actions -> baselines.adaptive", "envs.actions -> leaderboard.runs"]
