"""Reading a run directory: the dashboard PNG (`tether plot`), where time goes (`tether profile`) and
the live view (`tether status`). Everything here reads RUN_DIR/metrics; nothing talks to a role."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

from common.runlog import StartupTimeline, read_metrics

# role -> (metric key, category) of the time each record accounts for; the rest of a role's wall
# time is what no record covers (start-up before the first record is not in its wall time)
TIME_CATEGORIES = {
    "rollout": (("busy_s", "generation"), ("weight_sync_s", "weight sync"), ("send_s", "sending"),
                ("waiting_s", "waiting")),
    "scorer": (("busy_s", "scoring"), ("send_s", "sending"), ("waiting_s", "waiting")),
    "learner": (("train_s", "training"), ("weight_sync_s", "weight sync"), ("waiting_s", "waiting")),
}

PANELS = (
    ("reward", (("learner", "reward", "trained on (score + turn rewards)"),
                ("learner", "score", "score (RM + functions)"), ("eval", "reward", "held-out (eval)"),
                ("learner", "gold_reward", "gold"))),
    ("KL to reference", (("learner", "kl", "kl"), ("eval", "kl_to_reference", "held-out (eval)"),
                         ("learner", "teacher_kl", "to the teacher, per token (distillation)"))),
    ("response length", (("learner", "response_length", "tokens"),)),
    ("entropy", (("learner", "entropy", "nats/token"),)),
    ("value loss", (("learner", "value_loss", "value loss"),)),
    ("clip fraction", (("learner", "clipfrac", "clipfrac"), ("learner", "approx_kl", "approx_kl"))),
    ("staleness", (("learner", "staleness", "mean"), ("learner", "staleness_max", "max"),
                   ("learner", "max_staleness", "bound k"))),  # k's trace under buffer.max_staleness: auto
    ("throughput", (("learner", "trained_tokens_per_s", "trained tokens/s"),
                    ("rollout", "tokens_per_s", "rollout tokens/s"))),  # one line per engine
    # episodes (rollout.environment, rollout.tools): drawn only for a run that has them (EPISODES)
    ("episodes", (("rollout", "turns_per_episode", "turns per episode"),
                  ("rollout", "tool_calls_per_episode", "tool calls per episode"))),
    # buffer.filter_groups: drawn only for a run that filters (DYNAMIC_SAMPLING)
    ("dynamic sampling", (("buffer", "groups_filtered", "groups filtered, in all"),
                          ("buffer", "groups_unfiltered", "kept: the batch's bound was reached"))),
)


EPISODES, DYNAMIC_SAMPLING, SCORING = "episodes", "dynamic sampling", "judges and reward calls"


def panels_of(metrics: dict[str, list[dict]]) -> list[tuple]:
    """PPO's panels for a run's metrics: the episodes panel only where the rollouts ran episodes
    (an empty panel on every single-turn dashboard read as something missing), the dynamic sampling
    panel only where the buffer filtered groups, and the scorers' judges (each one's score) and
    failures only where there are judges or a reward call failed."""
    episodes = any("turns_per_episode" in record for name, records in metrics.items()
                   if name.startswith("rollout") for record in records)
    filtering = any("groups_filtered" in record for record in metrics.get("buffer", []))
    scorers = [record for name, records in metrics.items() if name.startswith("scorer") for record in records]
    judges = sorted({key.split(":", 1)[1] for record in scorers for key in record if key.startswith("judge_unparsed:")})
    scoring = [(SCORING, (*(("scorer", f"judge:{name}", f"judge {name}: score") for name in judges),
                          ("scorer", "judge_unparsed", "judges' answers unparsed"),
                          ("scorer", "reward_failed", "reward calls failed")))]
    failed = any(record.get("reward_failed") for record in scorers)
    return [panel for panel in PANELS if (panel[0] != EPISODES or episodes)
            and (panel[0] != DYNAMIC_SAMPLING or filtering)] + (scoring if judges or failed else [])


# tether sft / rm / dpo (metrics/<stage>.jsonl): (title, left axis, right axis), each (key, label)
STAGE_PANELS = {
    "sft": ("sft: next-token loss", (("loss", "train"), ("eval_loss", "held-out")), ()),
    "rm": ("rm: K-wise loss and pair accuracy", (("loss", "train loss"), ("eval_loss", "held-out loss")),
           (("accuracy", "train accuracy"), ("eval_accuracy", "held-out accuracy"))),
    "dpo": ("dpo: loss and preference accuracy", (("loss", "train loss"), ("eval_loss", "held-out loss")),
            (("accuracy", "train accuracy"), ("eval_accuracy", "held-out accuracy"), ("eval_margin", "held-out margin"))),
}


def _role_metrics(run_dir: str) -> dict[str, list[dict]]:
    names = [os.path.basename(path)[:-len(".jsonl")] for path in glob.glob(os.path.join(run_dir, "metrics", "*.jsonl"))
             if os.path.basename(path) != StartupTimeline.FILE]  # every role's phases, read on their own
    return {name: read_metrics(run_dir, name) for name in sorted(names)}


def plot_run(run_dir: str, output: str | None = None) -> tuple[str, list[str]]:
    """One PNG with a panel per signal docs/design.md says to read together; returns (path, panel titles)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = _role_metrics(run_dir)
    learner = metrics.get("learner", [])
    stages = [name for name in STAGE_PANELS if metrics.get(name)]
    if not learner and not stages:
        raise FileNotFoundError(f"{run_dir}/metrics/learner.jsonl has no step yet (nor sft, rm or dpo metrics)")
    ppo_panels = panels_of(metrics) if learner else []
    panels = ppo_panels + stages
    figure, axes = plt.subplots((len(panels) + 1) // 2, 2, figsize=(13, 3.2 * ((len(panels) + 1) // 2)),
                                constrained_layout=True, squeeze=False)
    titles = []
    for axis, (title, series) in zip(axes.flat, ppo_panels):
        # a pool's role names every process of it: rollout -> rollout0, rollout1, ...
        series = [(name, key, label.replace(role, name)) for role, key, label in series
                  for name in ([role] if role in metrics else [n for n in metrics if n.rstrip("0123456789") == role])]
        for index, (role, key, label) in enumerate(series):
            # a scorer's records: by the policy version that generated what it scored
            records = [{**r, "step": r.get("step", r.get("policy_version"))} for r in metrics.get(role, [])
                       if r.get(key) is not None and ("step" in r or "policy_version" in r)]
            if not records:
                continue
            if key == "gold_reward":  # 0..1, on its own scale beside the RM's
                twin = axis.twinx()
                twin.plot([r["step"] for r in records], [r[key] for r in records], marker=".", color="C1", label=label)
                twin.set_ylabel("gold (0-1)")
                twin.legend(loc="lower right", fontsize=8)
            else:
                axis.plot([r["step"] for r in records], [r[key] for r in records], marker=".", label=label,
                          color=f"C{index}")
        alert_steps = [r["step"] for r in learner if r.get("alerts")]
        for step in alert_steps:
            axis.axvline(step, color="red", alpha=0.15)
        axis.set_title(title)
        axis.set_xlabel("learner step (policy version)")
        axis.grid(alpha=0.3)
        if axis.lines:
            axis.legend(loc="best", fontsize=8)
        titles.append(title)
    titles += [_plot_stage(axis, name, metrics[name]) for axis, name in zip(axes.flat[len(titles):], stages)]
    for axis in axes.flat[len(panels):]:
        axis.set_visible(False)
    figure.suptitle(f"tether run {os.path.abspath(run_dir)}  (red: steps with a health alert)", fontsize=10)
    output = output or os.path.join(run_dir, "dashboard.png")
    figure.savefig(output, dpi=80)
    plt.close(figure)
    return output, titles


def _plot_stage(axis, name: str, records: list[dict]) -> str:
    """Stage ``name``'s panel: its losses on the left axis, its accuracies on the right."""
    title, left, right = STAGE_PANELS[name]
    twin = axis.twinx() if right else None
    for index, (target, series) in enumerate(((axis, left), (twin, right))):
        for number, (key, label) in enumerate(series):
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                target.plot(*zip(*points), marker="." if key.startswith("eval_") else None, label=label,
                            color=f"C{2 * number + index}", linestyle="--" if index else "-")
    for target, place in ((axis, "upper left"), (twin, "lower right")):
        if target is not None and target.lines:
            target.legend(loc=place, fontsize=8)
    axis.set_title(title)
    axis.set_xlabel(f"{name} optimizer step")
    axis.grid(alpha=0.3)
    return title


@dataclass
class RoleProfile:
    role: str
    wall_s: float
    seconds: dict[str, float] = field(default_factory=dict)  # category -> seconds
    tokens_per_s: float | None = None
    startup_s: float = 0.0
    # a learner's or scorer's passes, averaged over its records: padding_share and prefix_share
    # (``training.micro_batches.pass_shares``), what learner.packing / scorer.packing saves or would
    shares: dict[str, float] = field(default_factory=dict)

    @property
    def accounted_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def busy_fraction(self) -> float:
        return 1.0 - self.seconds.get("waiting", 0.0) / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class Phase:
    role: str
    phase: str
    start_s: float  # since `tether run` started (or the first process, for roles started by hand)
    seconds: float

    @property
    def end_s(self) -> float:
        return self.start_s + self.seconds


@dataclass
class Startup:
    """Every process's start-up phases (``common.runlog.StartupTimeline``) on one clock."""
    phases: list[Phase]
    first_step_s: float | None  # the learner's first step trained and published
    run_s: float | None  # the whole `tether run`, from its start to every role gone

    def critical(self) -> str | None:
        """The role the first step waited on: whoever was ready last among those that feed it."""
        ready = {p.role: p.end_s for p in self.phases if p.phase in ("buffer connect", "listening")}
        return max(ready, key=ready.get) if ready else None


def startup_timeline(run_dir: str) -> Startup:
    """The phases of the last start of the run in ``run_dir`` (a resume appends a new one)."""
    records = read_metrics(run_dir, "startup")
    starts = [i for i, r in enumerate(records) if r["role"] == "tether run" and r["phase"] == "start roles"]
    if starts:
        records = records[starts[-1]:]
    if not records:
        return Startup([], None, None)
    zero = records[0]["start"] if starts else min(r["start"] for r in records)
    phases = [Phase(r["role"], r["phase"], r["start"] - zero, r["end"] - r["start"]) for r in records]
    first = [p.end_s for p in phases if p.role == "learner" and p.phase == "first step"]
    run = [p.end_s for p in phases if p.role == "tether run" and p.phase == "run"]
    return Startup(phases, first[0] if first else None, run[0] if run else None)


def format_startup(startup: Startup) -> str:
    lines = [f"{'role':<11}{'phase':<18}{'from':>8}{'to':>8}{'seconds':>9}"]
    for phase in sorted(startup.phases, key=lambda p: (p.role != "tether run", p.role, p.start_s)):
        lines.append(f"{phase.role:<11}{phase.phase:<18}{phase.start_s:>7.1f}s{phase.end_s:>7.1f}s{phase.seconds:>8.2f}s")
    if startup.first_step_s is not None:
        lines.append(f"first trained step {startup.first_step_s:.1f}s after the start; last ready to serve: "
                     f"{startup.critical()}")
    if startup.run_s is not None:
        lines.append(f"whole run {startup.run_s:.1f}s")
    return "\n".join(lines)


@dataclass
class Profile:
    roles: list[RoleProfile]
    pipeline_tokens_per_s: float
    bottleneck: str
    advice: str
    startup: Startup = field(default_factory=lambda: Startup([], None, None))
    packing: dict[str, str] = field(default_factory=dict)  # learner.packing and scorer.packing of the run


def run_starts(run_dir: str) -> list[float]:
    """When each `tether run` of ``run_dir`` started (``time.time()``): the first, and each resume."""
    return sorted(r["start"] for r in read_metrics(run_dir, "startup")
                  if r.get("role") == "tether run" and r.get("phase") == "start roles")


def sessions(records: list[dict], starts: list[float]) -> list[list[dict]]:
    """A role's records in runs: a new one wherever a `tether run` started between two records (a
    resume). The time between a stop and a resume is no role's: the roles' wall time leaves it out."""
    runs: list[list[dict]] = []
    for record in records:
        if not runs or any(runs[-1][-1]["time"] < start <= record["time"] for start in starts):
            runs.append([])
        runs[-1].append(record)
    return runs


def _role_profile(name: str, records: list[dict], starts: list[float]) -> RoleProfile | None:
    """Where the time of a rollout, scorer or learner went, over each run of the directory (a resume
    is another)."""
    kind = name.rstrip("0123456789")  # rollout0, scorer1 -> their role
    records = [r for r in records if "iteration_s" in r]
    if not records:
        return None
    # The first wait of a role in each run is start-up (the others loading models, vLLM starting),
    # not steady state: it is left out of the wall time and the shares, and shown on its own. The
    # records of one run tile it: each covers the time since the one before.
    runs = sessions(records, starts)
    startup = sum(run[0].get("waiting_s", 0.0) for run in runs)
    wall = sum(run[-1]["time"] - (run[0]["time"] - run[0]["iteration_s"]) for run in runs) - startup
    seconds = {category: sum(r.get(key, 0.0) for r in records) for key, category in TIME_CATEGORIES[kind]}
    seconds["waiting"] -= startup
    tokens = sum(r.get("response_tokens", 0) for r in records)
    rate = tokens / wall if tokens and wall > 0 else None
    if kind == "scorer":
        busy = seconds["scoring"]
        scored = sum(r.get("tokens", r.get("tokens_per_s", 0.0) * r["busy_s"]) for r in records)
        rate = scored / wall if busy > 0 else None
    shares = {key: sum(r[key] for r in records if key in r) / count
              for key in ("padding_share", "prefix_share") if (count := sum(key in r for r in records))}
    return RoleProfile(name, wall, seconds, rate, startup, shares)


def _buffer_profile(records: list[dict], starts: list[float]) -> RoleProfile | None:
    """The buffer's handling time; each of its processes counts from its own start (``elapsed_s``)."""
    lasts = [run[-1] for run in sessions([r for r in records if "busy_s_total" in r], starts)]
    if not lasts:
        return None
    elapsed, busy = sum(last["elapsed_s"] for last in lasts), sum(last["busy_s_total"] for last in lasts)
    return RoleProfile("buffer", elapsed, {"handling": busy, "waiting": elapsed - busy})


WORK = {"rollout": "generation", "scorer": "scoring", "learner": "training"}


def advice(bottleneck: str, colocated: bool) -> str:
    """What to change for the role ``bottleneck`` (rollout0, learner, ...) that limits a run."""
    kind = bottleneck.rstrip("0123456789")
    if colocated and kind in WORK:
        # working in shifts, no role computes while another does: a bound on staleness lets nothing run ahead
        return (f"{WORK[kind]} takes the longest shifts: the roles work in shifts on the same devices (placement.mode "
                "colocate), so a step lasts as long as its shifts together and max_staleness lets nothing run "
                "ahead; a faster role, more devices, or a split where the roles overlap (`tether plan` "
                "predicts one) shortens it")
    return {
        "rollout": "generation limits the pipeline: give the rollout more devices (or more rollout processes)",
        "learner": "training limits the pipeline: give the learner more devices; raising max_staleness lets "
                   "generation run further ahead meanwhile",
        "buffer": "the buffer limits the pipeline: larger sample chunks (rollout.prompts_per_generate)",
    }.get(kind, "scoring limits the pipeline: add scorer workers (scorer.workers) or give them more devices")


def _colocated(run_dir: str) -> bool:
    """Whether the run's config.yaml says ``placement.mode: colocate`` (roles started by hand: none)."""
    return _configured(run_dir, "placement", "mode") == "colocate"


def _configured(run_dir: str, section: str, key: str, default=None):
    """``section.key`` of the run's config.yaml, or ``default`` where it says none (or there is none:
    roles started by hand)."""
    import yaml

    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        return default
    with open(path) as file:
        return ((yaml.safe_load(file) or {}).get(section) or {}).get(key, default)


def profile_run(run_dir: str) -> Profile:
    metrics = _role_metrics(run_dir)
    starts = run_starts(run_dir)
    roles = []
    for name, records in metrics.items():
        kind = name.rstrip("0123456789")
        role = (_role_profile(name, records, starts) if kind in TIME_CATEGORIES
                else _buffer_profile(records, starts) if kind == "buffer" else None)
        if role is not None:
            roles.append(role)
    learner = next((r for r in roles if r.role == "learner"), None)
    if learner is None:
        raise FileNotFoundError(f"{run_dir}/metrics/learner.jsonl has no step yet")
    trained_tokens = sum(r.get("response_tokens", 0) for r in metrics["learner"])
    bottleneck = max(roles, key=lambda r: r.busy_fraction)
    packing = {kind: _configured(run_dir, kind, "packing", "none") for kind in ("learner", "scorer")}
    return Profile(roles, trained_tokens / learner.wall_s if learner.wall_s > 0 else 0.0, bottleneck.role,
                   advice(bottleneck.role, _colocated(run_dir)), startup_timeline(run_dir), packing)


def format_profile(profile: Profile) -> str:
    categories = []
    for role in profile.roles:
        categories += [c for c in role.seconds if c not in categories]
    header = (f"{'role':<9}{'start-up':>9}{'wall s':>8}{'busy':>7}" + "".join(f"{c:>13}" for c in categories)
              + f"{'tokens/s':>11}")
    lines = [header, "-" * len(header)]
    for role in profile.roles:
        cells = "".join(f"{role.seconds[c]:>12.2f}s" if c in role.seconds else f"{'':>13}" for c in categories)
        rate = f"{role.tokens_per_s:>11,.0f}" if role.tokens_per_s else f"{'':>11}"
        lines.append(f"{role.role:<9}{role.startup_s:>8.1f}s{role.wall_s:>8.1f}{role.busy_fraction:>7.0%}{cells}{rate}")
    lines.append("")
    lines.append("start-up: each role's first wait (models loading, vLLM starting; a resume's too), left out of its "
                 "wall time, as is the time between a stop and its resume")
    lines.append(f"pipeline: {profile.pipeline_tokens_per_s:,.0f} trained tokens/s")
    lines.append(f"bottleneck: {profile.bottleneck} ({profile.advice})")
    lines += format_passes(profile)
    if profile.startup.phases:
        lines += ["", "start-up, every process on one clock (seconds since `tether run` started):",
                  format_startup(profile.startup)]
    return "\n".join(lines)


def format_passes(profile: Profile) -> list[str]:
    """What the learner's and the scorers' passes compute for nothing: the padding (``pack`` skips it)
    and the prefixes rows repeat (``tree`` computes each once), with the packing each ran."""
    rows = [role for role in profile.roles if role.shares]
    if not rows:
        return []
    lines = ["", "passes: of the tokens padded passes compute, the padding; of the real ones, those that repeat "
                 "another row's prefix (learner.packing / scorer.packing: pack skips the padding, tree the "
                 "repeats too)"]
    for role in rows:
        kind = role.role.rstrip("0123456789")
        lines.append(f"{role.role:<9}padding {role.shares.get('padding_share', 0.0):>4.0%}   repeated prefixes "
                     f"{role.shares.get('prefix_share', 0.0):>4.0%}   ({kind}.packing: "
                     f"{profile.packing.get(kind, 'none')})")
    return lines


def status_table(run_dir: str):
    """A rich renderable of the run as its files show it now (`tether status`)."""
    from rich.console import Group
    from rich.table import Table

    metrics = _role_metrics(run_dir)
    learner = metrics.get("learner", [])
    config_path = os.path.join(run_dir, "config.yaml")
    total = "?"
    if os.path.exists(config_path):
        import yaml

        with open(config_path) as file:
            total = yaml.safe_load(file).get("learner", {}).get("total_steps", "?")
    summary = Table(title=f"tether {os.path.abspath(run_dir)}", show_header=False)
    last = learner[-1] if learner else {}
    summary.add_row("policy version", f"{last.get('step', 0)} of {total}")
    for key in ("reward", "gold_reward", "kl", "response_length", "entropy", "clipfrac", "staleness"):
        if last.get(key) is not None:
            summary.add_row(key, f"{last[key]:.4g}")
    buffer = metrics.get("buffer", [])
    if buffer:
        b = buffer[-1]
        summary.add_row("buffer", f"{b['unscored']} unscored, {b['in_scoring']} scoring, "
                                  f"{b['scored_waiting']} ready; {b['trained']} trained of {b['generated']} generated")
    roles = Table(title="roles")
    for column in ("role", "records", "busy", "tokens/s"):
        roles.add_column(column)
    try:
        profile = profile_run(run_dir)
        for role in profile.roles:
            roles.add_row(role.role, str(len(metrics.get(role.role, []))), f"{role.busy_fraction:.0%}",
                          f"{role.tokens_per_s:,.0f}" if role.tokens_per_s else "")
    except FileNotFoundError:
        pass
    alerts = Table(title="recent alerts")
    alerts.add_column("step")
    alerts.add_column("alerts")
    for record in [r for r in learner if r.get("alerts")][-5:]:
        alerts.add_row(str(record["step"]), ", ".join(record["alerts"]))
    accounting = os.path.join(run_dir, "metrics", "buffer_accounting.json")
    parts = [summary, roles, alerts]
    if os.path.exists(accounting):
        with open(accounting) as file:
            report = json.load(file)
        parts.append(f"finished: generated {report['generated']} = trained {report['trained']} + dropped "
                     f"{sum(report['dropped'].values())} + in flight {report['in_flight']}")
    return Group(*parts)
