"""The house as the README draws it, held: every import of tether's own modules (at the top of a
file or inside a function alike) goes down a floor or stays in its folder; no role imports
another; no module reaches itself through its imports; every generator the rollout drives has
the members of ``rollout.generators.Generator``. Nothing is out of the test's sight: every
top-level folder with Python in it is a floor or named in ``NOT_FLOORS``, and no module imports
one of tether's by name (``importlib.import_module``, ``__import__``, an edge ``module_imports``
cannot see) but ``common.functions``, which loads the user code a config names.

The floors, from the ground up: the wire (``protocol``), what every role shares (``common``),
weight sync (``weight_sync``), the four roles, what is built from the roles (``evaluator``,
``stages``), starting and watching processes (``launch``), the demos. ``launch.cli`` is the
entry point over all of them: it only parses and calls.
"""

from __future__ import annotations

import ast
import inspect
from fnmatch import fnmatch
from pathlib import Path

import pytest

from tests.helpers import REPO

FLOORS = {"protocol": 0, "common": 1, "environments": 2, "training": 2, "weight_sync": 3, "buffer": 4, "rollout": 4,
          "scorer": 4, "learner": 4, "evaluator": 5, "stages": 5, "launch": 6, "demos": 7}
ROLES = ("buffer", "rollout", "scorer", "learner")
ENTRY = "launch.cli"
# the top-level folders that are not floors of the house, and why: nothing on a floor imports them
NOT_FLOORS = {"tests": "the suite", "bench": "benchmarks, run by hand", "configs": "run configs (YAML)",
              "docs": "prose"}
LOADER = "common.functions"  # load_function: the one module that imports by name (user code a config names)


def module_files(root: Path) -> dict[str, Path]:
    """{module: its file}, for every module under the floors' folders."""
    modules = {}
    for folder in FLOORS:
        for path in sorted((root / folder).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path
    return modules


def module_imports(root: Path) -> dict[str, set[str]]:
    """{module: the modules of tether it imports}, for every module under the floors' folders."""
    modules = module_files(root)
    edges = {}
    for name, path in modules.items():
        edges[name] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from training import parallel` imports the module training.parallel
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


def unplaced_folders(root: Path) -> list[str]:
    """Each top-level folder of ``root`` that holds Python files and is neither a floor nor one of
    ``NOT_FLOORS``: the import checks would not see it. Hidden folders, virtual environments and
    what ``.gitignore`` names (build output, runs) are not part of the house."""
    gitignore = root / ".gitignore"
    ignored = [line.strip().rstrip("/") for line in gitignore.read_text().splitlines()
               if line.strip() and not line.startswith("#")] if gitignore.exists() else []
    found = []
    for path in sorted(root.iterdir()):
        if (not path.is_dir() or path.name.startswith(".") or (path / "pyvenv.cfg").exists()
                or any(fnmatch(path.name, pattern) for pattern in ignored)):
            continue
        if path.name not in FLOORS and path.name not in NOT_FLOORS and next(path.rglob("*.py"), None) is not None:
            found.append(path.name)
    return found


def imports_by_name(sources: dict[str, str]) -> list[str]:
    """Each call of ``import_module`` (importlib's) or ``__import__`` in ``sources`` ({module: its
    code}) outside ``LOADER`` that may import a module of tether's: any but one whose name is a
    literal naming another project's module. Such an import is an edge ``module_imports`` cannot see."""
    ours = set(FLOORS) | set(NOT_FLOORS)
    found = []
    for module, source in sorted(sources.items()):
        if module == LOADER:
            continue
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Call):
                continue
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if called not in ("import_module", "__import__"):
                continue
            name = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "name"), None)
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value.split(".")[0] not in ours:
                continue
            found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_checks_find_what_they_look_for():
    """A role importing another, an upward import and a circle, each found in a made-up graph."""
    edges = {"rollout.adapters": {"learner.lora"}, "learner.lora": set(), "common.config": {"launch.runner"},
             "launch.runner": {"launch.pipeline"}, "launch.pipeline": {"launch.runner"},
             ENTRY: {"demos.parity"}, "demos.parity": set()}
    assert wrong_way_imports(edges) == ["common.config -> launch.runner: launch is not below common",
                                        "rollout.adapters -> learner.lora: a role imports another role"]
    assert import_cycles(edges) == [["launch.pipeline", "launch.runner"]]


def test_the_folder_check_finds_a_folder_that_is_no_floor(tmp_path):
    """A made-up repository: a floor, the suite, a folder of notes, a hidden one, a build output and
    a virtual environment pass; a folder of Python that is on no floor is named."""
    for path in ("common/config.py", "tests/test_a.py", "notes/plan.md", ".cache/x.py", "build/lib/common/x.py",
                 "env/lib/site.py", "env/pyvenv.cfg", "scratch/tools/probe.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    (tmp_path / ".gitignore").write_text("# outputs\nbuild/\n*.egg-info/\n")
    assert unplaced_folders(tmp_path) == ["scratch"]


def test_the_by_name_check_finds_an_import_of_ours_outside_the_loader():
    """Made-up modules: an import by a name computed, one of a literal of ours and ``__import__``
    are found; the loader's own, and one naming another project's module, are not."""
    sources = {LOADER: "import importlib\nimportlib.import_module(spec)",
               "launch.pipeline": "import importlib\nimportlib.import_module(STAGE_RUNS[name]).run()",
               "rollout.engine": "from importlib import import_module\nimport_module(name='rollout.adapters')",
               "scorer.rewards": "__import__('vllm')\nimportlib.import_module('peft.tuners')\n"
                                 "__import__('tests.helpers')"}
    assert imports_by_name(sources) == ["launch.pipeline:2: importlib.import_module(STAGE_RUNS[name])",
                                        "rollout.engine:2: import_module(name='rollout.adapters')",
                                        "scorer.rewards:3: __import__('tests.helpers')"]


def test_every_folder_with_python_is_a_floor_or_named_as_none():
    assert unplaced_folders(Path(REPO)) == [], "put it on a floor (FLOORS) or name it in NOT_FLOORS"


def test_no_module_imports_one_of_ours_by_name_but_the_loader():
    """An import by name is an edge the floors' checks cannot see: a plain import, or user code
    through ``common.functions.load_function``."""
    sources = {name: path.read_text() for name, path in module_files(Path(REPO)).items()}
    assert "def load_function" in sources[LOADER] and "import_module(" in sources[LOADER]
    assert imports_by_name(sources) == []


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


@pytest.mark.parametrize("environment", ["environments.native:NativeEnvironment",
                                         "environments.agents:AgentEnvironment"])
def test_every_environment_has_the_members_an_episode_drives(environment):
    """``rollout.episodes`` drives any ``Environment`` alike, asking none what it can do: each
    implementation has each of its members, methods with the same parameters, and its attributes
    (on the class or set in ``__init__``)."""
    import importlib

    from environments.interface import Environment

    module, name = environment.split(":")
    implementation = getattr(importlib.import_module(module), name)
    attributes = set(Environment.__annotations__)
    methods = {member for member in vars(Environment) if not member.startswith("_")} - attributes
    assert attributes == {"tools", "deadline"}
    assert methods == {"turn_max_tokens", "begin_reset", "begin_step", "begin_last", "close"}
    source = inspect.getsource(implementation)
    for attribute in attributes:
        assert attribute in vars(implementation) or f"self.{attribute} = " in source or \
            f"self.{attribute}, " in source, f"{name} has no {attribute}"
    for member in methods:
        assert hasattr(implementation, member), f"{name} has no {member}"
        wanted, theirs = getattr(Environment, member), inspect.getattr_static(implementation, member)
        if isinstance(wanted, property):  # a value: a property, or a class attribute that does not change
            assert isinstance(theirs, property) or not callable(theirs), f"{name}.{member} is a method"
        else:
            assert shape(theirs) == shape(wanted), \
                f"{name}.{member}{inspect.signature(theirs)} is not Environment.{member}{inspect.signature(wanted)}"
