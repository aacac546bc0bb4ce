"""Soak: the demo pipeline for a long while, RSS of every role at the start and at the end.

Starts `tether run` on the demo's config and assets (`make demo` builds them) with more steps
than it can finish, reads each role's resident memory (its whole process group: vLLM's engine
process counts to the rollout) once the first learner step is done and again after --minutes,
then stops the run with Ctrl-C. Goal: every role grows by less than 10%, and the liveness counters
(heartbeats missed, buffer restarts seen, optimizer steps skipped, records naming a stalled role)
stay at 0 on this healthy run. With --warmup-minutes
it also reports growth from a second sample taken after the warm-up: vLLM's KV cache becomes
resident page by page as it is first used, which shows as early growth that levels off.

    python bench/soak.py --minutes 30 [--warmup-minutes 2] [--breakdown-every 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

GOAL_GROWTH = 0.10
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def group_processes(pgid: int) -> list[dict]:
    """Every process of a process group with its resident memory in MiB, split as
    /proc/PID/status splits it: anonymous, file-backed and shared-memory pages."""
    processes = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as file:
                fields = file.read().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # field 5 of stat: the process group
                continue
            with open(f"/proc/{pid}/status") as file:
                status = dict(line.split(":", 1) for line in file if ":" in line)
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        kib = {key: int(status.get(key, "0 kB").split()[0]) for key in ("VmRSS", "RssAnon", "RssFile", "RssShmem")}
        processes.append({"pid": int(pid), "name": status["Name"].strip(), **{k: v / 1024 for k, v in kib.items()}})
    return processes


def group_rss_mb(pgid: int) -> float:
    return sum(process["VmRSS"] for process in group_processes(pgid))


def print_breakdown(minute: float, pids: dict[str, int]) -> None:
    for role, pgid in pids.items():
        parts = ", ".join(f"{p['name']}[{p['pid']}] anon {p['RssAnon']:.0f} file {p['RssFile']:.0f} "
                          f"shm {p['RssShmem']:.0f}" for p in group_processes(pgid))
        print(f"  {minute:6.1f} min {role:<8} {parts}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--assets", default=os.path.join(REPO, ".demo", "assets"))
    parser.add_argument("--run-dir", default=os.path.join(REPO, "runs", "soak"))
    parser.add_argument("--warmup-minutes", type=float, default=0.0)
    parser.add_argument("--breakdown-every", type=float, default=0.0,
                        help="minutes between lines of per-process memory (anonymous / file / shared)")
    args = parser.parse_args()
    import shutil

    shutil.rmtree(args.run_dir, ignore_errors=True)  # no pids or metrics of an earlier soak

    command = [sys.executable, "-m", "launch.cli", "run", "--config", os.path.join(REPO, "configs", "demo.yaml"),
               "--overwrite", "-o", f"run_dir={args.run_dir}", "-o", "learner.total_steps=1000000",
               "-o", f"models.policy={args.assets}/sft", "-o", f"models.reward={args.assets}/rm",
               "-o", f"data.prompts={args.assets}/prompts.jsonl", "-o", "learner.checkpoint_every=0"]
    run = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    learner_metrics = os.path.join(args.run_dir, "metrics", "learner.jsonl")
    while not (os.path.exists(learner_metrics) and os.path.getsize(learner_metrics) > 0):
        if run.poll() is not None:
            sys.exit(f"the run ended before its first step:\n{run.stderr.read()[-3000:]}")
        time.sleep(1)
    with open(os.path.join(args.run_dir, "pids.json")) as file:
        pids = json.load(file)
    start = {role: group_rss_mb(pid) for role, pid in pids.items()}
    if not all(start.values()):
        sys.exit(f"could not read the memory of every role: {start}")
    started = time.monotonic()
    warm = None
    next_breakdown = 0.0
    while time.monotonic() - started < args.minutes * 60:
        if args.breakdown_every and time.monotonic() - started >= next_breakdown * 60:
            print_breakdown((time.monotonic() - started) / 60, pids)
            next_breakdown += args.breakdown_every
        if run.poll() is not None:
            sys.exit(f"the run ended early:\n{run.stderr.read()[-3000:]}")
        if warm is None and args.warmup_minutes and time.monotonic() - started >= args.warmup_minutes * 60:
            warm = {role: group_rss_mb(pid) for role, pid in pids.items()}
        time.sleep(5)
    with open(os.path.join(args.run_dir, "pids.json")) as file:
        restarted = json.load(file) != pids
    end = {role: group_rss_mb(pid) for role, pid in pids.items()}
    with open(learner_metrics) as file:
        steps = sum(1 for _ in file)
    run.send_signal(signal.SIGINT)
    run.wait(timeout=120)

    print(f"soak: {args.minutes:g} minutes of the demo pipeline, {steps} learner steps"
          f"{' (a role was restarted: figures are not comparable)' if restarted else ''}")
    header = f"  {'role':<10}{'start MiB':>11}{'end MiB':>10}{'growth':>9}"
    if warm:
        header += f"{f'after {args.warmup_minutes:g} min':>16}{'growth since':>14}"
    print(header)
    worst = worst_warm = 0.0
    for role in pids:
        growth = (end[role] - start[role]) / start[role]
        worst = max(worst, growth)
        line = f"  {role:<10}{start[role]:>11.0f}{end[role]:>10.0f}{growth:>+9.1%}"
        if warm:
            warm_growth = (end[role] - warm[role]) / warm[role]
            worst_warm = max(worst_warm, warm_growth)
            line += f"{warm[role]:>16.0f}{warm_growth:>+14.1%}"
        print(line)
    print(f"  worst growth from the first step {worst:+.1%}; goal < {GOAL_GROWTH:.0%}: "
          f"{'met' if worst < GOAL_GROWTH else 'NOT met'}")
    if warm:
        print(f"  worst growth after the warm-up {worst_warm:+.1%}")
    counters = liveness_counters(args.run_dir)
    print("  liveness: " + ", ".join(f"{name} {value}" for name, value in counters.items())
          + f"; goal 0 each: {'met' if not any(counters.values()) else 'NOT met'}")


def liveness_counters(run_dir: str) -> dict[str, int]:
    """Over every role's metrics: heartbeats missed and buffer restarts seen (the roles' clients),
    optimizer steps skipped for non-finite gradients, and buffer records that name a stalled role."""
    from common.runlog import read_metrics

    totals = {"heartbeats_missed": 0, "buffer_restarts": 0, "skipped_steps": 0, "stalled_records": 0}
    names = [name[:-len(".jsonl")] for name in os.listdir(os.path.join(run_dir, "metrics")) if name.endswith(".jsonl")]
    for name in names:
        records = read_metrics(run_dir, name)
        for key in ("heartbeats_missed", "buffer_restarts"):  # running counts: the last record has the total
            totals[key] += max((record.get(key, 0) for record in records), default=0)
        totals["skipped_steps"] += sum(record.get("skipped_steps", 0) for record in records)
        totals["stalled_records"] += sum(bool(record.get("stalled")) for record in records)
    return totals


if __name__ == "__main__":
    main()
