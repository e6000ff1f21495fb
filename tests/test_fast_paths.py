"""The speed paths stay out of the scheduling interface, and one switch selects the reference path.

``envs/serving/scheduling.py`` is what every policy and every other scheduler (a vLLM plugin's view)
speaks; following a chunk stretch (:mod:`envs.serving.stretches`) and planning every budget in one
pass (:mod:`envs.serving.budgets`) are the simulator's business beside it.  Which of them a run
takes is :class:`~envs.serving.shortcuts.Shortcuts` on its core, and nothing else.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

from envs.serving import scheduling
from envs.serving.loop import ServingLoop
from envs.serving.shortcuts import NO_SHORTCUTS, PROBE_SHORTCUTS, Shortcuts
from tests.test_import_direction import ROOT, import_graph

FAST_PATH_MODULES = {"envs.serving.stretches", "envs.serving.budgets", "envs.serving.shortcuts"}
FAST_PATH_NAMES = {
    "ChunkFollower",
    "FollowsChunks",
    "Steady",
    "SteadyFollower",
    "BudgetChunk",
    "STRETCH_RULES",
    "stretch_head",
    "BudgetPlans",
    "BudgetPrefixes",
    "EachBudget",
    "budget_plans",
    "one_pass_planning",
    "follow",
    "contextvars",
    "ContextVar",
}
IMPLEMENTATION = {"envs.serving.core", "envs.serving.loop", "envs.serving.simulator", "engine.serve"}


def fast_path_names(source: str) -> set[str]:
    """The fast-path names ``source`` defines (at any depth: a method counts), imports or reads."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.update({node.module or "", *(a.name for a in node.names)})
        elif isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Assign):
            found.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return found & FAST_PATH_NAMES


def test_the_interface_defines_and_imports_no_fast_path():
    source = Path(scheduling.__file__).read_text()
    assert fast_path_names(source) == set()
    assert not import_graph()["envs.serving.scheduling"] & FAST_PATH_MODULES
    assert not hasattr(scheduling.Policy, "follow")


def test_the_check_finds_planted_fast_paths():
    planted = (
        "from contextvars import ContextVar\n"
        "from envs.serving.stretches import ChunkFollower\n"
        "class Policy:\n"
        "    def follow(self, view, plan): ...\n"
        "class SteadyFollower: ...\n"
        "STRETCH_RULES = ()\n"
    )
    assert fast_path_names(planted) == {
        "contextvars",
        "ContextVar",
        "ChunkFollower",
        "follow",
        "SteadyFollower",
        "STRETCH_RULES",
    }


def test_policies_may_import_the_fast_paths():
    """They import no implementation, so a policy offers a follower or plans budgets in one pass
    without reaching into the simulator."""
    graph = import_graph()
    for module in FAST_PATH_MODULES:
        assert not graph[module] & IMPLEMENTATION, (module, graph[module] & IMPLEMENTATION)


def test_a_run_has_one_switch():
    """The loop takes no other: its runs read the core's shortcuts; the reference path has every
    field off, the planning mode's context variable is set only where the loop enters it, and no
    probe picks its iteration log itself."""
    for method in (ServingLoop.run_until, ServingLoop.run):
        assert set(inspect.signature(method).parameters) <= {"self", "policy", "stop", "until_s"}, method
    assert not any(dataclasses.asdict(NO_SHORTCUTS).values())
    probe_only = {"deferred_ewma": True, "unlogged": True}
    assert dataclasses.asdict(PROBE_SHORTCUTS) == dataclasses.asdict(Shortcuts()) | probe_only
    entered = {
        str(path.relative_to(ROOT))
        for folder in ("envs", "baselines", "policies", "advisor", "engine", "leaderboard")
        for path in (ROOT / folder).rglob("*.py")
        if "one_pass_planning" in path.read_text()
    }
    assert entered == {"envs/serving/budgets.py", "envs/serving/loop.py"}, entered
    modes = {p.name for p in (ROOT / "envs" / "serving").rglob("*.py") if "ContextVar" in p.read_text()}
    assert modes == {"budgets.py"}, modes
    unlogged = {
        str(path.relative_to(ROOT))
        for folder in ("envs", "policies", "advisor", "leaderboard")
        for path in (ROOT / folder).rglob("*.py")
        if "UnrecordedLog(" in path.read_text()
    }
    # The loop keeps one for a run whose shortcuts say so; the oracle's forked rollouts keep none
    # from the middle of a run, where no shortcut may change.
    assert unlogged == {"envs/serving/loop.py", "policies/oracle.py"}, unlogged
