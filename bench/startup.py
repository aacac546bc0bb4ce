"""Start-up: time from `tether run` to the first trained step, and the whole demo run, phase by phase.

Runs `tether run` of configs/demo.yaml (the demo's models, built once into .demo/assets) as a
person would, timed from just before the command starts. Variants take turns in one process,
round after round, because this machine's speed drifts between minutes:

- ``default``: this checkout as configured (vLLM's engine in the rollout's process on CPU);
- ``engine-processes``: the same with ``rollout.in_process=false`` (vLLM's own three processes);
- ``shared-cores``: every role on both cores (issue 37's colocated shape without its shifts: each
  role may use every core, and they run side by side); ``shared-cores-passive`` the same with
  ``OMP_WAIT_POLICY=PASSIVE`` (OpenMP threads sleep at once when they wait, instead of spinning);
- ``colocate``: ``placement.mode=colocate``, the rollout, scorer and learner on both cores working
  the shifts the buffer grants; ``colocate-passive`` the same with ``GOMP_SPINCOUNT=0`` (idle
  OpenMP workers sleep at once, as OMP_WAIT_POLICY=PASSIVE alone makes them); ``default-k0`` and
  ``colocate-k0`` both at ``buffer.max_staleness=0``;
- ``--baseline DIR``: another checkout of tether (a git worktree of an older commit) run the same
  way, for a before/after. Its roles may write no phases: then only the totals are shown.
- ``--floor``: besides, the rollout's start alone, on core 0 with nothing else running: tether's
  imports, then vLLM's import and the demo's engine. No first trained step comes before it.

    python bench/startup.py [--rounds 2] [--baseline /tmp/tether-before] [--variants default,shared-cores] [--floor]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

FIRST_STEP_GOAL_S, RUN_GOAL_S = 15.0, 35.0
ISSUE_37_FIRST_STEP_S = 5.0
# the rollout's start alone in a process of its own on core 0: argv = start time, repo, overrides (JSON)
FLOOR = """
import json, os, sys, time
started = float(sys.argv[1])
os.sched_setaffinity(0, {0})
sys.path.insert(0, sys.argv[2])
import rollout.main
imported = time.time()
from common.config import load_config
from rollout.engine import make_vllm_engine
make_vllm_engine(load_config(os.path.join(sys.argv[2], "configs", "demo.yaml"), json.loads(sys.argv[3])))
print(json.dumps({"imports_s": imported - started, "engine_s": time.time() - imported}), flush=True)
os._exit(0)
"""
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def median(results: dict[str, list[dict]], name: str, key: str) -> float:
    """The median of figure ``key`` over variant ``name``'s rounds."""
    return statistics.median(r[key] for r in results[name])


def asset_keys(assets: str) -> list[str]:
    """The demo's models and prompts, built into ``assets``, as config overrides."""
    return [f"models.policy={assets}/sft", f"models.reward={assets}/rm", f"data.prompts={assets}/prompts.jsonl"]


def run_once(repo: str, assets: str, run_dir: str, overrides: list[str], config: str | None = None,
             arguments: tuple[str, ...] = (), env: dict[str, str] | None = None) -> dict:
    """One `tether run` of the demo (or of ``config``) from ``repo``: seconds to the first trained
    step and to the end, and the phases the roles wrote (none for a tether that writes none)."""
    from common.runlog import read_metrics
    from launch.report import startup_timeline

    config = config or os.path.join(repo, "configs", "demo.yaml")
    command = [sys.executable, "-m", "launch.cli", "run", "-c", config,
               "--overwrite", "-o", f"run_dir={run_dir}", *[item for key in asset_keys(assets) for item in ("-o", key)],
               *[item for override in overrides for item in ("-o", override)], *arguments]
    started = time.time()
    result = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=600,
                            env=None if env is None else {**os.environ, **env})
    ended = time.time()
    if result.returncode != 0:
        raise RuntimeError(f"tether run failed ({result.returncode}):\n{result.stderr[-3000:]}")
    steps = read_metrics(run_dir, "learner")
    return {"first_step_s": steps[0]["time"] - started, "run_s": ended - started,
            "startup": startup_timeline(run_dir), "steps": steps, "rollout": read_metrics(run_dir, "rollout0")}


def rollout_floor(assets: str) -> dict:
    """Seconds the rollout alone takes to its engine, on a core of its own: tether's imports, then
    vLLM's import and engine."""
    started = time.time()
    result = subprocess.run([sys.executable, "-c", FLOOR, str(started), REPO, json.dumps(asset_keys(assets))],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    if result.returncode != 0:
        raise RuntimeError(f"the rollout alone failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline", help="another tether checkout to time the same way (before/after)")
    parser.add_argument("--floor", action="store_true", help="also time the rollout's start alone on one core")
    parser.add_argument("--variants", default="default,engine-processes",
                        help="of default, engine-processes, shared-cores, shared-cores-passive, colocate, "
                             "colocate-passive, default-k0, colocate-k0; comma-separated")
    args = parser.parse_args()

    from demos.parity import build_assets
    from launch.report import format_startup

    assets = os.path.join(REPO, ".demo", "assets")
    build_assets(assets, log=lambda *_: None)  # cached after the first time
    shared = [f"placement.cores.{role}=[0,1]" for role in ("buffer", "rollout", "scorer", "learner")]
    known = {"default": [], "engine-processes": ["rollout.in_process=false"], "shared-cores": shared,
             "shared-cores-passive": shared, "colocate": ["placement.mode=colocate"],
             "colocate-passive": ["placement.mode=colocate"],
             "default-k0": ["buffer.max_staleness=0"],
             "colocate-k0": ["placement.mode=colocate", "buffer.max_staleness=0"]}
    variants = [(name, REPO, known[name]) for name in args.variants.split(",")]
    environments = {"shared-cores-passive": {"OMP_WAIT_POLICY": "PASSIVE"},
                    # the colocated roles' OpenMP workers without their short spin: sleeping at once
                    "colocate-passive": {"GOMP_SPINCOUNT": "0"}}
    if args.baseline:
        variants.append(("baseline", os.path.abspath(args.baseline), []))
    work = tempfile.mkdtemp(prefix="tether-bench-startup-")
    results: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    floors: list[float] = []
    for round_index in range(args.rounds):
        for name, repo, overrides in variants:
            result = run_once(repo, assets, os.path.join(work, name), overrides, env=environments.get(name))
            results[name].append(result)
            print(f"round {round_index + 1} {name:<17} first trained step {result['first_step_s']:5.1f}s, "
                  f"whole run {result['run_s']:5.1f}s", flush=True)
        if args.floor:
            floor = rollout_floor(assets)
            floors.append(floor["imports_s"] + floor["engine_s"])
            print(f"round {round_index + 1} the rollout alone on core 0: tether's imports {floor['imports_s']:.1f}s, "
                  f"vLLM's import and engine {floor['engine_s']:.1f}s", flush=True)

    print("\nlast round's phases, every process on one clock (seconds since `tether run` started):")
    for name, _, _ in variants:
        startup = results[name][-1]["startup"]
        if startup.phases:
            print(f"\n[{name}]\n{format_startup(startup)}")
    print("\nmedian over rounds (goal: first trained step <= "
          f"{FIRST_STEP_GOAL_S:.0f}s, whole run <= {RUN_GOAL_S:.0f}s):")
    for name, _, _ in variants:
        first = sorted(r["first_step_s"] for r in results[name])[len(results[name]) // 2]
        run = sorted(r["run_s"] for r in results[name])[len(results[name]) // 2]
        met = first <= FIRST_STEP_GOAL_S and run <= RUN_GOAL_S
        print(f"  {name:<17} first trained step {first:5.1f}s (limit {FIRST_STEP_GOAL_S:.0f}s), whole run "
              f"{run:5.1f}s (limit {RUN_GOAL_S:.0f}s): {'met' if met else 'NOT met'}")
    if floors:
        floor = statistics.median(floors)
        reach = "within" if floor < ISSUE_37_FIRST_STEP_S else "past"
        print(f"  the rollout alone has its engine {floor:.1f}s after its start, before any generation: issue 37's "
              f"first trained step in {ISSUE_37_FIRST_STEP_S:.0f}s is {reach} reach with vLLM generating the first "
              "batch")


if __name__ == "__main__":
    main()
