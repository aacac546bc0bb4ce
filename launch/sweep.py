"""`tether sweep`: short trials of one config over device splits and staleness bounds, ranked by
trained tokens/s; `tether plan`: the best split for N devices predicted from a profile's costs.

A split names each role's devices: ``rollout=0;scorer=1;learner=1;buffer=0`` (CPU cores here,
GPU indices with ``--gpus``). Roles that share a device share its time.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass

from launch.report import profile_run
from protocol.config import ROLES, TetherConfig, load_config

PLANNED_ROLES = ("rollout", "scorer", "learner")  # the buffer's share is negligible (docs/benchmarks.md)


def parse_split(text: str) -> dict[str, list[int]]:
    """``rollout=0;scorer=1;learner=1`` -> {"rollout": [0], ...}; ``0-3`` and ``0,2`` work too."""
    split = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        role, _, devices = part.partition("=")
        role = role.strip()
        if role not in ROLES or not devices:
            raise ValueError(f"split {text!r}: {part!r} is not role=devices (roles: {', '.join(ROLES)})")
        cores = []
        for piece in devices.split(","):
            low, _, high = piece.partition("-")
            cores += list(range(int(low), int(high or low) + 1))
        split[role] = cores
    missing = [role for role in PLANNED_ROLES if role not in split]
    if missing:
        raise ValueError(f"split {text!r} gives no devices to {', '.join(missing)}")
    return split


def format_split(split: dict[str, list[int]]) -> str:
    return ";".join(f"{role}={','.join(map(str, cores))}" for role, cores in split.items())


@dataclass
class Trial:
    split: str
    max_staleness: int
    run_dir: str
    tokens_per_s: float
    bottleneck: str
    stage_seconds: dict[str, float]  # busy seconds per role


def run_sweep(config: TetherConfig, splits: list[str], staleness: list[int], steps: int, gpus: bool,
              out_dir: str, log=print) -> list[Trial]:
    from launch.runner import run_pipeline

    trials = []
    for split_text, k in itertools.product(splits, staleness):
        split = parse_split(split_text)
        name = f"{format_split(split).replace(';', '_').replace('=', '').replace(',', '-')}_k{k}"
        run_dir = os.path.join(out_dir, name)
        overrides = [f"run_dir={run_dir}", f"buffer.max_staleness={k}", f"learner.total_steps={steps}",
                     "placement.cores={}", "placement.cuda_visible_devices={}"]
        for role, devices in split.items():
            if gpus:
                overrides.append(f"placement.cuda_visible_devices.{role}=\"{','.join(map(str, devices))}\"")
            else:
                overrides.append(f"placement.cores.{role}=[{','.join(map(str, devices))}]")
        trial_config = load_config(None, overrides, base=config.model_dump(mode="json"))
        log(f"sweep: {format_split(split)} max_staleness {k} -> {run_dir}")
        if run_pipeline(trial_config, overwrite=True) != 0:
            raise RuntimeError(f"trial {name} failed; see {run_dir}/logs")
        profile = profile_run(run_dir)
        busy = {r.role: r.wall_s - r.seconds.get("waiting", 0.0) for r in profile.roles if r.role != "buffer"}
        trials.append(Trial(format_split(split), k, run_dir, profile.pipeline_tokens_per_s, profile.bottleneck, busy))
    trials.sort(key=lambda trial: -trial.tokens_per_s)
    with open(os.path.join(out_dir, "sweep.json"), "w") as file:
        json.dump([trial.__dict__ for trial in trials], file, indent=2)
    return trials


def format_sweep(trials: list[Trial]) -> str:
    lines = [f"{'rank':<5}{'split':<44}{'k':>3}{'trained tokens/s':>18}  bottleneck", "-" * 84]
    for rank, trial in enumerate(trials, 1):
        lines.append(f"{rank:<5}{trial.split:<44}{trial.max_staleness:>3}{trial.tokens_per_s:>18,.0f}  {trial.bottleneck}")
    by_split: dict[str, dict[int, Trial]] = {}
    for trial in trials:
        by_split.setdefault(trial.split, {})[trial.max_staleness] = trial
    for split, by_k in by_split.items():
        if 0 in by_k and 1 in by_k:
            sync, overlapped = by_k[0], by_k[1]
            stages = sync.stage_seconds
            ideal = sum(stages.values()) / max(stages.values())
            lines.append(f"async gain on {split}: k=1 / k=0 = {overlapped.tokens_per_s / sync.tokens_per_s:.2f} "
                         f"(ideal, sum of stage times over the largest, from the k=0 trial: {ideal:.2f})")
    return "\n".join(lines)


# --------------------------------------------------------------------------- plan


def role_costs(run_dir: str) -> dict[str, float]:
    """Busy device-seconds per trained token of each role in a finished run (busy time x the
    number of devices it had), the unit cost the plan scales."""
    import yaml

    profile = profile_run(run_dir)
    with open(os.path.join(run_dir, "config.yaml")) as file:
        placement = yaml.safe_load(file).get("placement", {})
    devices = {**placement.get("cores", {}),
               **{role: str(v).split(",") for role, v in placement.get("cuda_visible_devices", {}).items()}}
    trained_tokens = profile.pipeline_tokens_per_s * next(r.wall_s for r in profile.roles if r.role == "learner")
    costs = {}
    for role in profile.roles:
        kind = "scorer" if role.role.startswith("scorer") else role.role
        if kind in PLANNED_ROLES:
            busy = role.wall_s - role.seconds.get("waiting", 0.0)
            costs[kind] = costs.get(kind, 0.0) + busy * len(devices.get(kind, [0])) / trained_tokens
    return costs


def predict(costs: dict[str, float], split: dict[str, list[int]]) -> float:
    """Trained tokens/s of a split when generation, scoring and training overlap (max_staleness
    >= 1): each device is shared by the roles on it, a role on m devices runs m times faster; the
    busiest device sets the pace."""
    load: dict[int, float] = {}
    for role in PLANNED_ROLES:
        for device in split[role]:
            load[device] = load.get(device, 0.0) + costs[role] / len(split[role])
    return 1.0 / max(load.values())


def best_splits(costs: dict[str, float], devices: int, top: int = 5) -> list[tuple[float, dict[str, list[int]]]]:
    ranges = [list(range(a, b + 1)) for a in range(devices) for b in range(a, devices)]
    scored = []
    for choice in itertools.product(ranges, repeat=len(PLANNED_ROLES)):
        split = dict(zip(PLANNED_ROLES, choice))
        scored.append((predict(costs, split), split))
    scored.sort(key=lambda item: -item[0])
    return scored[:top]
