"""Scaling out: trained tokens/s with 1 -> 2 rollout engines on a rollout-bound config and 1 -> 2
learner ranks on a learner-bound config, each next to its ideal (twice the one-process figure)
measured in the same run. On this 2-core machine the second process gets the second core, which
the other roles (scorer, learner or rollout, buffer) also use: the report accounts for where the
rest goes from each role's measured busy time.

Every trial is a real `tether run` (vLLM, DeepSpeed, ZeroMQ); figures are steady state, from the
runs' profiles (each role's start-up left out). Then each role alone, where the second core is
its own: the rollout pool (real engines, the real buffer, no-op scorer and learner) and the
learner's ranks (real DeepSpeed engines training fixed batches), 1 process against 2.

    python bench/scaling.py [--steps 15] [--out runs/scaling] [--alone-only]
"""

from __future__ import annotations

import argparse
import os
import sys

GOAL = 0.85

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build_learner_bound_models(directory: str) -> dict[str, str]:
    """A random Llama large enough that training, not the step's fixed costs, is its time, and a
    reward model of the same shape: throughput only, nothing is meant to be learned."""
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from demos.parity import build_tokenizer, tiny_llama_config

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
    from common.config import load_config
    from launch.report import profile_run
    from launch.runner import run_roles

    run_dir = os.path.join(out, name)
    config = load_config(None, [f"run_dir={run_dir}", *overrides], base=base)
    print(f"  {name}: tether run ...", flush=True)
    if run_roles(config, overwrite=True) != 0:
        raise SystemExit(f"trial {name} failed; see {run_dir}/logs")
    from common.runlog import read_metrics

    profile = profile_run(run_dir)
    busy = {role.role: role.busy_fraction for role in profile.roles}
    steps = read_metrics(run_dir, "learner")[1:]  # the first step waited for start-up
    return {"tokens_per_s": profile.pipeline_tokens_per_s, "busy": busy, "bottleneck": profile.bottleneck,
            # the roles' own rates: the engines' generated tokens over the run's steady wall time, and
            # the learner's trained tokens per second of training (its waits left out)
            "generated_per_s": sum(role.tokens_per_s or 0.0 for role in profile.roles if role.role.startswith("rollout")),
            "learner_per_s": sum(r["response_tokens"] for r in steps) / sum(r["train_s"] for r in steps)}


def report(title: str, one: dict, two: dict, shared_core_roles: list[str], own: tuple[str, str]) -> None:
    """The pipeline's trained tokens/s with 1 and 2 processes of the role, against twice the first."""
    ideal = 2 * one["tokens_per_s"]
    ratio = two["tokens_per_s"] / ideal
    print(f"\n{title}")
    print(f"  1 process   {one['tokens_per_s']:9,.0f} trained tokens/s  (bottleneck {one['bottleneck']})")
    print(f"  2 processes {two['tokens_per_s']:9,.0f} trained tokens/s  = {ratio:.0%} of the ideal {ideal:,.0f} "
          f"(goal >= {GOAL:.0%}: {'met' if ratio >= GOAL else 'not met'})")
    key, what = own
    print(f"  the role's own rate, {what}: {one[key]:,.0f} -> {two[key]:,.0f} tokens/s "
          f"= {two[key] / (2 * one[key]):.0%} of twice the first")
    for label, result in (("1 process", one), ("2 processes", two)):
        shares = ", ".join(f"{role} {share:.0%}" for role, share in sorted(result["busy"].items()))
        print(f"  busy share of wall time, {label}: {shares}")
    others = sum(two["busy"].get(role, 0.0) for role in shared_core_roles)
    print(f"  {', '.join(shared_core_roles)} shared a core with one of the two processes: busy {others:.0%} of a "
          f"core between them, so that core was asked for {others + 1:.0%} of itself")


# --------------------------------------------------------------------------- each role alone


def rollout_pool_alone(engines: int, demo: dict, out: str, batches: int = 40) -> float:
    """Generated tokens/s of ``engines`` real rollout engines (one core each), fed by the real
    buffer; the scorer and learner are no-ops in this process, so the engines are all that works."""
    import threading
    import time

    from buffer_throughput import scorer_process

    from buffer.main import run as run_buffer
    from common.config import dump_config, load_config
    from launch.runner import start_role
    from protocol.samples import unpack_samples
    from protocol.transport import BufferClient

    run_dir = os.path.join(out, f"rollout-alone-{engines}")
    config = load_config(None, [
        f"run_dir={run_dir}", f"rollout.engines={engines}", "rollout.max_new_tokens=48", "rollout.ignore_eos=true",
        "rollout.prompts_per_generate=64", "rollout.max_model_len=64", "learner.batch_size=64",
        "learner.minibatch_size=64", f"buffer.max_staleness={batches}", "log_level=WARNING",
        f"placement.cores={{rollout: {list(range(engines))}}}", "transport.connect_retries=120",
    ], base={"models": {"policy": demo["policy"], "reward": demo["reward"]}, "data": {"prompts": demo["prompts"]}})
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    config_path = os.path.join(run_dir, "config.yaml")
    with open(config_path, "w") as file:
        file.write(dump_config(config))
    buffer = threading.Thread(target=run_buffer, args=(config,))
    buffer.start()
    threading.Thread(target=scorer_process, args=(config, 64), daemon=True).start()
    processes = [start_role(config, "rollout", config_path, i) for i in range(engines)]
    learner = BufferClient(config.buffer_address, "learner", "0")
    learner.connect(120, 0.5)
    tokens, started = 0, None
    for _ in range(batches):
        batch = unpack_samples(learner.request("batch_request", {"policy_version": 0, "batch_size": 64,
                                                                "max_staleness": config.buffer.initial_staleness},
                                               timeout_s=600))
        if started is None:  # the first batch waited for the engines to start
            started = time.monotonic()
            continue
        tokens += sum(len(s.response_tokens) for s in batch)
    rate = tokens / (time.monotonic() - started)
    learner.request("finish", {"policy_version": 0})
    for process in processes:
        process.process.wait(timeout=120)
    buffer.join()
    return rate


def learner_alone(ranks: int, big: dict, out: str, steps: int = 6) -> float:
    """Trained tokens per second of ``ranks`` DeepSpeed ranks (one core each) on fixed batches."""
    import json
    import subprocess

    from protocol.transport import free_port

    result = os.path.join(out, f"learner-alone-{ranks}.json")
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
               f"--master-port={free_port()}", os.path.abspath(__file__), "--learner-worker",
               "--policy", big["policy"], "--reward", big["reward"], "--result", result, "--steps", str(steps)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    subprocess.run(command, check=True, env=env, timeout=900,  # a hung rank ends the bench, not the session
                   preexec_fn=lambda: os.sched_setaffinity(0, list(range(ranks))),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(result) as file:
        return json.load(file)["tokens_per_s"]


def learner_worker(args) -> None:
    """One rank of ``learner_alone``: the learner's own pieces, timed over ``steps`` PPO steps
    after a warm-up step, on 64 samples of an 8-token prompt and a 32-token response."""
    import json
    import tempfile
    import time

    import numpy as np

    from common.config import load_config
    from common.models import load_causal_lm, load_critic
    from common.sequences import collate
    from learner.step import ppo_step
    from protocol.samples import Sample
    from training import parallel
    from training.deepspeed_engine import make_deepspeed_engine
    from training.parallel import init_distributed

    world = int(os.environ.get("WORLD_SIZE", 1))
    config = load_config(None, ["learner.batch_size=64", "learner.minibatch_size=32", "learner.ppo_epochs=2",
                                f"learner.ranks={world}"],
                         base={"run_dir": tempfile.mkdtemp(), "models": {"policy": args.policy, "reward": args.reward},
                               "data": {"prompts": "/unused"}})
    init_distributed(config)
    rng = np.random.default_rng(0)
    samples = [Sample(f"s{i}", i, 0, rng.integers(3, 16, 8).astype(np.int32), rng.integers(3, 16, 32).astype(np.int32),
                      np.full(32, -2.0, np.float32), "length", ref_logprobs=np.full(32, -2.0, np.float32),
                      reward=float(rng.normal())) for i in range(64)]
    actor = make_deepspeed_engine(load_causal_lm(args.policy), 1e-5, config)
    critic = make_deepspeed_engine(load_critic(args.reward), 1e-5, config)
    batch = collate(samples, pad_token_id=0)
    for step in range(args.steps + 1):
        if step == 1:
            parallel.barrier()
            started = time.perf_counter()
        ppo_step(actor, critic, samples, batch, config, policy_version=step, kl_coef=0.05)
    parallel.barrier()
    rate = args.steps * 64 * 32 / (time.perf_counter() - started)
    if parallel.is_main():
        with open(args.result, "w") as file:
            json.dump({"tokens_per_s": rate}, file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", default="runs/scaling")
    parser.add_argument("--alone-only", action="store_true", help="only each role alone, not the pipeline trials")
    parser.add_argument("--learner-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--policy", help=argparse.SUPPRESS)
    parser.add_argument("--reward", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.learner_worker:
        return learner_worker(args)

    from demos.parity import build_assets

    assets_dir = os.path.join(args.out, "assets")
    demo = build_assets(os.path.join(assets_dir, "demo"), sft_steps=60, rm_prompts=32, rm_epochs=1, log=lambda *_: None)
    big = build_learner_bound_models(os.path.join(assets_dir, "learner-bound"))
    # 1, 2, 1, 2 processes: this machine's speed drifts by tens of percent between minutes, so each
    # count is the mean of two runs taken in turn with the other
    print("each role alone, one core per process (1, 2, 1, 2 processes in turn):", flush=True)
    measure = {"rollout": lambda n: rollout_pool_alone(n, demo, args.out),
               "learner": lambda n: learner_alone(n, big, args.out)}
    for role, run_alone in measure.items():
        rates = {1: [], 2: []}
        for count in (1, 2, 1, 2):
            rates[count].append(run_alone(count))
        one_rate, two_rate = (sum(rates[n]) / 2 for n in (1, 2))
        what = "engines, generated" if role == "rollout" else "ranks, trained"
        ratio = two_rate / (2 * one_rate)
        runs = "; ".join(f"{n}: " + ", ".join(f"{r:,.0f}" for r in rates[n]) for n in (1, 2))
        print(f"  {role} alone: 1 -> 2 {what} tokens/s {one_rate:,.0f} -> {two_rate:,.0f} = {ratio:.0%} of the ideal "
              f"{2 * one_rate:,.0f} (goal >= {GOAL:.0%}: {'met' if ratio >= GOAL else 'not met'}) [runs {runs}]",
              flush=True)
    if args.alone_only:
        return

    common = {"seed": 0, "data": {"prompts": demo["prompts"]}, "buffer": {"max_staleness": 1},
              "learner": {"total_steps": args.steps}, "transport": {"connect_retries": 120}}

    print("rollout-bound: the demo's models, 48-token responses (ignore_eos), batch 128, one PPO epoch", flush=True)
    rollout_bound = {**common, "models": {"policy": demo["policy"], "reward": demo["reward"]},
                     "rollout": {"max_new_tokens": 48, "ignore_eos": True, "prompts_per_generate": 64,
                                 "max_model_len": 64},
                     "learner": {**common["learner"], "batch_size": 128, "minibatch_size": 128, "ppo_epochs": 1}}
    one = trial("rollout-1", rollout_bound, ["placement.cores={rollout: [0], scorer: [1], learner: [1], buffer: [1]}"],
                args.out)
    two = trial("rollout-2", rollout_bound, ["rollout.engines=2",
                                             "placement.cores={rollout: [0, 1], scorer: [1], learner: [1], buffer: [1]}"],
                args.out)

    print("learner-bound: a random Llama 256x4, 32-token responses, 2 PPO epochs of minibatch 32", flush=True)
    learner_bound = {**common, "models": {"policy": big["policy"], "reward": big["reward"]},
                     "rollout": {"max_new_tokens": 32, "ignore_eos": True, "prompts_per_generate": 64,
                                 "max_model_len": 64},
                     "learner": {**common["learner"], "batch_size": 64, "minibatch_size": 32, "ppo_epochs": 2}}
    one_rank = trial("learner-1", learner_bound,
                     ["placement.cores={rollout: [0], scorer: [0], learner: [1], buffer: [0]}"], args.out)
    two_ranks = trial("learner-2", learner_bound, ["learner.ranks=2",
                                                   "placement.cores={rollout: [0], scorer: [0], learner: [0, 1], buffer: [0]}"],
                      args.out)

    report("rollout engines 1 -> 2 (engine 0 on core 0, engine 1 on core 1)", one, two,
           ["scorer0", "learner", "buffer"], ("generated_per_s", "the engines' generated tokens/s"))
    report("learner ranks 1 -> 2 (rank 0 on core 0, rank 1 on core 1)", one_rank, two_ranks,
           ["rollout0", "scorer0", "buffer"], ("learner_per_s", "trained tokens per second of training"))


if __name__ == "__main__":
    main()
