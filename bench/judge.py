"""LLM judges and slow rewards, measured (docs/benchmarks.md, "Judges and slow rewards").

1. The judge in a scorer, alone: samples/s of ``Scorer.score`` over 256 of the demo task's
   samples in requests of 64, with the demo's judge (configs/demo-judge.yaml) and without it
   (the reference pass alone), on one scorer (one core) and on two (a process each, one core each,
   side by side).
2. ``tether run`` of the judge demo, variants taking turns round after round (this machine's
   speed drifts):
   - ``judge-k0`` and ``judge-k2``: the judge as the reward at max_staleness 0 and 2: trained
     samples/s after the first step, and the scorer's busy share of the run (a judge's time is
     the scorer's);
   - ``instant-k2`` and ``slow-k2``: no judge, a reward function (the gold rule) answering at once,
     or after 200 ms a call (``async``), 128 calls at once; the rollout's tokens/s over the run,
     which the slow function must not lower below 0.9x the instant one's. ``slow-k2-defaults``:
     the same at the defaults (32 at once, 2 requests in flight), which score at most 160 a second.

    python bench/judge.py [--rounds 2] [--steps 20] [--part scorer|run|both] [--variants a,b]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
SLOW_S = 0.2
GOAL = 0.9


def instant_gold(prompt_tokens, response_tokens):
    from demos.parity import gold_reward

    return gold_reward(prompt_tokens, response_tokens)


async def slow_gold(prompt_tokens, response_tokens):
    await asyncio.sleep(SLOW_S)
    return instant_gold(prompt_tokens, response_tokens)


def task_samples(paths: dict, count: int, seed: int = 0):
    """``count`` samples of the demo task: its prompts with SFT-like answers, tokenized by the policy."""
    import random

    import numpy as np
    from transformers import AutoTokenizer

    from demos.parity import make_prompt, sft_response
    from protocol.samples import Sample

    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(paths["policy"])
    samples = []
    for i in range(count):
        prompt = make_prompt(rng)
        ids = tokenizer(prompt)["input_ids"]
        response = tokenizer(sft_response(prompt, rng), add_special_tokens=False)["input_ids"] + [2]
        samples.append(Sample(f"s{i}", i, 0, np.array(ids, np.int32), np.array(response, np.int32),
                              np.zeros(len(response), np.float32), "stop"))
    return samples


def scorer_config(paths: dict, judge: bool, worker: int, workers: int):
    from common.config import load_config
    from demos.judge import demo_judges

    judges = demo_judges(paths["judge"]) if judge else []
    cores = "[0, 1]" if workers == 2 else "[1]"
    return load_config(os.path.join(REPO, "configs", "demo-judge.yaml"),
                       [f"models.policy={paths['policy']}", f"data.prompts={paths['prompts']}",
                        f"scorer.judges={json.dumps(judges)}", f"scorer.workers={workers}",
                        f"placement.cores.scorer={cores}",
                        *([] if judge else ["scorer.reward_functions=[{function: judge:instant_gold}]"])])


def score_timed(paths: dict, judge: bool, worker: int, workers: int, count: int, barrier, results) -> None:
    """One scorer's samples/s over ``count`` samples, from when every scorer is ready."""
    import logging

    import torch

    from scorer.main import Scorer

    config = scorer_config(paths, judge, worker, workers)
    cores = config.cores_of("scorer", worker)
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    scorer = Scorer(config, logging.getLogger("bench"), worker)
    samples = task_samples(paths, count, seed=worker)
    scorer.score(samples[:8])  # warm
    barrier.wait()
    started = time.perf_counter()
    for start in range(0, count, 64):
        scorer.score(samples[start:start + 64])
    results.put(time.perf_counter() - started)
    scorer.close()


def scorer_part(paths: dict, rounds: int) -> dict:
    context = multiprocessing.get_context("spawn")
    figures: dict[str, list[float]] = {}
    for _ in range(rounds):
        for judge in (False, True):
            for workers in (1, 2):
                barrier, results = context.Barrier(workers), context.Queue()
                count = 256 // workers
                processes = [context.Process(target=score_timed, args=(paths, judge, w, workers, count, barrier,
                                                                        results)) for w in range(workers)]
                for process in processes:
                    process.start()
                seconds = max(results.get(timeout=600) for _ in processes)
                for process in processes:
                    process.join(timeout=60)
                name = f"{'judge' if judge else 'reference only'}, {workers} scorer{'s' if workers > 1 else ''}"
                figures.setdefault(name, []).append(256 / seconds)
                print(f"  {name}: {256 / seconds:.0f} samples/s", flush=True)
    return {name: statistics.median(values) for name, values in figures.items()}


# a reward of latency L at concurrency C scores at most C / L samples a second: 32 at 200 ms, 160/s,
# under what the demo's rollout generates (~300/s); 128 at once, with the samples to keep them going
CONCURRENT = ["scorer.reward_concurrency=128", "scorer.requests_in_flight=8"]
VARIANTS = {
    "judge-k0": ["buffer.max_staleness=0"],
    "judge-k2": ["buffer.max_staleness=2"],
    "instant-k2": ["buffer.max_staleness=2", "scorer.judges=[]",
                   "scorer.reward_functions=[{function: judge:instant_gold}]", *CONCURRENT],
    "slow-k2": ["buffer.max_staleness=2", "scorer.judges=[]", "scorer.reward_functions=[{function: judge:slow_gold}]",
                *CONCURRENT],
    "slow-k2-defaults": ["buffer.max_staleness=2", "scorer.judges=[]",
                         "scorer.reward_functions=[{function: judge:slow_gold}]"],
}


def run_part(paths: dict, rounds: int, steps: int, variants: list[str]) -> dict:
    from common.runlog import read_metrics
    from demos.judge import demo_judges

    judge = json.dumps(demo_judges(paths["judge"]))
    figures: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for name, overrides in ((name, VARIANTS[name]) for name in variants):
            with tempfile.TemporaryDirectory() as run_dir:
                command = [sys.executable, "-m", "launch.cli", "run", "-c", os.path.join(REPO, "configs",
                                                                                            "demo-judge.yaml"),
                           "--overwrite", "-o", f"run_dir={run_dir}", "-o", f"models.policy={paths['policy']}",
                           "-o", f"data.prompts={paths['prompts']}", "-o", f"scorer.judges={judge}",
                           "-o", f"learner.total_steps={steps}", *[x for o in overrides for x in ("-o", o)]]
                import subprocess

                env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                                                    os.environ.get("PYTHONPATH", "")])}
                result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
                if result.returncode != 0:
                    raise RuntimeError(f"{name}: tether run failed:\n{result.stderr[-3000:]}")
                steps_done = read_metrics(run_dir, "learner")
                rollout = [r for r in read_metrics(run_dir, "rollout0") if r.get("response_tokens")]
                scorer = [r for r in read_metrics(run_dir, "scorer0") if "busy_s" in r]
                span = steps_done[-1]["time"] - steps_done[0]["time"]
                generated = sum(r["response_tokens"] for r in rollout[1:])
                scored_span = scorer[-1]["time"] - scorer[0]["time"]
                run = {"samples_per_s": 64 * (len(steps_done) - 1) / span,
                       "rollout_tokens_per_s": generated / (rollout[-1]["time"] - rollout[0]["time"]),
                       "scorer_busy": sum(r["busy_s"] for r in scorer[1:]) / scored_span}
                for key, value in run.items():
                    figures.setdefault(name, {}).setdefault(key, []).append(value)
                print(f"  {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in run.items()), flush=True)
    return {name: {key: statistics.median(values) for key, values in keys.items()} for name, keys in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="learner.total_steps of each run")
    parser.add_argument("--part", choices=("scorer", "run", "both"), default="both")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of the runs: {', '.join(VARIANTS)}")
    args = parser.parse_args()
    from demos.judge import judge_assets

    paths = judge_assets(__import__("pathlib").Path(REPO) / ".demo", log=lambda *_: None)
    if args.part in ("scorer", "both"):
        print("the judge in a scorer (256 samples, requests of 64):")
        scored = scorer_part(paths, args.rounds)
        for name, value in scored.items():
            print(f"  median {name}: {value:.0f} samples/s")
    if args.part in ("run", "both"):
        print(f"tether run of the judge demo ({args.steps} steps), medians of {args.rounds} rounds:")
        runs = run_part(paths, args.rounds, args.steps, args.variants.split(","))
        for name, figures in runs.items():
            print(f"  {name}: trained {figures['samples_per_s']:.1f} samples/s, rollout "
                  f"{figures['rollout_tokens_per_s']:.0f} tokens/s, scorer busy {figures['scorer_busy']:.0%}")
        for slow in ("slow-k2", "slow-k2-defaults"):
            if slow in runs and "instant-k2" in runs:
                ratio = runs[slow]["rollout_tokens_per_s"] / runs["instant-k2"]["rollout_tokens_per_s"]
                print(f"a reward of {SLOW_S * 1000:.0f} ms a call at k = 2 ({slow}): rollout tokens/s {ratio:.2f}x an "
                      f"instant one's (goal >= {GOAL})")


if __name__ == "__main__":
    main()
