"""Packed and prefix-shared passes: the learner's PPO step and the scorer's passes with
``packing`` none, pack and tree, taking turns in one process, on three tasks of groups of 4:

- ``long-tail``: the long-tail demo's shape, prompts of 6 tokens and responses of 4 to 64 (most short);
- ``agent``: the agent demo's shape with 4 episodes a prompt: a prompt of 20 tokens, then 1 to 3
  turns of a 16-token tool call, the tool's 6 tokens (masked: the environment's) and a 6-token answer;
- ``episode``: a 160-token prompt (tool schemas, instructions) and 4 responses of 40 to 150 tokens.

The packings as the learner and the scorer run them (``learner.main.packing_taken``,
``common.packing.checked``: on SDPA, attention row by row, ``segment_attention``), and ``tree-dense``:
the tree in packed rows of dense 4-D masks, what a model off SDPA runs.

Each turn times one whole learner step (``learner.step.ppo_step`` on DeepSpeed engines of the same
Llama actor and critic, one engine pair per packing, the same weights) and one scorer pass (the
reference's logprobs and the reward model's scores, ``scorer.scoring``) on the task's batch. It
prints trained tokens/s (the policy's response tokens a step trains, as the learner's metrics count
them) and every token/s (prompt + response). Then, in a process of its own (``--memory``), the
memory a step adds at its peak: the process's resident memory sampled every 2 ms, glibc told to map
each block of 128 KiB or more on its own, so that a freed tensor leaves it. The goal: tree >= 1.5x
none in the learner's trained tokens/s on the episode task.

    python bench/packing.py [--rounds 3] [--tasks long-tail,agent,episode] [--hidden 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import subprocess
import threading
import time

GOAL = 1.5
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from common.packing import PACKINGS  # noqa: E402 - the repository on the path first

# each packing as the learner and scorer run it (a model on SDPA: ``common.packing.segment_attention``),
# and a tree of dense 4-D masks (the layout a model off SDPA gets, and tether's before segments)
VARIANTS = (*PACKINGS, "tree-dense")
PACKING_OF = {"tree-dense": "tree"}


def task_samples(task: str, prompts: int, vocab: int, seed: int = 0) -> list:
    """``prompts`` groups of 4 samples of ``task`` (see the module's docstring), scored at random."""
    import numpy as np

    from protocol.samples import Sample

    rng = np.random.default_rng(seed)

    def tokens(n):
        return rng.integers(3, vocab, n).astype(np.int32)

    samples = []
    for p in range(prompts):
        prompt = tokens({"long-tail": 6, "agent": 20, "episode": 160}[task])
        for _ in range(4):
            mask = None
            if task == "long-tail":
                response = tokens(int(min(64, 4 + rng.geometric(1 / 10))))
            elif task == "episode":
                response = tokens(int(rng.integers(40, 151)))
            else:  # turns of a call, the tool's answer (the environment's tokens) and an answer
                turns = int(rng.integers(1, 4))
                parts, masks = [], []
                for _ in range(turns):
                    parts += [tokens(16), tokens(6), tokens(6)]
                    masks += [np.ones(16, np.uint8), np.zeros(6, np.uint8), np.ones(6, np.uint8)]
                response, mask = np.concatenate(parts), np.concatenate(masks)
            logprobs = (-rng.random(len(response)) * 3).astype(np.float32)
            sample = Sample(f"s{len(samples)}", p, 0, prompt, response, logprobs, "stop", loss_mask=mask)
            sample.ref_logprobs, sample.reward = logprobs.copy(), float(rng.normal())
            samples.append(sample)
    return samples


class PeakMemory:  # psutil: a dependency of tether's (the scorer's memory check)
    """The process's resident memory at its highest while in the block, less what it was before."""

    def __enter__(self):
        import psutil

        self.process, self.stop = psutil.Process(), threading.Event()
        self.before = self.peak = self.process.memory_info().rss
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        while not self.stop.wait(0.002):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.grown = self.peak - self.before


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tasks", default="long-tail,agent,episode")
    parser.add_argument("--prompts", type=int, default=16, help="prompts a batch (4 responses each)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--minibatch", type=int, default=16)
    parser.add_argument("--memory", action="store_true", help="the peak memory of each variant alone (what the "
                        "timed run starts in a process of its own at its end)")
    args = parser.parse_args()
    if args.memory and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # glibc serves large blocks from memory it keeps after a free unless each is mapped on its own:
        # then resident memory falls when a tensor is freed, and its peak in a step is the step's. Every
        # block mapped makes each step slower: the timed run leaves glibc as it is
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})

    import torch

    import learner.step
    from bench.learner_overhead import build_models
    from common.config import SamplingConfig, load_config
    from common.models import load_causal_lm, load_critic, load_reward_model
    from common.packing import checked, segmented
    from learner.main import packing_taken
    from common.sequences import collate
    from demos.parity import VOCAB
    from scorer.scoring import reference_logprobs, reward_scores
    from training.deepspeed_engine import make_deepspeed_engine
    from training.micro_batches import pass_shares
    from training.parallel import init_distributed

    torch.manual_seed(0)
    directory = tempfile.mkdtemp(prefix="tether-bench-packing-")
    policy, rm = build_models(directory, args.hidden, args.layers, max_positions=512)
    batch_size = 4 * args.prompts
    common = [f"learner.batch_size={batch_size}", f"learner.minibatch_size={args.minibatch}", "learner.ppo_epochs=2",
              "rollout.max_model_len=512", "learner.actor_lr=1e-5", "learner.critic_lr=1e-5"]
    base = {"run_dir": os.path.join(directory, "run"), "models": {"policy": policy, "reward": rm},
            "data": {"prompts": "/unused"}}
    log = logging.getLogger("bench")
    configs = {variant: load_config(None, [*common, f"learner.packing={PACKING_OF.get(variant, variant)}"], base=base)
               for variant in VARIANTS}
    init_distributed(configs["none"])
    engines = {variant: (make_deepspeed_engine(load_causal_lm(policy), 1e-5, config),
                         make_deepspeed_engine(load_critic(rm), 1e-5, config)) for variant, config in configs.items()}
    for variant, pair in engines.items():  # as the learner takes its packing
        configs[variant] = packing_taken(configs[variant], list(pair), log)
        if variant == "tree-dense":
            for engine in pair:
                segmented(engine, False)
    reference = load_causal_lm(policy).eval()
    reward_model = load_reward_model(rm, "float32", None, new_head=False).eval()
    for model, what in ((reference, "the reference"), (reward_model, "the reward model")):
        checked(model, "tree", 512, log, what)
    sampling = SamplingConfig()

    def learner_step(variant, samples, batch):
        actor, critic = engines[variant]
        learner.step.ppo_step(actor, critic, samples, batch, configs[variant], policy_version=0, kl_coef=0.05)

    def scorer_pass(variant, samples, batch):
        packing = PACKING_OF.get(variant, variant)
        for model in (reference, reward_model):
            segmented(model, variant in ("pack", "tree"))
        reference_logprobs(reference, samples, 0, sampling, packing=packing, max_tokens=4096)
        reward_scores(reward_model, samples, 0, packing=packing, max_tokens=4096)

    print(f"model: Llama hidden {args.hidden}, {args.layers} layers (actor + critic, reference + reward model); "
          f"{args.prompts} prompts x 4 a batch, minibatch {args.minibatch}, 2 epochs; {torch.get_num_threads()} "
          "threads", flush=True)
    results = {}
    for task in args.tasks.split(","):
        samples = task_samples(task, args.prompts, len(VOCAB))
        batch = collate(samples, pad_token_id=0)
        trained = int(batch.response_mask.sum())
        every = int(batch.lengths.sum())
        shares = pass_shares(batch.input_ids, batch.lengths, args.minibatch, None)
        print(f"\n{task}: {trained} trained tokens, {every} tokens a batch; padding {shares['padding_share']:.0%} of "
              f"padded passes, repeated prefixes {shares['prefix_share']:.0%} of the tokens", flush=True)
        for part, work in (("learner", learner_step), ("scorer", scorer_pass)):
            for variant in VARIANTS:  # warm-up: the first calls allocate and build DeepSpeed's buffers
                work(variant, samples, batch)
            if args.memory:
                grown = {}
                for variant in VARIANTS:
                    with PeakMemory() as peak:
                        work(variant, samples, batch)
                    grown[variant] = peak.grown / 2**20
                print(f"  {part:<8} peak MiB a step adds: " + ", ".join(f"{v} {grown[v]:.0f}" for v in VARIANTS),
                      flush=True)
                continue
            times = {variant: [] for variant in VARIANTS}
            for round_index in range(args.rounds):
                for variant in VARIANTS if round_index % 2 == 0 else reversed(VARIANTS):
                    started = time.perf_counter()
                    work(variant, samples, batch)
                    times[variant].append(time.perf_counter() - started)
                print(f"  {part} round {round_index + 1}: "
                      + ", ".join(f"{v} {times[v][-1]:.2f}s" for v in VARIANTS), flush=True)
            results[task, part] = {v: median(times[v]) for v in VARIANTS}
            tokens = trained if part == "learner" else every
            label = "trained tokens/s" if part == "learner" else "tokens/s"
            print(f"  {part:<8}{'packing':<11}{'median s':>10}{label:>18}{'of none':>9}")
            none_s = results[task, part]["none"]
            for variant in VARIANTS:
                seconds = results[task, part][variant]
                print(f"  {'':<8}{variant:<11}{seconds:>10.3f}{tokens / seconds:>18,.0f}{none_s / seconds:>8.2f}x",
                      flush=True)
    if ("episode", "learner") in results:
        ratio = results["episode", "learner"]["none"] / results["episode", "learner"]["tree"]
        print(f"\nepisode task, learner: tree / none {ratio:.2f}x trained tokens/s (goal >= {GOAL}x): "
              f"{'met' if ratio >= GOAL else 'NOT met'}", flush=True)
    if not args.memory:
        print("\nthe peak memory of each, in a process of its own (bench/packing.py --memory):", flush=True)
        ranks = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # this process's, still held
        subprocess.run([sys.executable, *sys.argv, "--memory"], check=True,
                       env={key: value for key, value in os.environ.items() if key not in ranks})


if __name__ == "__main__":
    main()
