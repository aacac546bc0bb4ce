"""The house as the README draws it, held: every import of tether's own modules (at the top of a
file or inside a function alike) goes down a floor or stays in its folder; no role imports
another; no module reaches itself through its imports; every generator the rollout drives has
the members of ``rollout.generators.Generator``.

The floors, from the ground up: the wire (``protocol``), what every role shares (``common``),
weight sync (``weight_sync``), the four roles, what is built from the roles (``evaluator``,
``stages``), starting and watching processes (``launch``), the demos. ``launch.cli`` is the
entry point over all of them: it only parses and calls.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from tests.helpers import REPO

FLOORS = {"protocol": 0, "common": 1, "weight_sync": 2, "buffer": 3, "rollout": 3, "scorer": 3, "learner": 3,
          "evaluator": 4, "stages": 4, "launch": 5, "demos": 6}
ROLES = ("buffer", "rollout", "scorer", "learner")
ENTRY = "launch.cli"


def module_imports(root: Path) -> dict[str, set[str]]:
    """{module: the modules of tether it imports}, for every module under the floors' folders."""
    modules = {}
    for folder in FLOORS:
        for path in sorted((root / folder).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path
    edges = {}
    for name, path in modules.items():
        edges[name] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from learner import parallel` imports the module learner.parallel
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            edges[name] |= {target for target in targets if target in modules and target != name}
    return edges


def folder(module: str) -> str:
    return module.split(".")[0]


def wrong_way_imports(edges: dict[str, set[str]]) -> list[str]:
    """Each import into another folder that is not a floor down, the roles' into each other among them."""
    found = []
    for module, targets in sorted(edges.items()):
        if module == ENTRY:
            continue
        for target in sorted(targets):
            mine, theirs = folder(module), folder(target)
            if mine == theirs:
                continue
            if mine in ROLES and theirs in ROLES:
                found.append(f"{module} -> {target}: a role imports another role")
            elif FLOORS[theirs] >= FLOORS[mine]:
                found.append(f"{module} -> {target}: {theirs} is not below {mine}")
    return found


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The modules that reach themselves through their imports, grouped (Tarjan's strongly
    connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(edges.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return cycles


def test_the_checks_find_what_they_look_for():
    """A role importing another, an upward import and a circle, each found in a made-up graph."""
    edges = {"rollout.adapters": {"learner.lora"}, "learner.lora": set(), "common.config": {"launch.runner"},
             "launch.runner": {"launch.pipeline"}, "launch.pipeline": {"launch.runner"},
             ENTRY: {"demos.parity"}, "demos.parity": set()}
    assert wrong_way_imports(edges) == ["common.config -> launch.runner: launch is not below common",
                                        "rollout.adapters -> learner.lora: a role imports another role"]
    assert import_cycles(edges) == [["launch.pipeline", "launch.runner"]]


def test_imports_go_down_the_floors_and_no_role_imports_another():
    edges = module_imports(Path(REPO))
    assert len(edges) > 80 and {"rollout.main", "learner.main", "demos.parity"} <= edges[ENTRY]
    assert wrong_way_imports(edges) == []


def test_no_module_imports_itself_through_others():
    assert import_cycles(module_imports(Path(REPO))) == []


@pytest.mark.parametrize("generator", ["rollout.responses:Responses", "rollout.episodes:Episodes"])
def test_every_generator_has_the_members_the_loop_drives(generator):
    """The rollout's loop drives any ``Generator``: each implementation has each of its members,
    methods with the same parameters (a checker of the Protocol, which ``isinstance`` is not)."""
    import importlib

    from rollout.generators import Generator

    module, name = generator.split(":")
    implementation = getattr(importlib.import_module(module), name)
    members = [member for member in vars(Generator) if not member.startswith("_")]
    assert set(members) == {"active", "start", "take_ready", "turn_finished", "advance", "finished", "record",
                            "close"}
    for member in members:
        wanted, theirs = getattr(Generator, member), getattr(implementation, member, None)
        assert theirs is not None, f"{name} has no {member}"
        if isinstance(wanted, property):
            assert isinstance(theirs, property), f"{name}.{member} is not a property"
        else:
            # the loop passes arguments by position: their number, kind and defaults must match
            assert shape(theirs) == shape(wanted), \
                f"{name}.{member}{inspect.signature(theirs)} is not Generator.{member}{inspect.signature(wanted)}"


def shape(method) -> list[tuple]:
    return [(p.kind, p.default) for p in inspect.signature(method).parameters.values()]
