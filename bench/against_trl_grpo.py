"""tether's GRPO, split and colocated, against TRL's GRPOTrainer on the demo's task (``--algorithm
ppo``: tether's PPO against TRL's PPOTrainer): whole-run wall time, steady samples/s and held-out
gold at a sample budget, side by side in one process, round after round (this machine's speed
drifts), medians printed with the limits of issue 37.

Both train the demo's SFT policy (.demo/assets, built by `tether demo` or here) on the gold rule
alone (demos/parity.py ``gold_reward``): four responses a prompt, 64 responses a step in one
optimizer step, one pass over each batch, 8 new tokens at temperature 1, AdamW at a constant 5e-4,
the KL to the reference in the loss at 0.02 (k3, TRL's estimator). tether runs every role as its
process (vLLM generates); TRL generates with transformers' ``generate`` in its one process (its
vLLM path needs CUDA). Each side is one command timed from before it starts: imports, model
loading and start-up count. Steady samples/s is what came after the first step, over the time
after it. Held-out gold is measured here the same way for both outputs (``held_out_figures``).

``--algorithm ppo``: the demo's own PPO run (configs/demo.yaml: its reward model, the critic from
it, 64 responses a step in minibatches of 16, two epochs, the KL in the reward at 0.02, k = 1)
against TRL's PPOTrainer with the same models, batch, minibatches, epochs, response length, KL and
GAE (gamma 1, lambda 0.95), its policy and value model under one AdamW at the actor's 2e-4 (TRL has
one learning rate; tether's critic has 1e-3). PPOTrainer left TRL after 1.12.

TRL is installed for this bench only (not a dependency of tether), beside the environment:

    pip install --target /tmp/trl --no-deps trl==1.16.0 datasets multiprocess
    python bench/against_trl_grpo.py --trl-path /tmp/trl [--samples 2560,10240] [--rounds 2]
    pip install --target /tmp/trl112 --no-deps trl==1.12.0      # beside /tmp/trl's datasets
    python bench/against_trl_grpo.py --algorithm ppo --trl-path /tmp/trl112:/tmp/trl [--samples 2560,10240]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PROMPTS_PER_STEP, GROUP, NEW_TOKENS, LR, KL = 16, 4, 8, 5e-4, 0.02
BATCH = PROMPTS_PER_STEP * GROUP
# issue 37's targets: GRPO's whole run at most TRL's time at 2,560 samples, at most 0.8x at 10,240;
# PPO's lead kept (less than TRL's time)
LIMITS = {"grpo": {2560: 1.0, 10240: 0.8}, "ppo": {2560: 1.0, 10240: 1.0}}
PPO_MINIBATCH, PPO_EPOCHS, PPO_LR = 16, 2, 2e-4  # configs/demo.yaml's


def run_tether(assets: str, samples: int, run_dir: str, side: str, algorithm: str) -> dict:
    """``side``: the placement mode (split, colocate), and after an @ the staleness bound where it is
    not the demo's k = 1 (``split@auto``: buffer.max_staleness auto; ``split@2``)."""
    mode, _, staleness = side.partition("@")
    steps = samples // BATCH
    overrides = {"run_dir": run_dir, "models.policy": f"{assets}/sft", "models.reward": f"{assets}/rm",
                 "data.prompts": f"{assets}/prompts.jsonl", "learner.total_steps": steps, "placement.mode": mode,
                 **({"buffer.max_staleness": staleness} if staleness else {})}
    if algorithm == "grpo":  # the gold rule alone, groups of four, the KL in the loss
        overrides.update({"models.reward": "null", "scorer.gold_reward": "null",
                          "scorer.reward_functions": '[{"function": "demos.parity:gold_reward", "weight": 1.0}]',
                          "rollout.samples_per_prompt": GROUP, "rollout.max_new_tokens": NEW_TOKENS,
                          "learner.batch_size": BATCH, "learner.minibatch_size": BATCH, "learner.ppo_epochs": 1,
                          "learner.actor_lr": LR, "learner.lr_schedule": "constant",
                          "learner.advantage_estimator": "grpo", "learner.kl_in": "loss", "learner.kl_coef": KL,
                          "learner.kl_estimator": "k3"})
    return tether_run(os.path.join(REPO, "configs", "demo.yaml"), overrides, run_dir, BATCH)


def timed(started: float, ended: float, step_times: list[float], per_step: int) -> dict:
    """A side's figures: the whole run, its first step, and what a second came after it."""
    return {"wall_s": ended - started, "first_step_s": step_times[0] - started,
            "steady_per_s": (len(step_times) - 1) * per_step / (step_times[-1] - step_times[0])}


def tether_run(config: str, overrides: dict, run_dir: str, per_step: int, repo: str = REPO,
               env: dict[str, str] | None = None) -> dict:
    """`tether run` of ``config`` with ``overrides`` from the checkout ``repo``, timed from before
    the command (``timed``: ``per_step`` samples a step), and its final checkpoint."""
    from common.runlog import read_metrics

    command = [sys.executable, "-m", "launch.cli", "run", "-c", config, "--overwrite",
               *[item for key, value in overrides.items() for item in ("-o", f"{key}={value}")]]
    started = time.time()
    result = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=1800, env=env)
    ended = time.time()
    if result.returncode != 0:
        raise RuntimeError(f"tether run failed ({result.returncode}):\n{result.stderr[-3000:]}")
    step_times = [record["time"] for record in read_metrics(run_dir, "learner")]
    return {**timed(started, ended, step_times, per_step), "output": os.path.join(run_dir, "checkpoints", "final")}


def trl_run(arguments: list[str], output: str, per_step: int, env: dict[str, str]) -> dict:
    """A bench's TRL side, ``python ARGUMENTS --output OUTPUT`` (it writes each optimizer step's end
    time to OUTPUT-times.json), timed the same way."""
    started = time.time()
    result = subprocess.run([sys.executable, *arguments, "--output", output], cwd=REPO, capture_output=True,
                            text=True, timeout=3600, env=env)
    ended = time.time()
    if result.returncode != 0:
        raise RuntimeError(f"TRL failed ({result.returncode}):\n{result.stderr[-3000:]}")
    with open(output + "-times.json") as file:
        return {**timed(started, ended, json.load(file), per_step), "output": output}


def run_trl(assets: str, samples: int, output: str, trl_path: str, algorithm: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [trl_path, os.environ.get("PYTHONPATH")]))}
    return trl_run([os.path.abspath(__file__), "--trl-run", assets, "--samples", str(samples),
                    "--algorithm", algorithm], output, BATCH, env)


def step_times():
    """A TrainerCallback that keeps each optimizer step's end time (``.times``)."""
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.time())

    return StepTimes()


def trl_ppo_main(assets: str, samples: int, output: str) -> None:
    """PPOTrainer (TRL 1.12) with the demo's PPO settings, in this process; each optimizer step's
    end time to ``output``-times.json."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(f"{assets}/sft", padding_side="left")
    with open(f"{assets}/prompts.jsonl") as file:
        prompts = [json.loads(line)["prompt"] for line in file if line.strip()]
    data = Dataset.from_list([{"input_ids": tokenizer(prompts[i % len(prompts)])["input_ids"]}
                              for i in range(samples)])
    torch.manual_seed(0)
    config = PPOConfig(output_dir=output + "-trainer", per_device_train_batch_size=PPO_MINIBATCH,
                       gradient_accumulation_steps=BATCH // PPO_MINIBATCH, num_mini_batches=BATCH // PPO_MINIBATCH,
                       num_ppo_epochs=PPO_EPOCHS, total_episodes=samples, response_length=NEW_TOKENS,
                       temperature=1.0, learning_rate=PPO_LR, lr_scheduler_type="constant", kl_coef=KL, gamma=1.0,
                       lam=0.95, stop_token="eos", num_sample_generations=0, save_strategy="no", report_to="none",
                       use_cpu=True, dataloader_num_workers=0, seed=0)
    callback = step_times()
    trainer = PPOTrainer(args=config, processing_class=tokenizer,
                         model=AutoModelForCausalLM.from_pretrained(f"{assets}/sft"),
                         ref_model=AutoModelForCausalLM.from_pretrained(f"{assets}/sft"),
                         reward_model=AutoModelForSequenceClassification.from_pretrained(f"{assets}/rm", num_labels=1),
                         value_model=AutoModelForSequenceClassification.from_pretrained(f"{assets}/rm", num_labels=1),
                         train_dataset=data, callbacks=[callback])
    trainer.train()
    # the policy alone (PPOTrainer.save_model of TRL 1.12 fails on transformers 5.19: it reads a
    # Trainer attribute that is no longer set)
    trainer.accelerator.unwrap_model(trainer.model).policy.save_pretrained(output)
    tokenizer.save_pretrained(output)
    with open(output + "-times.json", "w") as file:
        json.dump(callback.times, file)


def trl_main(assets: str, samples: int, output: str) -> None:
    """GRPOTrainer with the settings above, in this process; each optimizer step's end time to
    ``output``-times.json."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from demos.parity import gold_reward

    tokenizer = AutoTokenizer.from_pretrained(f"{assets}/sft")
    with open(f"{assets}/prompts.jsonl") as file:
        prompts = [json.loads(line)["prompt"] for line in file if line.strip()]
    steps = samples // BATCH
    data = Dataset.from_list([{"prompt": prompts[i % len(prompts)]} for i in range(steps * PROMPTS_PER_STEP)])

    def gold(prompts, completions, completion_ids, **_) -> list[float]:
        return [gold_reward(tokenizer(prompt)["input_ids"], ids) for prompt, ids in zip(prompts, completion_ids)]

    torch.manual_seed(0)
    config = GRPOConfig(output_dir=output + "-trainer", per_device_train_batch_size=PROMPTS_PER_STEP,
                        gradient_accumulation_steps=GROUP, num_generations=GROUP, generation_batch_size=BATCH,
                        max_completion_length=NEW_TOKENS, temperature=1.0, learning_rate=LR,
                        lr_scheduler_type="constant", warmup_steps=0, beta=KL, num_train_epochs=1, max_steps=steps,
                        save_strategy="no", report_to="none", logging_steps=10, use_cpu=True,
                        dataloader_num_workers=0, seed=0)
    callback = step_times()
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(f"{assets}/sft"), reward_funcs=gold,
                          args=config, train_dataset=data, processing_class=tokenizer, callbacks=[callback])
    trainer.train()
    trainer.save_model(output)
    tokenizer.save_pretrained(output)
    with open(output + "-times.json", "w") as file:
        json.dump(callback.times, file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", default="2560,10240", help="sample budgets, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sides", default="split,colocate,TRL",
                        help="of split, colocate, TRL; a tether side with @K or @auto sets buffer.max_staleness "
                             "(default: the demo's k = 1), e.g. split@auto")
    parser.add_argument("--trl-path", help="where TRL was installed with pip --target (else: importable)")
    parser.add_argument("--algorithm", choices=("grpo", "ppo"), default="grpo")
    parser.add_argument("--trl-run", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_run:
        main_of = trl_ppo_main if args.algorithm == "ppo" else trl_main
        return main_of(args.trl_run, int(args.samples), args.output)

    from demos.parity import build_assets, held_out_figures

    assets = os.path.join(REPO, ".demo", "assets")
    build_assets(assets, log=lambda *_: None)  # cached after the first time
    work = tempfile.mkdtemp(prefix="tether-bench-grpo-")
    sides = args.sides.split(",")
    print(f"{'samples':>8} {'side':<12}{'round':>6}{'wall s':>9}{'first step s':>14}{'steady samples/s':>18}"
          f"{'held-out gold':>15}", flush=True)
    for samples in (int(s) for s in args.samples.split(",")):
        results: dict[str, list[dict]] = {side: [] for side in sides}
        for round_index in range(args.rounds):
            for side in sides:
                output = os.path.join(work, f"{side.replace('@', '-k')}-{samples}")
                result = (run_trl(assets, samples, output, args.trl_path, args.algorithm) if side == "TRL"
                          else run_tether(assets, samples, output, side, args.algorithm))
                result["gold"] = held_out_figures(result["output"], f"{assets}/sft", f"{assets}/rm",
                                                  f"{assets}/eval_prompts.jsonl", NEW_TOKENS)["gold_reward"]
                results[side].append(result)
                print(f"{samples:>8} {side:<12}{round_index + 1:>6}{result['wall_s']:>9.1f}"
                      f"{result['first_step_s']:>14.1f}{result['steady_per_s']:>18.0f}{result['gold']:>15.3f}",
                      flush=True)
        medians = {side: {key: statistics.median(r[key] for r in runs) for key in
                          ("wall_s", "first_step_s", "steady_per_s", "gold")} for side, runs in results.items()}
        for side, figures in medians.items():
            line = (f"{samples:>8} {side:<12} medians: wall {figures['wall_s']:.1f} s, first step "
                    f"{figures['first_step_s']:.1f} s, steady {figures['steady_per_s']:.0f} samples/s, "
                    f"gold {figures['gold']:.3f}")
            if side != "TRL" and "TRL" in medians:
                trl = medians["TRL"]
                ratio, limit = figures["wall_s"] / trl["wall_s"], LIMITS[args.algorithm].get(samples)
                verdict = f" (limit <= {limit}: {'met' if ratio <= limit else 'NOT met'})" if limit else ""
                line += (f"; wall / TRL's {ratio:.2f}{verdict}, steady / TRL's "
                         f"{figures['steady_per_s'] / trl['steady_per_s']:.2f}")
            print(line, flush=True)


if __name__ == "__main__":
    main()
