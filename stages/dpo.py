"""`tether dpo`: Direct Preference Optimization (Rafailov et al. 2023) on preference pairs, the
offline alternative to PPO. The frozen reference's log pi_ref(y | x) of every response is computed
once, before training, and the reference freed; chosen and rejected go through the policy in one
forward pass. Metrics as TRL names them: the implicit rewards beta (log pi - log pi_ref) of
chosen and rejected, their margin, and the share of pairs where chosen's is higher (accuracy)."""

from __future__ import annotations

import torch

from common import models
from common.config import TetherConfig
from stages import loop
from stages.examples import Example, model_inputs, rows_of
from stages.losses import dpo_loss, sequence_logprobs
from training import parallel
from training.lora import with_lora
from training.optimizer_step import SkippedSteps
from training.signals import StopSignal


def logprob_sums(module, examples: list[Example], pad_token_id: int, processor=None) -> torch.Tensor:
    """[rows]: log pi(response | prompt) of every row of ``examples`` (chosen, rejected, ...); a
    model that sees (``processor``) reads their images."""
    inputs, input_ids, loss_mask = model_inputs(examples, pad_token_id, processor, next(module.parameters()).device)
    logits = module(**inputs, use_cache=False).logits
    return sequence_logprobs(logits, input_ids, loss_mask)[:rows_of(examples)]  # not a blank image's row


@torch.no_grad()
def reference_logprobs(path: str, dtype: str, examples: list[Example], pad_token_id: int,
                       stage: loop.Stage, processor=None) -> None:
    """Each example's reference logprobs (chosen, rejected), stored on it as ``reference``."""
    reference = models.load_causal_lm(path, dtype).eval().to(parallel.device())
    for part in loop.forward_parts(examples, stage):
        for example, values in zip(part, logprob_sums(reference, part, pad_token_id, processor).view(-1, 2).cpu()):
            example.reference = values
    del reference


def pair_sums(module, examples: list[Example], pad_token_id: int, beta: float,
              processor=None) -> tuple[torch.Tensor, dict]:
    """(summed DPO loss, summed chosen and rejected rewards and correct pairs) of ``examples``."""
    policy = logprob_sums(module, examples, pad_token_id, processor).view(-1, 2)
    reference = torch.stack([example.reference for example in examples]).to(policy.device)
    loss, chosen, rejected = dpo_loss(policy[:, 0], policy[:, 1], reference[:, 0], reference[:, 1], beta)
    return loss.sum(), {"pairs": float(len(examples)), "chosen_reward": float(chosen.sum()),
                        "rejected_reward": float(rejected.sum()), "correct": float((chosen > rejected).sum())}


def figures_of(sums: dict[str, float]) -> dict[str, float]:
    pairs = max(sums["pairs"], 1.0)
    chosen, rejected = sums["chosen_reward"] / pairs, sums["rejected_reward"] / pairs
    return {"loss": sums["loss"] / pairs, "accuracy": sums["correct"] / pairs, "chosen_reward": chosen,
            "rejected_reward": rejected, "margin": chosen - rejected}


def run(config: TetherConfig, fresh: bool = False) -> str:
    """Train ``dpo.model`` on ``dpo.data`` against ``dpo.reference``; returns the output directory."""
    from transformers import AutoTokenizer

    stage = loop.start(config, "dpo", fresh)
    cfg = stage.cfg
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    processor = loop.processor_of(stage)  # a model that sees: the rows' images too (the reference's alike)
    train, evaluation = loop.examples_loaded(stage, tokenizer, processor)
    model = models.load_causal_lm(cfg.model, cfg.dtype)
    pad_token_id = models.pad_token_id(model)
    reference_logprobs(cfg.reference, cfg.dtype, train + evaluation, pad_token_id, stage, processor)
    engine = loop.engine_of(with_lora(model, cfg), stage)
    total_steps = loop.total_steps(len(train), stage)
    stage.log.info("dpo: %s against %s for %d epoch(s), %d steps of %d pairs, beta %g, ZeRO-%d, %d rank(s)",
                   cfg.model, cfg.reference, cfg.epochs, total_steps, cfg.batch_size, cfg.beta, cfg.zero_stage,
                   parallel.world_size())
    progress, skipped, stop = loop.Progress(stage, total_steps), SkippedSteps(5), StopSignal()

    def sums_of(module, part):
        return pair_sums(module, part, pad_token_id, cfg.beta, processor)

    for step, epoch, indices, lr in loop.optimizer_steps(engine, stage, len(train)):
        sums = loop.train_step(engine, loop.rank_parts(indices, train, stage), train, sums_of,
                               len(indices), skipped, step)
        progress.step(step, epoch, {**figures_of(sums), "lr": lr, "grad_norm": sums["grad_norm"]}, len(indices))
        if evaluation and loop.evaluate_due(step, len(train), stage):
            progress.held_out(step, figures_of(loop.forward_sums(engine.module, evaluation, sums_of, stage)))
        loop.after_step(engine, stage, step, stop)
    figures = figures_of(loop.forward_sums(engine.module, evaluation, sums_of, stage)) if evaluation else {}
    progress.held_out(total_steps, figures)
    output = loop.save_output(engine, cfg.model, stage, figures)
    stage.log.info("dpo: wrote %s (held-out preference accuracy %s)", output,
                   f"{figures['accuracy']:.3f}" if figures else "n/a")
    return output
