"""`tether run --ray` against the local `tether run`: the demo's start-up (to its first trained
step, and the whole run) and its steady-state trained tokens/s, side by side on this machine.

The Ray variant runs on a cluster of this machine made by the bench (one node, this machine's
CPUs, bound to loopback), started before the rounds: as on a real cluster, Ray is up before the
run. Both variants run the demo's config (configs/demo.yaml); the local one pins roles to cores
(``placement.cores``), the Ray one asks Ray for CPUs (a share each, as tests/test_ray.py does) and
lets the OS place them. Rounds alternate the order (this machine's speed drifts).

Trained tokens/s: prompt + response tokens of the batches the learner trained after its first
step, over the time from its first step to its last. The limit compared with is the local run's:
Ray's placement should cost start-up seconds, not throughput.

    python bench/on_ray.py [--rounds 2] [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # tests/test_ray.py says why
RAY_CPUS = "placement.ray.cpus={buffer: 0.1, rollout: 0.3, scorer: 0.3, learner: 0.3}"
PROMPT_TOKENS = 6  # <bos> parity d d d ":": every demo prompt


def figures(result: dict, batch_size: int) -> dict:
    steps = result["steps"]
    trained = sum(batch_size * (PROMPT_TOKENS + step["response_length"]) for step in steps[1:])
    return {"first_step_s": result["first_step_s"], "run_s": result["run_s"],
            "tokens_per_s": trained / (steps[-1]["time"] - steps[0]["time"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    os.environ.update(LOOPBACK_ONLY)
    from ray.cluster_utils import Cluster

    from common.config import load_config
    from demos.parity import build_assets
    from startup import median, run_once

    assets = os.path.join(REPO, ".demo", "assets")
    build_assets(assets, log=lambda *_: None)  # cached after the first time
    config_path = os.path.join(REPO, "configs", "demo.yaml")
    overrides = [f"learner.total_steps={args.steps}"]
    batch_size = load_config(config_path, overrides).learner.batch_size
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": os.cpu_count(), "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False})
    work = tempfile.mkdtemp(prefix="tether-bench-ray-")
    variants = [("local", overrides, ()), ("ray", overrides + [RAY_CPUS], ("--ray-address", cluster.address))]
    results: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    try:
        for round_index in range(args.rounds):
            for name, variant, arguments in variants if round_index % 2 == 0 else reversed(variants):
                result = figures(run_once(REPO, assets, os.path.join(work, name), variant, config_path, arguments,
                                          LOOPBACK_ONLY), batch_size)
                results[name].append(result)
                print(f"round {round_index + 1} {name:<6} first trained step {result['first_step_s']:5.1f}s, whole run "
                      f"{result['run_s']:5.1f}s, trained tokens/s {result['tokens_per_s']:6.0f}", flush=True)
    finally:
        cluster.shutdown()

    print(f"\nmedian over {args.rounds} rounds, {args.steps} steps of {batch_size} samples:")
    for name, _, _ in variants:
        print(f"  {name:<6} first trained step {median(results, name, 'first_step_s'):5.1f}s, whole run "
              f"{median(results, name, 'run_s'):5.1f}s, trained tokens/s {median(results, name, 'tokens_per_s'):6.0f}")
    ratio = median(results, "ray", "tokens_per_s") / median(results, "local", "tokens_per_s")
    print(f"steady trained tokens/s, ray / local: {ratio:.0%} (limit: >= 90% of the local run's)")
    later = median(results, "ray", "first_step_s") - median(results, "local", "first_step_s")
    print(f"start-up, ray - local: {later:+.1f}s to the first trained step")


if __name__ == "__main__":
    main()
