"""What `learner.record_batches` costs: disk per 1,000 samples, and the learner's time to write a
batch against its step time, on the demo (40 steps, batch 64), with the recording on and off in
turns, round after round (this machine's speed drifts). Then `tether replay` of the last recorded
run: its largest difference from the run (0 expected on the CPU) and its wall time.

The limits printed: the write at most 2% of the learner's median step, and the recorded run's
steady trained tokens/s at least 95% of the unrecorded run's.

    python bench/record_batches.py [--rounds 2] [--steps 40]
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import tempfile
import time

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
WRITE_SHARE_LIMIT = 0.02
THROUGHPUT_LIMIT = 0.95


def steady_tokens_per_s(steps: list[dict]) -> float:
    """Trained tokens per second from the first step's end to the last's."""
    return sum(s["response_tokens"] for s in steps[1:]) / (steps[-1]["time"] - steps[0]["time"])


def main() -> None:
    from demos.parity import build_assets
    from learner.replay import BatchRecorder, read_batch
    from startup import median, run_once

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    assets = os.path.join(REPO, ".demo", "assets")
    build_assets(assets, log=lambda *_: None)
    work = tempfile.mkdtemp(prefix="tether-bench-record-")
    variants = [("off", ["learner.record_batches=false"]), ("recorded", ["learner.record_batches=true"])]
    results: dict[str, list[dict]] = {name: [] for name, _ in variants}
    for round_index in range(args.rounds):
        for name, overrides in (variants if round_index % 2 == 0 else variants[::-1]):
            run_dir = os.path.join(work, name)
            result = run_once(REPO, assets, run_dir, [f"learner.total_steps={args.steps}", *overrides])
            steps = result["steps"]
            figures = {"tokens_per_s": steady_tokens_per_s(steps),
                       "step_s": statistics.median(s["iteration_s"] for s in steps[1:])}
            if name == "recorded":
                files = glob.glob(os.path.join(run_dir, "batches", "batch-*.frames"))
                with open(os.path.join(run_dir, "config.yaml")) as file:
                    samples = yaml.safe_load(file)["learner"]["batch_size"] * len(steps)
                figures["mb_per_1000_samples"] = sum(os.path.getsize(f) for f in files) / samples * 1000 / 1e6
                recorder, writes = BatchRecorder(os.path.join(work, "rewrite")), []
                for version in range(len(steps)):  # the learner's write, timed on the batches it wrote
                    batch = read_batch(os.path.join(run_dir, "batches"), version, 1 << 30)
                    started = time.perf_counter()
                    recorder.write(version, batch)
                    writes.append(time.perf_counter() - started)
                figures["write_s"] = statistics.median(writes)
            results[name].append(figures)
            print(f"round {round_index + 1} {name:<9} trained tokens/s {figures['tokens_per_s']:7.0f}, median step "
                  f"{1000 * figures['step_s']:.1f} ms" + (f", batch write {1000 * figures['write_s']:.2f} ms, "
                                                           f"{figures['mb_per_1000_samples']:.2f} MB per 1,000 samples"
                                                           if name == "recorded" else ""), flush=True)
    share = median(results, "recorded", "write_s") / median(results, "recorded", "step_s")
    ratio = median(results, "recorded", "tokens_per_s") / median(results, "off", "tokens_per_s")
    print(f"median: write {share:.2%} of a learner step (limit <= {WRITE_SHARE_LIMIT:.0%}); trained tokens/s recorded "
          f"/ off {ratio:.1%} (limit >= {THROUGHPUT_LIMIT:.0%}); "
          f"{median(results, 'recorded', 'mb_per_1000_samples'):.2f} MB per 1,000 samples")
    started = time.monotonic()
    replay = subprocess.run([sys.executable, "-m", "launch.cli", "replay", os.path.join(work, "recorded"), "--out",
                             os.path.join(work, "replay")], cwd=REPO, capture_output=True, text=True)
    lines = replay.stdout.strip().splitlines() or ["(no output)"]
    print(f"tether replay ({time.monotonic() - started:.1f} s, exit {replay.returncode}): {lines[-1]}")


if __name__ == "__main__":
    main()
