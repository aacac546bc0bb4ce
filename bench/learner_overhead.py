"""Learner efficiency: tokens/s of tether's PPO step against a bare torch loop of the same models
on the same tokens, taking turns in one process.

One batch of long-tailed samples (prompts of 6 tokens, responses of 4 to 64, most short) is
trained again and again. Each turn times one whole learner step on it:

- ``bare``: what any PPO step must compute, in plain torch: for the actor and the critic a forward
  pass without gradient over the batch (the proximal logprobs and old values), then for each of
  ``ppo_epochs`` x minibatches a forward and backward pass per micro-batch, gradient clipping and
  an AdamW step. Micro-batches as tether's token budget cuts them (sorted by length, trimmed): the
  best a plain loop does. The loss is the mean token logprob (actor) and mean squared value
  (critic): no PPO math.
- ``tether``: ``learner.step.ppo_step`` on DeepSpeed engines of the same models, with
  ``learner.max_tokens_per_microbatch``;
- ``tether, fixed micro-batches``: the same with ``learner.micro_batch_size`` rows a pass;
- ``before``: the micro-batches of the learner before the token budget: rows in shuffled order,
  ``micro_batch_size`` a pass, every pass as wide as the batch's longest sequence (emulated here
  by leaving ``SequenceBatch.select`` untrimmed and the rows unsorted).

Tokens/s counts each sequence token of the batch once per step (prompt + response, no padding).
The goal is tether >= 80% of bare.

    python bench/learner_overhead.py [--rounds 5] [--hidden 256] [--layers 4] [--budget 512]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

GOAL = 0.80
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def build_models(directory: str, hidden: int, layers: int, max_positions: int = 128) -> tuple[str, str]:
    """A randomly initialised Llama policy and reward model of the demo's vocabulary, of sequences up
    to ``max_positions`` tokens."""
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from demos.parity import build_tokenizer, tiny_llama_config

    torch.manual_seed(0)
    config = tiny_llama_config(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                               num_attention_heads=hidden // 32, num_key_value_heads=hidden // 32,
                               max_position_embeddings=max_positions)
    paths = []
    for name, cls in (("policy", LlamaForCausalLM), ("rm", LlamaForSequenceClassification)):
        path = os.path.join(directory, name)
        tokenizer = build_tokenizer(path)
        cls(config if name == "policy" else type(config)(**{**config.to_dict(), "num_labels": 1})).save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]


def long_tail_samples(count: int, vocab: int, seed: int = 0) -> list:
    """Samples with responses of 4 to 64 tokens, geometric (mean ~14): the long tail."""
    import numpy as np

    from protocol.samples import Sample

    rng = np.random.default_rng(seed)
    samples = []
    for i in range(count):
        length = int(min(64, 4 + rng.geometric(1 / 10)))
        prompt = rng.integers(3, vocab, 6).astype(np.int32)
        response = rng.integers(3, vocab, length).astype(np.int32)
        logprobs = (-rng.random(length) * 3).astype(np.float32)
        sample = Sample(f"s{i}", i, 0, prompt, response, logprobs, "stop")
        sample.ref_logprobs, sample.reward = logprobs.copy(), float(rng.normal())
        samples.append(sample)
    return samples


def bare_step(models: list, optimizers: list, batch, minibatches: list, proximal: list, epochs: int,
              grad_clip: float) -> None:
    """The passes a PPO step needs, in plain torch (see the module's docstring)."""
    import torch

    from common.distributions import logprobs_from_logits
    from common.models import ValueModel
    from common.sequences import gather_response

    def loss_of(model, part):
        critic = isinstance(model, ValueModel)  # which builds no KV cache itself
        out = model(input_ids=part.input_ids, attention_mask=part.attention_mask,
                    **({} if critic else {"use_cache": False})).logits
        if critic:
            return (gather_response(out.squeeze(-1), part.response_positions) ** 2 * part.response_mask).mean()
        logits = gather_response(out, part.response_positions)
        return -(logprobs_from_logits(logits, part.response_tokens) * part.response_mask).mean()

    with torch.no_grad():
        for model in models:
            for rows in proximal:
                loss_of(model, batch.select(rows))
    for _ in range(epochs):
        for parts in minibatches:
            for model, optimizer in zip(models, optimizers):
                for rows in parts:
                    loss_of(model, batch.select(rows)).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)


def untrimmed(self, rows):
    """``SequenceBatch.select`` before the token budget: every column of the batch."""
    from common.sequences import SequenceBatch

    return SequenceBatch(*(getattr(self, name)[rows] for name in self.__dataclass_fields__
                           if name not in ("images", "seen", "image_counts", "blank", "position_ids")))


def unsorted(rows, lengths, cfg, world, *_):
    """``micro_batches_of`` before the token budget: the rows as drawn, ``micro_batch_size`` a pass."""
    return list(rows.split(cfg.micro_batch(world)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--minibatch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4, help="rows a pass of the fixed variants")
    parser.add_argument("--budget", type=int, default=512, help="learner.max_tokens_per_microbatch")
    args = parser.parse_args()

    import torch

    import learner.step
    from common.config import load_config
    from common.models import load_causal_lm, load_critic
    from common.sequences import SequenceBatch, collate
    from demos.parity import VOCAB
    from training import micro_batches
    from training.deepspeed_engine import make_deepspeed_engine
    from training.parallel import init_distributed

    torch.manual_seed(0)
    directory = tempfile.mkdtemp(prefix="tether-bench-learner-")
    policy, rm = build_models(directory, args.hidden, args.layers)
    samples = long_tail_samples(args.batch, len(VOCAB))
    batch = collate(samples, pad_token_id=0)
    tokens = int(batch.lengths.sum())
    # padded passes, as the bare loop's (bench/packing.py measures the packings against each other)
    common = [f"learner.batch_size={args.batch}", f"learner.minibatch_size={args.minibatch}", "learner.ppo_epochs=2",
              "rollout.max_model_len=128", "learner.actor_lr=1e-5", "learner.critic_lr=1e-5", "learner.packing=none"]
    configs = {
        "tether": [*common, f"learner.max_tokens_per_microbatch={args.budget}"],
        "tether, fixed micro-batches": [*common, f"learner.micro_batch_size={args.micro_batch}"],
        "before": [*common, f"learner.micro_batch_size={args.micro_batch}"],
    }
    base = {"run_dir": os.path.join(directory, "run"), "models": {"policy": policy, "reward": rm},
            "data": {"prompts": "/unused"}}
    configs = {name: load_config(None, overrides, base=base) for name, overrides in configs.items()}
    init_distributed(configs["tether"])
    engines = {name: (make_deepspeed_engine(load_causal_lm(policy), 1e-5, config), make_deepspeed_engine(load_critic(rm), 1e-5, config))
               for name, config in configs.items()}
    bare_models = [load_causal_lm(policy).train(), load_critic(rm).train()]
    bare_optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-5, eps=1e-8) for m in bare_models]

    # the bare loop's passes: tether's token-budget micro-batches of the same rows
    cfg = configs["tether"].learner
    shuffle = torch.Generator().manual_seed(0)
    proximal = micro_batches.plan(batch.lengths, None, args.budget)
    minibatches = [[rows[part] for part in micro_batches.plan(batch.lengths[rows], None, args.budget)]
                   for rows in torch.randperm(args.batch, generator=shuffle).split(args.minibatch)]

    def run(name: str) -> float:
        started = time.perf_counter()
        if name == "bare":
            bare_step(bare_models, bare_optimizers, batch, minibatches, proximal, cfg.ppo_epochs, cfg.grad_clip)
        else:
            actor, critic = engines[name]
            select, plan = SequenceBatch.select, learner.step.micro_batches_of
            if name == "before":
                SequenceBatch.select, learner.step.micro_batches_of = untrimmed, unsorted
            try:
                learner.step.ppo_step(actor, critic, samples, batch, configs[name], policy_version=0, kl_coef=0.05)
            finally:
                SequenceBatch.select, learner.step.micro_batches_of = select, plan
        return time.perf_counter() - started

    names = ["bare", *configs]
    for name in names:  # warm-up: first calls allocate and build DeepSpeed's buffers
        run(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        for name in names if round_index % 2 == 0 else reversed(names):
            times[name].append(run(name))
        print(f"round {round_index + 1}: " + ", ".join(f"{name} {times[name][-1]:.2f}s" for name in names), flush=True)

    padded = {"bare / tether": micro_batches.padded_tokens(proximal, batch.lengths),
              "fixed": micro_batches.padded_tokens(micro_batches.plan(batch.lengths, args.micro_batch), batch.lengths),
              "before": args.batch * batch.input_ids.shape[1]}
    print(f"\nmodel: Llama hidden {args.hidden}, {args.layers} layers (actor + critic); batch {args.batch} samples, "
          f"{tokens} tokens (responses 4-64); minibatch {args.minibatch}, 2 epochs; budget {args.budget} tokens; "
          f"{torch.get_num_threads()} threads")
    print("padded tokens a forward pass over the batch computes: " + ", ".join(f"{k} {v}" for k, v in padded.items()))
    bare = sorted(times["bare"])[len(times["bare"]) // 2]
    print(f"{'variant':<30}{'median step s':>15}{'tokens/s':>12}{'of bare':>10}")
    for name in names:
        median = sorted(times[name])[len(times[name]) // 2]
        print(f"{name:<30}{median:>15.3f}{tokens / median:>12.0f}{bare / median:>10.0%}")
    ratio = bare / sorted(times["tether"])[len(times["tether"]) // 2]
    print(f"\ntether / bare: {ratio:.0%} (goal >= {GOAL:.0%}): {'met' if ratio >= GOAL else 'NOT met'}")


if __name__ == "__main__":
    main()
