"""buffer.max_staleness: auto against the fixed-k sweep: steady trained tokens/s and held-out gold
after training, on the demo and on the long-tail demo, and in a stress case where a high k hurts
(the demo at a raised actor learning rate), side by side in one process.

Each variant is one `tether run` of the config's steps per round, the variants taking turns within
a round (this machine's drift falls on all of them); a figure is the median over the rounds. Gold
is `demos.parity.held_out_figures`'s on the held-out prompts (the same seed for every policy). Trained tokens/s: the learner's trained
response tokens from its first step's end to its last, over that time.

The limits printed, per task: auto's tokens/s at least 90% of the best fixed k's, and its gold at
least k = 0's minus 0.01; in the stress case, auto's gold at least the safe k's (0) minus 0.01,
with the gold k = 8 loses there printed beside it.

    python bench/auto_staleness.py [--steps 40] [--rounds 3] [--ks 0,1,3,8] [--stress-lr 2e-3]
                                   [--task demo --task long-tail --task stress]
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
TOKENS_LIMIT, GOLD_SLACK = 0.90, 0.01
AUTO = ["buffer.max_staleness=auto", "buffer.auto_staleness.min=0", "buffer.auto_staleness.max=8"]


def steady_tokens_per_s(steps: list[dict]) -> float:
    return sum(s["response_tokens"] for s in steps[1:]) / (steps[-1]["time"] - steps[0]["time"])


def second_half_tokens_per_s(steps: list[dict]) -> float:
    """The same over the run's second half: what the rollouts generated ahead while the learner
    started (up to k + 1 batches, a large share of a short run at a high fixed k) is spent by then."""
    return steady_tokens_per_s(steps[len(steps) // 2 - 1:])


def main() -> None:
    from demos.parity import build_assets, held_out_figures
    from startup import run_once

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each variant, taking turns")
    parser.add_argument("--ks", default="0,1,3,8", help="the fixed bounds to compare with (k = 0 always runs)")
    parser.add_argument("--stress-lr", type=float, default=2e-3, help="the stress case's learner.actor_lr")
    parser.add_argument("--task", action="append", choices=["demo", "long-tail", "stress"])
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="tether-bench-auto-")
    ks = [int(k) for k in args.ks.split(",")]
    for task in args.task or ["demo", "long-tail", "stress"]:
        long_tail = task == "long-tail"
        assets = os.path.join(REPO, ".demo", "assets-long-tail" if long_tail else "assets")
        paths = build_assets(assets, long_tail=long_tail, log=lambda *_: None)
        config = os.path.join(REPO, "configs", "demo-long-tail.yaml" if long_tail else "demo.yaml")
        common = [f"learner.total_steps={args.steps}"]
        if task == "stress":
            common.append(f"learner.actor_lr={args.stress_lr}")
        max_new_tokens = 64 if long_tail else 8
        variants = [(f"k={k}", [f"buffer.max_staleness={k}"])
                    for k in ([0, max(ks)] if task == "stress" else sorted({0, *ks}))]
        variants.append(("auto", AUTO))
        rounds = {name: [] for name, _ in variants}
        for round_ in range(args.rounds):
            for name, overrides in variants:
                run_dir = os.path.join(work, f"{task}-{name}-{round_}")
                steps = run_once(REPO, assets, run_dir, [*common, *overrides], config=config)["steps"]
                gold = held_out_figures(os.path.join(run_dir, "checkpoints", "final"), paths["policy"], paths["reward"],
                                paths["eval_prompts"], max_new_tokens)["gold_reward"]
                run = {"tokens_per_s": steady_tokens_per_s(steps), "late_tokens_per_s": second_half_tokens_per_s(steps),
                       "gold": gold,
                       "staleness": sum(s["staleness"] for s in steps) / len(steps)}
                rounds[name].append(run)
                trace = ",".join(str(s["max_staleness"]) for s in steps) if name == "auto" else ""
                print(f"{task:<10}{name:<6} round {round_} trained tokens/s {run['tokens_per_s']:7.0f} (second half "
                      f"{run['late_tokens_per_s']:.0f})  held-out gold "
                      f"{gold:.3f}  mean staleness {run['staleness']:.2f}" + (f"  k by step: {trace}" if trace else ""),
                      flush=True)
                for change in (s["staleness_change"] for s in steps if "staleness_change" in s):
                    print(f"{task:<10}{name:<6} round {round_} change: {change}")
        results = {name: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
                   for name, runs in rounds.items()}
        for name, result in results.items():
            print(f"{task:<10}{name:<6} median of {args.rounds}: trained tokens/s {result['tokens_per_s']:7.0f} (second "
                  f"half {result['late_tokens_per_s']:.0f})  "
                  f"held-out gold {result['gold']:.3f}  mean staleness {result['staleness']:.2f}")
        auto, safe = results["auto"], results["k=0"]
        if task == "stress":
            high = results[f"k={max(ks)}"]
            print(f"{task:<10}k={max(ks)} loses {safe['gold'] - high['gold']:+.3f} gold to k=0 (the case is a stress "
                  f"case when this is above {GOLD_SLACK})")
        best = max((r for n, r in results.items() if n != "auto"), key=lambda r: r["tokens_per_s"])
        tokens_ok = auto["tokens_per_s"] >= TOKENS_LIMIT * best["tokens_per_s"]
        gold_ok = auto["gold"] >= safe["gold"] - GOLD_SLACK
        late = max(r["late_tokens_per_s"] for n, r in results.items() if n != "auto")
        print(f"{task:<10}auto / best fixed, second half: {auto['late_tokens_per_s'] / late:.1%}")
        print(f"{task:<10}auto / best fixed tokens/s {auto['tokens_per_s'] / best['tokens_per_s']:.1%} (limit >= "
              f"{TOKENS_LIMIT:.0%}{', not a goal under stress' if task == 'stress' else ''}); gold {auto['gold']:.3f} "
              f"vs k=0 {safe['gold']:.3f} (limit >= k=0 - {GOLD_SLACK}): "
              f"{'ok' if gold_ok and (tokens_ok or task == 'stress') else 'OVER'}", flush=True)


if __name__ == "__main__":
    main()
