"""Scaling out: trained tokens/s with 1 -> 2 rollout engines on a rollout-bound config and 1 -> 2
learner ranks on a learner-bound config, each next to its ideal (twice the one-process figure)
measured in the same run. On this 2-core machine the second process gets the second core, which
the other roles (scorer, learner or rollout, buffer) also use: the report accounts for where the
rest goes from each role's measured busy time.

Every trial is a real `tether run` (vLLM, DeepSpeed, ZeroMQ); figures are steady state, from the
runs' profiles (each role's start-up left out).

    python bench/scaling.py [--steps 15] [--out runs/scaling]
"""

from __future__ import annotations

import argparse
import os
import sys

GOAL = 0.85

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_learner_bound_models(directory: str) -> dict[str, str]:
    """A random Llama large enough that training, not the step's fixed costs, is its time, and a
    reward model of the same shape: throughput only, nothing is meant to be learned."""
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from launch.demo import build_tokenizer, tiny_llama_config

    torch.manual_seed(0)
    config = tiny_llama_config(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=4, max_position_embeddings=128)
    paths = {"policy": os.path.join(directory, "policy"), "reward": os.path.join(directory, "rm")}
    for path, model in ((paths["policy"], LlamaForCausalLM(config)),
                        (paths["reward"], LlamaForSequenceClassification(config.__class__(**config.to_dict(),
                                                                                           num_labels=1)))):
        build_tokenizer(path)
        model.save_pretrained(path)
    return paths


def trial(name: str, base: dict, overrides: list[str], out: str) -> dict:
    from launch.report import profile_run
    from launch.runner import run_pipeline
    from protocol.config import load_config

    run_dir = os.path.join(out, name)
    config = load_config(None, [f"run_dir={run_dir}", *overrides], base=base)
    print(f"  {name}: tether run ...", flush=True)
    if run_pipeline(config, overwrite=True) != 0:
        raise SystemExit(f"trial {name} failed; see {run_dir}/logs")
    profile = profile_run(run_dir)
    busy = {role.role: role.busy_fraction for role in profile.roles}
    return {"tokens_per_s": profile.pipeline_tokens_per_s, "busy": busy, "bottleneck": profile.bottleneck}


def report(title: str, one: dict, two: dict, shared_core_roles: list[str]) -> None:
    ideal = 2 * one["tokens_per_s"]
    ratio = two["tokens_per_s"] / ideal
    print(f"\n{title}")
    print(f"  1 process   {one['tokens_per_s']:9,.0f} trained tokens/s  (bottleneck {one['bottleneck']})")
    print(f"  2 processes {two['tokens_per_s']:9,.0f} trained tokens/s  = {ratio:.0%} of the ideal {ideal:,.0f} "
          f"(goal >= {GOAL:.0%}: {'met' if ratio >= GOAL else 'not met'})")
    for label, result in (("1 process", one), ("2 processes", two)):
        shares = ", ".join(f"{role} {share:.0%}" for role, share in sorted(result["busy"].items()))
        print(f"  busy share of wall time, {label}: {shares}")
    others = sum(two["busy"].get(role, 0.0) for role in shared_core_roles)
    print(f"  on the second core the 2-process run also ran {', '.join(shared_core_roles)}: "
          f"{others:.0%} of a core busy between them")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", default="runs/scaling")
    args = parser.parse_args()

    from launch.demo import build_assets

    assets_dir = os.path.join(args.out, "assets")
    demo = build_assets(os.path.join(assets_dir, "demo"), sft_steps=60, rm_prompts=32, rm_epochs=1, log=lambda *_: None)
    big = build_learner_bound_models(os.path.join(assets_dir, "learner-bound"))
    common = {"seed": 0, "data": {"prompts": demo["prompts"]}, "buffer": {"max_staleness": 1},
              "learner": {"total_steps": args.steps}, "transport": {"connect_retries": 120}}

    print("rollout-bound: the demo's models, 48-token responses (ignore_eos), one PPO epoch", flush=True)
    rollout_bound = {**common, "models": {"policy": demo["policy"], "reward": demo["reward"]},
                     "rollout": {"max_new_tokens": 48, "ignore_eos": True, "prompts_per_generate": 32,
                                 "max_model_len": 64},
                     "learner": {**common["learner"], "batch_size": 64, "minibatch_size": 64, "ppo_epochs": 1}}
    one = trial("rollout-1", rollout_bound, ["placement.cores={rollout: [0], scorer: [1], learner: [1], buffer: [1]}"],
                args.out)
    two = trial("rollout-2", rollout_bound, ["rollout.engines=2",
                                             "placement.cores={rollout: [0, 1], scorer: [1], learner: [1], buffer: [1]}"],
                args.out)

    print("learner-bound: a random Llama 256x4, 8-token responses, 4 PPO epochs of minibatch 16", flush=True)
    learner_bound = {**common, "models": {"policy": big["policy"], "reward": big["reward"]},
                     "rollout": {"max_new_tokens": 8, "prompts_per_generate": 64, "max_model_len": 64},
                     "learner": {**common["learner"], "batch_size": 64, "minibatch_size": 16, "ppo_epochs": 4}}
    one_rank = trial("learner-1", learner_bound,
                     ["placement.cores={rollout: [0], scorer: [0], learner: [1], buffer: [0]}"], args.out)
    two_ranks = trial("learner-2", learner_bound, ["learner.ranks=2",
                                                   "placement.cores={rollout: [0], scorer: [0], learner: [0, 1], buffer: [0]}"],
                      args.out)

    report("rollout engines 1 -> 2 (engine 0 on core 0, engine 1 on core 1)", one, two,
           ["scorer0", "learner", "buffer"])
    report("learner ranks 1 -> 2 (rank 0 on core 0, rank 1 on core 1)", one_rank, two_ranks,
           ["rollout0", "scorer0", "buffer"])


if __name__ == "__main__":
    main()
