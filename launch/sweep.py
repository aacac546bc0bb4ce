"""`tether sweep`: short trials of one config over device splits and staleness bounds, ranked by
trained tokens/s; `tether plan`: the best split for N devices predicted from a profile's costs.

A split names each role's devices: ``rollout=0;scorer=1;learner=1;buffer=0`` (CPU cores here,
GPU indices with ``--gpus``), and how many processes share them: ``rollout=0-1x2`` is two rollout
engines on cores 0 and 1, ``learner=1x2`` two learner ranks on core 1. Roles that share a device
share its time. ``colocate=0-1`` is the colocated mode (``placement.mode: colocate``): every role on
cores 0 and 1, working in shifts.

The plan scales each role's measured cost by how the role itself scaled: from the profiles of
two runs where it had different device counts (``RoleCost``), not by assuming that m devices make
it m times faster (which it assumes, and says, when a role was measured at one count only).
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass, field

from common.config import ROLES, TetherConfig, load_config
from launch.report import profile_run

PLANNED_ROLES = ("rollout", "scorer", "learner")  # the buffer's share is negligible (docs/benchmarks.md)


COUNT_KEYS = {"rollout": "rollout.engines", "scorer": "scorer.workers", "learner": "learner.ranks"}
COLOCATE = "colocate"  # a split of the colocated mode: colocate=0-1


def parse_split(text: str) -> dict[str, list[int]]:
    """``rollout=0;scorer=1;learner=1`` -> {"rollout": [0], ...}; ``0-3`` and ``0,2`` work too.
    A ``xN`` suffix (processes per role) is read by ``parse_counts``. ``colocate=0-1``: every role
    on those devices (``is_colocated``)."""
    if is_colocated(text):
        devices = _devices(text.partition("=")[2])
        return {role: list(devices) for role in PLANNED_ROLES}
    split = {role: _devices(devices) for role, devices, _ in _parts(text)}
    missing = [role for role in PLANNED_ROLES if role not in split]
    if missing:
        raise ValueError(f"split {text!r} gives no devices to {', '.join(missing)}")
    return split


def is_colocated(text: str) -> bool:
    return text.strip().startswith(f"{COLOCATE}=")


def _devices(text: str) -> list[int]:
    devices = []
    for piece in text.split(","):
        low, _, high = piece.partition("-")
        if not low.strip().isdigit() or (high and not high.strip().isdigit()):
            raise ValueError(f"{text!r} is not a list of devices (0-3, 0,2)")
        devices += list(range(int(low), int(high or low) + 1))
    return devices


def parse_counts(text: str) -> dict[str, int]:
    """Processes per role of a split: ``rollout=0-1x2`` -> {"rollout": 2}; 1 where not given."""
    if is_colocated(text):
        return {role: 1 for role in PLANNED_ROLES}
    counts = {role: int(count or 1) for role, _, count in _parts(text)}
    for role, count in counts.items():
        if count > 1 and role not in COUNT_KEYS:
            raise ValueError(f"split {text!r}: the {role} is one process (no x{count})")
    return counts


def _parts(text: str) -> list[tuple[str, str, str]]:
    parts = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        role, _, value = part.partition("=")
        devices, _, count = value.partition("x")
        role = role.strip()
        if role not in ROLES or not devices or (count and not count.isdigit()):
            raise ValueError(f"split {text!r}: {part!r} is not role=devices[xN] (roles: {', '.join(ROLES)})")
        parts.append((role, devices, count))
    return parts


def format_split(split: dict[str, list[int]], counts: dict[str, int] | None = None) -> str:
    counts = counts or {}
    return ";".join(f"{role}={','.join(map(str, cores))}" + (f"x{counts[role]}" if counts.get(role, 1) > 1 else "")
                    for role, cores in split.items())


@dataclass
class Trial:
    split: str
    max_staleness: int
    run_dir: str
    tokens_per_s: float
    bottleneck: str
    stage_seconds: dict[str, float]  # busy seconds per role


def run_sweep(config: TetherConfig, splits: list[str], staleness: list[int], steps: int, gpus: bool,
              out_dir: str, log=print, ray: str | None = None) -> list[Trial]:
    """Each split at each bound for ``steps`` steps, ranked by trained tokens/s. With ``ray`` (a
    cluster's address, "" for one on this machine) a split's devices are counts: each process of a
    role asks Ray for its share of them (``placement.ray.gpus`` with ``gpus``, else ``cpus``)."""
    from launch.preflight import check_placement
    from launch.runner import run_roles

    planned = []
    for split_text, k in itertools.product(splits, staleness):
        split, counts = parse_split(split_text), parse_counts(split_text)
        shown = (f"{COLOCATE}={','.join(map(str, split['rollout']))}" if is_colocated(split_text)
                 else format_split(split, counts))
        name = f"{shown.replace(';', '_').replace('=', '').replace(',', '-')}_k{k}"
        run_dir = os.path.join(out_dir, name)
        trial_config = load_config(None, trial_overrides(split_text, k, steps, run_dir, gpus, ray),
                                   base=config.model_dump(mode="json"))
        if ray is None:  # every trial's cores before the first runs; Ray names no core of this host
            check_placement(trial_config)
        planned.append((shown, k, name, run_dir, trial_config))
    trials = []
    for shown, k, name, run_dir, trial_config in planned:
        log(f"sweep: {shown} max_staleness {k} -> {run_dir}")
        if run_roles(trial_config, overwrite=True, ray=ray) != 0:
            raise RuntimeError(f"trial {name} failed; see {run_dir}/logs")
        profile = profile_run(run_dir)
        busy = {r.role: r.wall_s - r.seconds.get("waiting", 0.0) for r in profile.roles if r.role != "buffer"}
        trials.append(Trial(shown, k, run_dir, profile.pipeline_tokens_per_s, profile.bottleneck, busy))
    trials.sort(key=lambda trial: -trial.tokens_per_s)
    with open(os.path.join(out_dir, "sweep.json"), "w") as file:
        json.dump([trial.__dict__ for trial in trials], file, indent=2)
    return trials


def trial_overrides(split_text: str, k: int, steps: int, run_dir: str, gpus: bool, ray: str | None) -> list[str]:
    """The config changes of one trial: the split's devices for the roles it names, in the kind it
    names (cores, GPUs with ``gpus``, Ray's counts with ``ray``). The rest of the user's placement
    stays: the buffer's and the agent programs' cores, the cores of a GPU trial."""
    split, counts, colocated = parse_split(split_text), parse_counts(split_text), is_colocated(split_text)
    overrides = [f"run_dir={run_dir}", f"buffer.max_staleness={k}", f"learner.total_steps={steps}",
                 f"placement.mode={'colocate' if colocated else 'split'}"]
    overrides += [f"{COUNT_KEYS[role]}={counts.get(role, 1)}" for role in PLANNED_ROLES]
    for role, devices in split.items():
        if ray is not None:  # a share of the devices for each of the role's processes (a learner: per rank)
            overrides.append(f"placement.ray.{'gpus' if gpus else 'cpus'}.{role}={len(devices) / counts.get(role, 1)}")
        elif gpus:
            overrides.append(f"placement.cuda_visible_devices.{role}=\"{','.join(map(str, devices))}\"")
        else:
            overrides.append(f"placement.cores.{role}=[{','.join(map(str, devices))}]")
    return overrides


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


@dataclass
class RoleCost:
    """Busy device-seconds per trained token of one role, measured at one or more device counts.
    ``at(m)`` interpolates (and extrapolates) between two measurements as a power law in m, the
    shape of a fixed serial part plus a parallel one over this range; with one measurement it
    assumes linear scaling (a constant cost), and ``measured_scaling`` says so."""
    points: dict[int, float] = field(default_factory=dict)  # devices -> cost

    @property
    def measured_scaling(self) -> bool:
        return len(self.points) >= 2

    def at(self, devices: int) -> float:
        counts = sorted(self.points)
        if len(counts) == 1:
            return self.points[counts[0]]
        if devices in self.points:
            return self.points[devices]
        # the two measurements nearest to ``devices`` (on a log scale)
        low, high = sorted(sorted(counts, key=lambda m: abs(math.log(m / devices)))[:2])
        exponent = math.log(self.points[high] / self.points[low]) / math.log(high / low)
        return self.points[low] * (devices / low) ** exponent

    def efficiency(self, devices: int) -> float:
        """Speed-up on ``devices`` over one device, as a share of ``devices``."""
        return self.at(1) / self.at(devices)


def role_costs(run_dir: str) -> dict[str, tuple[int, float]]:
    """Busy device-seconds per trained token of each role in a finished run (busy time x the
    number of devices it had), with that number: the unit cost the plan scales."""
    saved = _saved_config(run_dir)
    profile = profile_run(run_dir)
    placement = saved.get("placement", {})
    devices = {**placement.get("cores", {}),
               **{role: str(v).split(",") for role, v in placement.get("cuda_visible_devices", {}).items()}}
    if placement.get("mode") == COLOCATE:  # every role had all of them (all the machine's where none is named)
        named = {device for listed in devices.values() for device in listed}
        devices = {role: sorted(named) or sorted(os.sched_getaffinity(0)) for role in PLANNED_ROLES}
    ray = placement.get("ray", {})
    for role, share in {**ray.get("cpus", {}), **ray.get("gpus", {})}.items():  # a trial of `tether sweep --ray`
        processes = {"rollout": "engines", "scorer": "workers", "learner": "ranks"}.get(role)
        count = saved.get(role, {}).get(processes, 1) if processes else 1
        devices[role] = [0] * max(1, round(share * count))
    trained_tokens = profile.pipeline_tokens_per_s * next(r.wall_s for r in profile.roles if r.role == "learner")
    if trained_tokens <= 0:
        raise FileNotFoundError(f"{run_dir}/metrics/learner.jsonl records no trained token: not a finished run")
    busy: dict[str, list[float]] = {}
    for role in profile.roles:
        kind = role.role.rstrip("0123456789")
        if kind in PLANNED_ROLES:
            busy.setdefault(kind, []).append(role.wall_s - role.seconds.get("waiting", 0.0))
    # a pool's processes (engines, scorers) split or share the role's devices: either way the
    # device-seconds are their mean busy time times the devices
    return {kind: (len(devices.get(kind, [0])), sum(times) / len(times) * len(devices.get(kind, [0])) / trained_tokens)
            for kind, times in busy.items()}


def measured_costs(run_dirs: list[str]) -> dict[str, RoleCost]:
    """Each role's cost from the profiles of several runs, keyed by the devices it had in each."""
    measured: dict[str, dict[int, list[float]]] = {}
    for run_dir in run_dirs:
        for role, (devices, cost) in role_costs(run_dir).items():
            measured.setdefault(role, {}).setdefault(devices, []).append(cost)
    missing = [role for role in PLANNED_ROLES if role not in measured]
    if missing:
        raise FileNotFoundError(f"{', '.join(run_dirs)}: no metrics of the {' or '.join(missing)} (metrics/"
                                f"{missing[0]}*.jsonl): the plan needs a finished run of every role")
    # two runs that gave a role the same device count: their mean
    return {role: RoleCost({devices: sum(values) / len(values) for devices, values in points.items()})
            for role, points in measured.items()}


def _saved_config(run_dir: str) -> dict:
    """A run's own config.yaml, as saved by `tether run`."""
    import yaml

    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{run_dir} is not a finished tether run: it holds no config.yaml")
    with open(path) as file:
        return yaml.safe_load(file) or {}


def measured_modes(run_dirs: list[str]) -> set[str]:
    """The placement modes (split, colocate) that the runs measured."""
    return {(_saved_config(run_dir).get("placement") or {}).get("mode", "split") for run_dir in run_dirs}


def recommendation(best: tuple[float, dict[str, list[int]]], colocated: float, devices: int,
                   modes: set[str]) -> str:
    """Which mode to run on ``devices``: the faster predicted, unless no profile measured that mode.
    A prediction for a mode never run only scales each role's cost; it leaves out what the mode
    adds (the hand-overs between shifts colocated, roles crowding a shared device split): from one
    split profile, colocated was predicted 1.02x the best split and measured 8% slower."""
    rate, split = best
    label = {"split": format_split(split), COLOCATE: "colocated"}
    if math.isclose(rate, colocated, rel_tol=1e-6):  # one device: every role shares it either way
        kept = "split" if "split" in modes else COLOCATE
        shared = "1 device every role shares it" if devices == 1 else f"{devices} devices every role shares them"
        return (f"would run: {label[kept]}, the mode measured: on {shared} either way, and the prediction cannot "
                "tell computing at once from working in shifts")
    faster, slower = (COLOCATE, "split") if colocated > rate else ("split", COLOCATE)
    gain = max(rate, colocated) / min(rate, colocated)
    if faster not in modes:
        sweep = f"colocate=0-{devices - 1}" if faster == COLOCATE else label["split"]
        return (f"would run: {label[slower]}, the mode measured; {label[faster]} is predicted {gain:.2f}x faster, "
                "but no profile measured that mode and the prediction leaves out what it adds: measure it before "
                f"choosing it (tether sweep --split '{sweep}')")
    if faster == COLOCATE:
        return (f"would run: colocated, {gain:.2f}x the best split: each role is faster on {devices} devices than "
                "the split would make the pipeline")
    return (f"would run: {label['split']}, {gain:.2f}x colocated: the roles computing side by side on their own "
            "devices beat working in shifts on all of them")


def plan_lines(costs: dict[str, RoleCost], devices: int, modes: set[str]) -> list[str]:
    """`tether plan`'s report: each role's measured cost, the best splits, colocated, the choice."""
    lines = []
    for role, cost in costs.items():
        points = ", ".join(f"{1000 * c:.3f} on {m}" for m, c in sorted(cost.points.items()))
        how = (f"measured scaling: {cost.efficiency(2):.0%} efficient on 2 devices" if cost.measured_scaling
               else "one device count measured: linear scaling assumed")
        lines.append(f"{role}: busy device-ms per trained token {points} ({how})")
    splits = best_splits(costs, devices)
    for rank, (rate, split) in enumerate(splits, 1):
        lines.append(f"{rank}. {format_split(split):<40} predicted {rate:,.0f} trained tokens/s")
    colocated = predict_colocated(costs, devices)
    lines.append(f"colocated (placement.mode colocate, every role on all {devices} device{'s' if devices > 1 else ''}, "
                 f"working in shifts): predicted {colocated:,.0f} trained tokens/s")
    lines.append(recommendation(splits[0], colocated, devices, modes))
    return lines


def predict(costs: dict[str, "RoleCost | float"], split: dict[str, list[int]]) -> float:
    """Trained tokens/s of a split when generation, scoring and training overlap (max_staleness
    >= 1): each device is shared by the roles on it, a role on m devices keeps each of them busy
    for cost(m) / m per token; the busiest device sets the pace."""
    load: dict[int, float] = {}
    for role in PLANNED_ROLES:
        count = len(split[role])
        cost = costs[role].at(count) if isinstance(costs[role], RoleCost) else costs[role]
        for device in split[role]:
            load[device] = load.get(device, 0.0) + cost / count
    return 1.0 / max(load.values())


def predict_colocated(costs: dict[str, "RoleCost | float"], devices: int) -> float:
    """Trained tokens/s of the colocated mode (``placement.mode: colocate``): every role on all
    ``devices``, one at a time, each shift as fast as the role is on that many. The hand-overs
    between shifts are not in it (a weight load is in the rollout's busy time already)."""
    return 1.0 / sum((costs[role].at(devices) if isinstance(costs[role], RoleCost) else costs[role]) / devices
                     for role in PLANNED_ROLES)


def best_splits(costs: dict[str, "RoleCost | float"], devices: int,
                top: int = 5) -> list[tuple[float, dict[str, list[int]]]]:
    """The best ``top`` splits of ``devices``, predicted. Every role on every device is the
    colocated shape, which ``predict_colocated`` rates: computing side by side there, the roles'
    threads would crowd each other out."""
    ranges = [list(range(a, b + 1)) for a in range(devices) for b in range(a, devices)]
    scored = []
    for choice in itertools.product(ranges, repeat=len(PLANNED_ROLES)):
        if devices > 1 and all(len(cores) == devices for cores in choice):
            continue
        split = dict(zip(PLANNED_ROLES, choice))
        scored.append((predict(costs, split), split))
    scored.sort(key=lambda item: -item[0])
    return scored[:top]


def check_line(costs: dict[str, RoleCost], run_dir: str) -> str:
    """The prediction for the placement a measured run had, beside what it measured."""
    placement = _saved_config(run_dir).get("placement", {})
    if placement.get("mode") == COLOCATE:  # on the devices that run had (role_costs counts them alike)
        predicted = predict_colocated(costs, role_costs(run_dir)["learner"][0])
    else:
        predicted = predict(costs, {role: placement["cores"][role] for role in PLANNED_ROLES})
    measured = profile_run(run_dir).pipeline_tokens_per_s
    return (f"check {run_dir}: predicted {predicted:,.0f}, measured {measured:,.0f} trained tokens/s "
            f"({(predicted - measured) / measured:+.0%})")
