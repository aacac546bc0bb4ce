"""Streaming generation on long-tailed responses: end-to-end trained tokens/s of `tether run` on
the long-tail demo (configs/demo-long-tail.yaml: responses of 4 to 64 tokens, most short), and
how much of the time it holds credits the rollout's engine spends generating.

Variants take turns in one process, round after round (this machine's speed drifts):

- ``streaming``: this checkout (the streaming rollout: prompts join vLLM's engine between its
  steps, each finished sample is sent at once);
- ``--baseline DIR``: another checkout run the same way, for a before/after: a git worktree of
  661460c, the last commit with the chunked rollout (one blocking ``LLM.generate`` per grant of
  credits). It is given the same config less the keys it does not know
  (``learner.max_tokens_per_microbatch``).

Figures, from the runs' metrics:

- trained tokens/s: prompt + response tokens of the batches the learner trained after its first
  step, over the time from its first step to its last (the steady state; start-up is
  bench/startup.py's); trained samples/s beside it, since the variants' policies drift to
  different response lengths. The baseline also has the learner of its day (fixed micro-batches):
  the config makes generation, not the learner, bound the pipeline, so the difference is the
  rollout's. Unless ``--learn``, the actor's learning rate is 1e-12: every step is trained and
  published as usual, and both variants generate the SFT policy's lengths all run long;
- engine generating: the rollout's time inside vLLM's engine (``busy_s``) over its time with
  work in hand (``iteration_s - waiting_s``: everything but waiting for credits with nothing to
  generate), beside the shares of weight loads and sending; and the mean number of requests in
  the engine per step (of ``rollout.prompts_per_generate``). Goal >= 95% for the streaming rollout.

``--hidden``/``--layers`` build the task's models at another size (the demo's is 64 x 2), and
``-o KEY=VALUE`` changes the config of every variant (a larger ``learner.batch_size`` gives each
published version more generation to share its weight load with; ``placement.cores.buffer=[1]``
takes the buffer off the rollout's core).

    python bench/streaming.py [--rounds 2] [--steps 30] [--learn] [--baseline /tmp/tether-chunked]
                              [--hidden 64 --layers 2] [-o KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import yaml

GOAL = 0.95
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The policy is held at the SFT model's response lengths: a learning policy drifts to other lengths,
# differently in every run, and a run that writes shorter responses generates faster.
FROZEN_LR = 1e-12
UNKNOWN_TO_BASELINE = [("learner", "max_tokens_per_microbatch")]


def figures(result: dict, batch_size: int, prompt_tokens: int) -> dict:
    steps, rollout = result["steps"], result["rollout"]
    seconds = steps[-1]["time"] - steps[0]["time"]
    trained = sum(batch_size * (prompt_tokens + step["response_length"]) for step in steps[1:])
    in_hand = sum(record["iteration_s"] - record["waiting_s"] for record in rollout)
    share = {key: sum(record[key] for record in rollout) / in_hand for key in ("busy_s", "weight_sync_s", "send_s")}
    stepped = [record for record in rollout if "engine_steps" in record]  # the chunked rollout counts none
    return {"tokens_per_s": trained / seconds, "samples_per_s": batch_size * (len(steps) - 1) / seconds,
            "response_length": sum(step["response_length"] for step in steps) / len(steps),
            "generating": share["busy_s"], "weight_sync": share["weight_sync_s"], "sending": share["send_s"],
            "requests_per_step": sum(r["requests_per_step"] * r["engine_steps"] for r in stepped)
            / max(1, sum(r["engine_steps"] for r in stepped)) if stepped else float("nan"),
            "run_s": result["run_s"]}


def main() -> None:
    from common.config import load_config
    from demos.parity import DEMO_HIDDEN, DEMO_LAYERS, build_assets
    from startup import median, run_once

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="learner.total_steps of each run")
    parser.add_argument("--learn", action="store_true",
                        help=f"train the policy at the config's actor_lr (default: {FROZEN_LR}, held at SFT)")
    parser.add_argument("--baseline", help="another tether checkout (the chunked rollout) to run the same way")
    parser.add_argument("--hidden", type=int, default=DEMO_HIDDEN, help="the models' hidden size (default: the demo's)")
    parser.add_argument("--layers", type=int, default=DEMO_LAYERS, help="the models' layers (default: the demo's)")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every variant, as `tether run -o`")
    args = parser.parse_args()

    size = "" if (args.hidden, args.layers) == (DEMO_HIDDEN, DEMO_LAYERS) else f"-{args.hidden}x{args.layers}"
    assets = os.path.join(REPO, ".demo", f"assets-long-tail{size}")
    print(f"models: Llama, hidden {args.hidden}, {args.layers} layers ({assets})", flush=True)
    # cached after the first time; building 256 x 4 took 20 minutes here, so its progress is shown
    build_assets(assets, long_tail=True, hidden=args.hidden, layers=args.layers,
                 log=lambda line: print(line, flush=True))
    work = tempfile.mkdtemp(prefix="tether-bench-streaming-")
    config_path = os.path.join(REPO, "configs", "demo-long-tail.yaml")
    with open(config_path) as file:
        config = yaml.safe_load(file)
    overrides = [f"learner.total_steps={args.steps}"] + ([] if args.learn else [f"learner.actor_lr={FROZEN_LR}"])
    overrides += args.override
    batch_size = load_config(config_path, overrides).learner.batch_size
    variants = [("streaming", REPO, config_path)]
    if args.baseline:
        older = {section: dict(values) if isinstance(values, dict) else values for section, values in config.items()}
        for section, key in UNKNOWN_TO_BASELINE:
            older[section].pop(key, None)
        older_path = os.path.join(work, "baseline.yaml")
        with open(older_path, "w") as file:
            yaml.safe_dump(older, file)
        variants.append(("chunked (baseline)", os.path.abspath(args.baseline), older_path))
    prompt_tokens = 6  # <bos> parity d d d ":": every demo prompt
    results: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    for round_index in range(args.rounds):
        for name, repo, path in variants if round_index % 2 == 0 else reversed(variants):
            result = figures(run_once(repo, assets, os.path.join(work, name.split()[0]), overrides, path),
                             batch_size, prompt_tokens)
            results[name].append(result)
            print(f"round {round_index + 1} {name:<20} trained tokens/s {result['tokens_per_s']:6.0f} "
                  f"(samples/s {result['samples_per_s']:5.1f}, mean response {result['response_length']:4.1f} tokens); "
                  f"engine generating {result['generating']:6.1%} of its time with work in hand (weight loads "
                  f"{result['weight_sync']:.1%}, sending {result['sending']:.1%}), {result['requests_per_step']:.1f} "
                  f"requests per engine step; whole run {result['run_s']:.1f}s", flush=True)

    print(f"\nmedian over {args.rounds} rounds, {args.steps} steps of {batch_size} samples each:")
    for name, _, _ in variants:
        print(f"  {name:<20} trained tokens/s {median(results, name, 'tokens_per_s'):6.0f}, samples/s "
              f"{median(results, name, 'samples_per_s'):5.1f}, engine generating {median(results, name, 'generating'):6.1%}")
    generating = median(results, "streaming", "generating")
    print(f"streaming engine generating while it holds work: {generating:.1%} (goal >= {GOAL:.0%}): "
          f"{'met' if generating >= GOAL else 'NOT met'}")
    if args.baseline:
        for key, what in (("tokens_per_s", "trained tokens/s"), ("samples_per_s", "trained samples/s")):
            factor = median(results, "streaming", key) / median(results, "chunked (baseline)", key)
            print(f"end-to-end {what}, streaming / chunked: {factor:.2f}x")


if __name__ == "__main__":
    main()
