"""tether's GRPO, split and colocated, against TRL's GRPOTrainer on the demo's task: whole-run wall
time, steady samples/s and held-out gold at a sample budget, side by side in one process, round
after round (this machine's speed drifts), medians printed with the limits of issue 37.

Both train the demo's SFT policy (.demo/assets, built by `tether demo` or here) on the gold rule
alone (demos/parity.py ``gold_reward``): four responses a prompt, 64 responses a step in one
optimizer step, one pass over each batch, 8 new tokens at temperature 1, AdamW at a constant 5e-4,
the KL to the reference in the loss at 0.02 (k3, TRL's estimator). tether runs every role as its
process (vLLM generates); TRL generates with transformers' ``generate`` in its one process (its
vLLM path needs CUDA). Each side is one command timed from before it starts: imports, model
loading and start-up count. Steady samples/s is what came after the first step, over the time
after it. Held-out gold is measured here the same way for both outputs (``held_out_figures``).

TRL is installed for this bench only (not a dependency of tether), beside the environment:

    pip install --target /tmp/trl --no-deps trl==1.16.0 datasets multiprocess
    python bench/against_trl_grpo.py --trl-path /tmp/trl [--samples 2560,10240] [--rounds 2]
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
# issue 37's targets: the whole run at most TRL's time at 2,560 samples, at most 0.8x at 10,240
LIMITS = {2560: 1.0, 10240: 0.8}


def run_tether(assets: str, samples: int, run_dir: str, mode: str) -> dict:
    from common.runlog import read_metrics

    steps = samples // BATCH
    overrides = {"run_dir": run_dir, "models.policy": f"{assets}/sft", "models.reward": "null",
                 "data.prompts": f"{assets}/prompts.jsonl", "scorer.gold_reward": "null",
                 "scorer.reward_functions": '[{"function": "demos.parity:gold_reward", "weight": 1.0}]',
                 "rollout.samples_per_prompt": GROUP, "rollout.max_new_tokens": NEW_TOKENS,
                 "learner.total_steps": steps, "learner.batch_size": BATCH, "learner.minibatch_size": BATCH,
                 "learner.ppo_epochs": 1, "learner.actor_lr": LR, "learner.lr_schedule": "constant",
                 "learner.advantage_estimator": "grpo", "learner.kl_in": "loss", "learner.kl_coef": KL,
                 "learner.kl_estimator": "k3", "placement.mode": mode}
    command = [sys.executable, "-m", "launch.cli", "run", "-c", os.path.join(REPO, "configs", "demo.yaml"),
               "--overwrite", *[item for key, value in overrides.items() for item in ("-o", f"{key}={value}")]]
    started = time.time()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800)
    ended = time.time()
    if result.returncode != 0:
        raise RuntimeError(f"tether run failed ({result.returncode}):\n{result.stderr[-3000:]}")
    steps_done = read_metrics(run_dir, "learner")
    first, last = steps_done[0]["time"], steps_done[-1]["time"]
    return {"wall_s": ended - started, "first_step_s": first - started,
            "steady_samples_per_s": (len(steps_done) - 1) * BATCH / (last - first),
            "output": os.path.join(run_dir, "checkpoints", "final")}


def run_trl(assets: str, samples: int, output: str, trl_path: str) -> dict:
    started = time.time()
    times = output + "-times.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [trl_path, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, os.path.abspath(__file__), "--trl-run", assets, "--samples",
                             str(samples), "--output", output], cwd=REPO, capture_output=True, text=True,
                            timeout=3600, env=env)
    ended = time.time()
    if result.returncode != 0:
        raise RuntimeError(f"TRL failed ({result.returncode}):\n{result.stderr[-3000:]}")
    with open(times) as file:
        step_times = json.load(file)
    return {"wall_s": ended - started, "first_step_s": step_times[0] - started,
            "steady_samples_per_s": (len(step_times) - 1) * BATCH / (step_times[-1] - step_times[0]),
            "output": output}


def trl_main(assets: str, samples: int, output: str) -> None:
    """GRPOTrainer with the settings above, in this process; each optimizer step's end time to
    ``output``-times.json."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from demos.parity import gold_reward

    tokenizer = AutoTokenizer.from_pretrained(f"{assets}/sft")
    with open(f"{assets}/prompts.jsonl") as file:
        prompts = [json.loads(line)["prompt"] for line in file if line.strip()]
    steps = samples // BATCH
    data = Dataset.from_list([{"prompt": prompts[i % len(prompts)]} for i in range(steps * PROMPTS_PER_STEP)])

    def gold(prompts, completions, completion_ids, **_) -> list[float]:
        return [gold_reward(tokenizer(prompt)["input_ids"], ids) for prompt, ids in zip(prompts, completion_ids)]

    class StepTimes(TrainerCallback):
        times: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.time())

    torch.manual_seed(0)
    config = GRPOConfig(output_dir=output + "-trainer", per_device_train_batch_size=PROMPTS_PER_STEP,
                        gradient_accumulation_steps=GROUP, num_generations=GROUP, generation_batch_size=BATCH,
                        max_completion_length=NEW_TOKENS, temperature=1.0, learning_rate=LR,
                        lr_scheduler_type="constant", warmup_steps=0, beta=KL, num_train_epochs=1, max_steps=steps,
                        save_strategy="no", report_to="none", logging_steps=10, use_cpu=True,
                        dataloader_num_workers=0, seed=0)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(f"{assets}/sft"), reward_funcs=gold,
                          args=config, train_dataset=data, processing_class=tokenizer, callbacks=[StepTimes()])
    trainer.train()
    trainer.save_model(output)
    tokenizer.save_pretrained(output)
    with open(output + "-times.json", "w") as file:
        json.dump(StepTimes.times, file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", default="2560,10240", help="sample budgets, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sides", default="split,colocate,TRL", help="of split, colocate, TRL")
    parser.add_argument("--trl-path", help="where TRL was installed with pip --target (else: importable)")
    parser.add_argument("--trl-run", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_run:
        return trl_main(args.trl_run, int(args.samples), args.output)

    from demos.parity import build_assets, held_out_figures

    assets = os.path.join(REPO, ".demo", "assets")
    build_assets(assets, log=lambda *_: None)  # cached after the first time
    work = tempfile.mkdtemp(prefix="tether-bench-grpo-")
    sides = args.sides.split(",")
    print(f"{'samples':>8} {'side':<9}{'round':>6}{'wall s':>9}{'first step s':>14}{'steady samples/s':>18}"
          f"{'held-out gold':>15}", flush=True)
    for samples in (int(s) for s in args.samples.split(",")):
        results: dict[str, list[dict]] = {side: [] for side in sides}
        for round_index in range(args.rounds):
            for side in sides:
                output = os.path.join(work, f"{side}-{samples}")
                result = (run_trl(assets, samples, output, args.trl_path) if side == "TRL"
                          else run_tether(assets, samples, output, side))
                result["gold"] = held_out_figures(result["output"], f"{assets}/sft", f"{assets}/rm",
                                                  f"{assets}/eval_prompts.jsonl", NEW_TOKENS)["gold_reward"]
                results[side].append(result)
                print(f"{samples:>8} {side:<9}{round_index + 1:>6}{result['wall_s']:>9.1f}"
                      f"{result['first_step_s']:>14.1f}{result['steady_samples_per_s']:>18.0f}{result['gold']:>15.3f}",
                      flush=True)
        medians = {side: {key: statistics.median(r[key] for r in runs) for key in
                          ("wall_s", "first_step_s", "steady_samples_per_s", "gold")} for side, runs in results.items()}
        for side, figures in medians.items():
            line = (f"{samples:>8} {side:<9} medians: wall {figures['wall_s']:.1f} s, first step "
                    f"{figures['first_step_s']:.1f} s, steady {figures['steady_samples_per_s']:.0f} samples/s, "
                    f"gold {figures['gold']:.3f}")
            if side != "TRL" and "TRL" in medians:
                trl = medians["TRL"]
                ratio, limit = figures["wall_s"] / trl["wall_s"], LIMITS.get(samples)
                verdict = f" (limit <= {limit}: {'met' if ratio <= limit else 'NOT met'})" if limit else ""
                line += (f"; wall / TRL's {ratio:.2f}{verdict}, steady / TRL's "
                         f"{figures['steady_samples_per_s'] / trl['steady_samples_per_s']:.2f}")
            print(line, flush=True)


if __name__ == "__main__":
    main()
