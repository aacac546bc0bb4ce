"""The off-policy kit on the demo (issue 35), side by side in one process.

``--part corrections``: the stress setting (the demo at ``learner.actor_lr`` 2e-3), where a fixed
k = 8 with the plain truncated weight lost gold in one round of three (docs/benchmarks.md): held-out
gold and KL to the reference after training at k = 8 with each correction, against k = 0, medians
over the rounds. ``--part filter``: GRPO (4 responses a prompt, the gold rule as the only reward)
with and without ``buffer.filter_groups``: the wall time and the samples generated until the
policy's fresh samples reach gold 0.95 (the scorer's mean of the reward function over what it
scored, a rolling window of ``WINDOW`` samples: unbiased by what the filter drops), and its
held-out gold at the end.

Each variant is one `tether run` per round, the variants taking turns within a round (this
machine's drift falls on all of them).

    python bench/off_policy.py --part corrections [--rounds 3] [--steps 40]
    python bench/off_policy.py --part filter [--rounds 3] [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
GOLD_TARGET, WINDOW = 0.95, 256
GOLD = "demos.parity:gold_reward"

CORRECTIONS = [
    ("k=0 truncate", ["buffer.max_staleness=0"]),
    ("k=8 truncate", ["buffer.max_staleness=8"]),
    ("k=8 mask token", ["buffer.max_staleness=8", "learner.behavior_correction=mask",
                        "learner.behavior_weight_floor=0.5"]),
    ("k=8 mask sequence", ["buffer.max_staleness=8", "learner.behavior_correction=mask",
                           "learner.behavior_correction_level=sequence", "learner.behavior_weight_floor=0.5"]),
    ("k=8 gspo", ["buffer.max_staleness=8", "learner.ratio_level=sequence", "learner.clip_eps=3e-4",
                  "learner.clip_eps_high=4e-4", "learner.loss_aggregation=seq-mean-token-mean"]),
    ("k=8 cispo", ["buffer.max_staleness=8", "learner.policy_loss=cispo", "learner.clip_eps_high=0.28"]),
]
GRPO = ["learner.advantage_estimator=grpo", "rollout.samples_per_prompt=4", "learner.kl_in=loss",
        "models.reward=null", f"scorer.reward_functions=[{{function: '{GOLD}', weight: 1.0}}]"]


def first_reaching(scorer: list[dict], started: float) -> tuple[float, int] | None:
    """(seconds since the start, samples scored) when the mean of the reward function over the
    last ``WINDOW`` scored samples first reaches the target; None if it never does."""
    window: list[tuple[int, float]] = []
    for record in scorer:
        if GOLD not in record:
            continue
        window.append((record["scored"], record[GOLD]))
        while sum(n for n, _ in window[1:]) >= WINDOW:
            window.pop(0)
        count = sum(n for n, _ in window)
        if count >= WINDOW and sum(n * g for n, g in window) / count >= GOLD_TARGET:
            return record["time"] - started, record["scored_total"]
    return None


def main() -> None:
    from common.runlog import read_metrics
    from demos.parity import build_assets, held_out_figures
    from startup import run_once

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["corrections", "filter"], required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--stress-lr", type=float, default=2e-3)
    args = parser.parse_args()
    assets = os.path.join(REPO, ".demo", "assets")
    paths = build_assets(assets, log=lambda *_: None)
    work = tempfile.mkdtemp(prefix="tether-bench-off-policy-")
    common = [f"learner.total_steps={args.steps}"]
    if args.part == "corrections":
        variants = [(name, [*common, f"learner.actor_lr={args.stress_lr}", *overrides])
                    for name, overrides in CORRECTIONS]
    else:
        variants = [("grpo", [*common, *GRPO]), ("grpo + filter_groups", [*common, *GRPO, "buffer.filter_groups=true"])]
    rounds: dict[str, list[dict]] = {name: [] for name, _ in variants}
    for round_ in range(args.rounds):
        for name, overrides in (variants if round_ % 2 == 0 else variants[::-1]):
            run_dir = os.path.join(work, f"{name.replace(' ', '_')}-{round_}")
            result = run_once(REPO, assets, run_dir, overrides)
            held = held_out_figures(os.path.join(run_dir, "checkpoints", "final"), paths["policy"], paths["reward"],
                                    paths["eval_prompts"], 8)
            run = {"gold": held["gold_reward"], "kl": held["kl_to_reference"], "run_s": result["run_s"]}
            line = f"{name:<22} round {round_}: held-out gold {run['gold']:.3f}  KL {run['kl']:.2f}"
            if args.part == "filter":
                started = result["steps"][0]["time"] - result["first_step_s"]  # the command's start
                reached = first_reaching(read_metrics(run_dir, "scorer0"), started)
                buffer = read_metrics(run_dir, "buffer")
                run.update(reached_s=reached[0] if reached else float("nan"),
                           reached_samples=reached[1] if reached else float("nan"),
                           filtered=buffer[-1].get("groups_filtered", 0) if buffer else 0)
                line += (f"  gold {GOLD_TARGET} of fresh samples at {run['reached_s']:.1f}s after "
                         f"{run['reached_samples']} samples; {run['filtered']} groups filtered; "
                         f"run {run['run_s']:.1f}s")
            rounds[name].append(run)
            print(line, flush=True)
    print(f"\nmedians over {args.rounds} rounds of {args.steps} steps:")
    for name, runs in rounds.items():
        medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        figures = "  ".join(f"{key} {value:.3f}" if isinstance(value, float) else f"{key} {value}"
                            for key, value in medians.items())
        by_round = ", ".join(f"{run['gold']:.3f}" for run in runs)
        print(f"  {name:<22} {figures}   (gold by round: {by_round})")


if __name__ == "__main__":
    main()
