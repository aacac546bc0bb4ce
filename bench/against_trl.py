"""tether sft, rm and dpo against TRL's SFTTrainer, RewardTrainer and DPOTrainer: wall time and the
held-out figure of each, on the same data, the same start model and the same hyperparameters, side
by side in one process (this machine's speed drifts: the two of a stage run back to back), the
median of ``--seeds`` runs each.

The data is the demo's task ("parity", demos/parity.py) on a Llama of ``--hidden`` x ``--layers``:
demonstrations for SFT; for the reward model and DPO, pairs of SFT samples ranked by the gold rule
(TRL's RewardTrainer takes pairs; tether's K-wise loss with K = 2 is the pairwise loss). Each
trainer runs as a process of its own, so both pay their imports and start-up in the wall time. The
held-out figures are computed here, the same way for both outputs: SFT, transformers' ``labels``
loss on the held-out demonstrations; RM, the share of held-out pairs scored in the right order
(pooled at the last token, as tether's scorer reads a reward model); DPO, the share of held-out
pairs whose implicit reward beta (log pi - log pi_ref) is higher for the chosen response.

The limits printed: tether's wall time at most 1.25 x TRL's, and its held-out figure within 0.01
of TRL's (loss) or 0.02 (accuracy) or better.

TRL is installed for this bench only (not a dependency of tether):

    pip install trl==1.16.0
    python bench/against_trl.py [--hidden 128] [--layers 2] [--stage sft --stage rm --stage dpo]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# the hyperparameters both sides train with
HYPER = {"sft": {"lr": 3e-3, "batch_size": 64, "epochs": 1, "max_len": 128},
         "rm": {"lr": 1e-3, "batch_size": 32, "epochs": 4, "max_len": 128},
         "dpo": {"lr": 5e-4, "batch_size": 32, "epochs": 1, "max_len": 128, "beta": 0.1}}
WALL_LIMIT = 1.25
METRIC_SLACK = {"loss": 0.01, "accuracy": 0.02}


# --------------------------------------------------------------------------- the data


def build(work: str, hidden: int, layers: int, log=print) -> dict[str, str]:
    """Base model, demonstrations, the SFT model the RM and DPO start from (tether sft on the
    demonstrations) and ranked pairs of its samples."""
    from demos.parity import (build_tokenizer, gold_reward, make_prompt, sample_responses, write_base_model,
                             write_demonstrations)

    paths = {name: os.path.join(work, name) for name in ("base", "sft_start")}
    tokenizer = build_tokenizer(paths["base"])
    write_base_model(paths["base"], tokenizer, 0, hidden=hidden, layers=layers)
    for name, count, seed in (("demonstrations", 8192, 1), ("demonstrations_eval", 512, 2)):
        paths[name] = os.path.join(work, f"{name}.jsonl")
        write_demonstrations(paths[name], count, seed)
    config = os.path.join(work, "start.yaml")
    with open(config, "w") as file:
        json.dump({"run_dir": os.path.join(work, "start-run"), "sft": {
            "model": paths["base"], "data": paths["demonstrations"], "output": paths["sft_start"], "eval_fraction": 0,
            **{k: v for k, v in HYPER["sft"].items()}}}, file)
    log("building the start model of rm and dpo (tether sft)")
    subprocess.run([sys.executable, "-m", "launch.cli", "sft", "-c", config, "--overwrite"], cwd=REPO, check=True,
                   capture_output=True)

    import torch
    from transformers import AutoModelForCausalLM

    sft = AutoModelForCausalLM.from_pretrained(paths["sft_start"], dtype=torch.float32).eval()
    for name, prompts, seed in (("pairs", 1536, 3), ("pairs_eval", 256, 4)):
        rng = random.Random(seed)
        texts = [make_prompt(rng) for _ in range(prompts)]
        prompt_ids = [tokenizer(text)["input_ids"] for text in texts for _ in range(2)]
        responses = sample_responses(sft, prompt_ids, max_new_tokens=8, seed=seed)
        paths[name] = os.path.join(work, f"{name}.jsonl")
        with open(paths[name], "w") as file:
            for g, text in enumerate(texts):
                (a, b) = (2 * g, 2 * g + 1)
                gold_a, gold_b = gold_reward(prompt_ids[a], responses[a]), gold_reward(prompt_ids[b], responses[b])
                if gold_a == gold_b:
                    continue
                chosen, rejected = (a, b) if gold_a > gold_b else (b, a)
                file.write(json.dumps({"prompt": text,
                                       "chosen": tokenizer.decode(responses[chosen], skip_special_tokens=True),
                                       "rejected": tokenizer.decode(responses[rejected], skip_special_tokens=True)})
                           + "\n")
    return paths


# --------------------------------------------------------------------------- the trainers


def run_tether(stage: str, paths: dict, output: str, work: str, seed: int) -> float:
    hyper = dict(HYPER[stage])
    section = {"model": paths["base"] if stage == "sft" else paths["sft_start"], "output": output,
               "data": paths["demonstrations" if stage == "sft" else "pairs"], "eval_fraction": 0,
               "lr_schedule": "linear", **hyper}
    if stage == "rm":
        section["calibration"] = "none"
    config = os.path.join(work, f"tether-{stage}.json")
    with open(config, "w") as file:
        json.dump({"run_dir": os.path.join(work, f"tether-{stage}-run"), "seed": seed, stage: section}, file)
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "launch.cli", stage, "-c", config, "--overwrite"], cwd=REPO, check=True,
                   capture_output=True)
    return time.monotonic() - started


def run_trl(stage: str, paths: dict, output: str, work: str, seed: int) -> float:
    started = time.monotonic()
    subprocess.run([sys.executable, os.path.abspath(__file__), "--trl-stage", stage, "--paths", json.dumps(paths),
                    "--output", output, "--seed", str(seed)], cwd=REPO, check=True, capture_output=True)
    return time.monotonic() - started


def trl_main(stage: str, paths: dict, output: str, seed: int) -> None:
    """One TRL trainer, in this process, with HYPER's settings (TRL's defaults otherwise: AdamW,
    weight decay 0, gradient clipping at 1, as tether's); the new score head drawn from ``seed``,
    as tether draws it."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    hyper = HYPER[stage]
    tokenizer = AutoTokenizer.from_pretrained(paths["base"])
    common = dict(output_dir=output + "-trainer", per_device_train_batch_size=hyper["batch_size"],
                  learning_rate=hyper["lr"], num_train_epochs=hyper["epochs"], lr_scheduler_type="linear",
                  warmup_steps=0, save_strategy="no", report_to="none", logging_steps=50, use_cpu=True,
                  dataloader_num_workers=0, seed=seed, max_length=hyper["max_len"])
    torch.manual_seed(seed)
    rows = [json.loads(line) for line in open(paths["demonstrations" if stage == "sft" else "pairs"])]
    if stage == "sft":
        from trl import SFTConfig, SFTTrainer

        data = Dataset.from_list([{"prompt": r["prompt"], "completion": " " + r["response"]} for r in rows])
        model = AutoModelForCausalLM.from_pretrained(paths["base"])
        trainer = SFTTrainer(model=model, args=SFTConfig(**common), train_dataset=data, processing_class=tokenizer)
    elif stage == "rm":
        from trl import RewardConfig, RewardTrainer

        data = Dataset.from_list([{"prompt": r["prompt"], "chosen": " " + r["chosen"], "rejected": " " + r["rejected"]}
                                  for r in rows])
        model = AutoModelForSequenceClassification.from_pretrained(paths["sft_start"], num_labels=1)
        model.config.pad_token_id = tokenizer.pad_token_id
        trainer = RewardTrainer(model=model, args=RewardConfig(**common), train_dataset=data,
                                processing_class=tokenizer)
    else:
        from trl import DPOConfig, DPOTrainer

        data = Dataset.from_list([{"prompt": r["prompt"], "chosen": " " + r["chosen"], "rejected": " " + r["rejected"]}
                                  for r in rows])
        model = AutoModelForCausalLM.from_pretrained(paths["sft_start"])
        trainer = DPOTrainer(model=model, args=DPOConfig(**common, beta=hyper["beta"], precompute_ref_log_probs=True),
                             train_dataset=data, processing_class=tokenizer)
    trainer.train()
    trainer.save_model(output)
    tokenizer.save_pretrained(output)


# --------------------------------------------------------------------------- the held-out figures


def held_out(stage: str, output: str, paths: dict) -> tuple[str, float]:
    """(metric, value) of ``output`` on the held-out rows, computed the same way for both sides."""
    import torch
    from transformers import AutoTokenizer

    from stages.examples import padded, read_examples

    tokenizer = AutoTokenizer.from_pretrained(paths["base"])
    form = {"sft": "demonstration", "rm": "pair", "dpo": "pair"}[stage]
    examples, _ = read_examples(paths["demonstrations_eval" if stage == "sft" else "pairs_eval"], "held-out",
                                tokenizer, form, 128)
    with torch.no_grad():
        if stage == "sft":
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(output).eval()
            input_ids, attention_mask, loss_mask = padded(examples, 0)
            return "loss", float(model(input_ids=input_ids, attention_mask=attention_mask,
                                       labels=torch.where(loss_mask.bool(), input_ids, -100)).loss)
        if stage == "rm":
            from transformers import AutoModelForSequenceClassification

            from stages.rm import scores_of

            model = AutoModelForSequenceClassification.from_pretrained(output, num_labels=1).eval()
            scores = scores_of(model, examples, 0).view(-1, 2)
            return "accuracy", float((scores[:, 0] > scores[:, 1]).float().mean())
        from common.models import load_causal_lm
        from stages.dpo import logprob_sums

        policy = logprob_sums(load_causal_lm(output).eval(), examples, 0).view(-1, 2)
        reference = logprob_sums(load_causal_lm(paths["sft_start"]).eval(), examples, 0).view(-1, 2)
        rewards = policy - reference
        return "accuracy", float((rewards[:, 0] > rewards[:, 1]).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--stage", action="append", choices=list(HYPER), help="repeatable; default: all three")
    parser.add_argument("--seeds", type=int, default=3, help="runs of each side, seeds 0.. (a reward model's new "
                                                            "head makes its accuracy vary from seed to seed)")
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--trl-stage", help=argparse.SUPPRESS)
    parser.add_argument("--paths", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_stage:
        return trl_main(args.trl_stage, json.loads(args.paths), args.output, args.seed)
    try:
        import trl
    except ImportError:
        sys.exit("TRL is not installed: pip install trl==1.16.0 (for this bench only)")
    work = tempfile.mkdtemp(prefix="tether-bench-trl-")
    paths = build(work, args.hidden, args.layers, log=lambda line: print(line, flush=True))
    print(f"TRL {trl.__version__}; a Llama of {args.hidden} x {args.layers}; data in {work}")
    print(f"{'stage':<6}{'side':<8}{'seed':>5}{'wall s':>9}{'held-out':>20}")
    for stage in args.stage or list(HYPER):
        results = {"tether": [], "TRL": []}
        for seed in range(args.seeds):  # the two sides back to back, seed after seed
            for side, runner in (("tether", run_tether), ("TRL", run_trl)):
                output = os.path.join(work, f"{side}-{stage}")
                wall = runner(stage, paths, output, work, seed)
                metric, value = held_out(stage, output, paths)
                results[side].append((wall, value))
                print(f"{stage:<6}{side:<8}{seed:>5}{wall:>9.1f}{metric:>11} {value:>8.4f}", flush=True)
        (wall, value), (trl_wall, trl_value) = (tuple(statistics.median(column) for column in zip(*results[side]))
                                                for side in ("tether", "TRL"))
        better = value <= trl_value + METRIC_SLACK[metric] if metric == "loss" else \
            value >= trl_value - METRIC_SLACK[metric]
        print(f"{stage:<6}medians: tether / TRL wall {wall:.1f} / {trl_wall:.1f} s = {wall / trl_wall:.2f} (limit <= "
              f"{WALL_LIMIT}); held-out {metric} {value:.4f} vs {trl_value:.4f} (limit: within {METRIC_SLACK[metric]} "
              f"or better): {'ok' if wall / trl_wall <= WALL_LIMIT and better else 'OVER'}", flush=True)


if __name__ == "__main__":
    main()
