"""`tether sft`: supervised fine-tuning on demonstrations, InstructGPT's first stage. The loss is
the mean next-token loss over every taught token of a batch (a response, an assistant's turn),
as transformers' ``labels`` loss computes it; the output is an HF causal-LM directory that
``models.policy`` takes as is."""

from __future__ import annotations

import torch

from common import models
from common.config import TetherConfig
from stages import loop
from stages.examples import Example, model_inputs
from stages.losses import token_nll
from training import parallel
from training.lora import with_lora
from training.optimizer_step import SkippedSteps
from training.signals import StopSignal


def nll_sums(module, examples: list[Example], pad_token_id: int,
             processor=None) -> tuple[torch.Tensor, dict[str, float]]:
    """(summed next-token loss over the examples' taught tokens, {"tokens": how many}); a model
    that sees (``processor``) reads their images."""
    inputs, input_ids, loss_mask = model_inputs(examples, pad_token_id, processor, _device(module))
    logits = module(**inputs, use_cache=False).logits
    nll, mask = token_nll(logits, input_ids, loss_mask)
    return (nll * mask).sum(), {"tokens": float(mask.sum())}


def taught_tokens(example: Example) -> int:
    """Its loss tokens: the positions that predict a taught token (the first token has none)."""
    return sum(sum(mask[1:]) for mask in example.loss_masks)


def held_out_loss(module, examples: list[Example], pad_token_id: int, stage: loop.Stage,
                  processor=None) -> dict[str, float]:
    if not examples:
        return {}
    sums = loop.forward_sums(module, examples, lambda m, part: nll_sums(m, part, pad_token_id, processor), stage)
    return {"loss": sums["loss"] / sums["tokens"], "tokens": sums["tokens"]}


def run(config: TetherConfig, fresh: bool = False) -> str:
    """Train ``sft.model`` on ``sft.data``; returns the output directory."""
    from transformers import AutoTokenizer

    stage = loop.start(config, "sft", fresh)
    cfg = stage.cfg
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    processor = loop.processor_of(stage)  # a model that sees: the rows' images too
    train, evaluation = loop.examples_loaded(stage, tokenizer, processor)
    model = with_lora(models.load_causal_lm(cfg.model, cfg.dtype), cfg)
    pad_token_id = models.pad_token_id(model)
    engine = loop.engine_of(model, stage)
    total_steps = loop.total_steps(len(train), stage)
    stage.log.info("sft: %s for %d epoch(s), %d steps of %d examples, ZeRO-%d, %d rank(s)", cfg.model, cfg.epochs,
                   total_steps, cfg.batch_size, cfg.zero_stage, parallel.world_size())
    progress, skipped, stop = loop.Progress(stage, total_steps), SkippedSteps(5), StopSignal()
    for step, epoch, indices, lr in loop.optimizer_steps(engine, stage, len(train)):
        parts = loop.rank_parts(indices, train, stage)
        tokens = sum(taught_tokens(train[int(i)]) for i in indices)
        sums = loop.train_step(engine, parts, train, lambda m, part: nll_sums(m, part, pad_token_id, processor),
                               tokens, skipped, step)
        progress.step(step, epoch, {"loss": sums["loss"] / sums["tokens"], "lr": lr, "grad_norm": sums["grad_norm"],
                                    "tokens": sums["tokens"]}, len(indices))
        if evaluation and loop.evaluate_due(step, len(train), stage):
            progress.held_out(step, held_out_loss(engine.module, evaluation, pad_token_id, stage, processor))
        loop.after_step(engine, stage, step, stop)
    figures = held_out_loss(engine.module, evaluation, pad_token_id, stage, processor) if evaluation else {}
    progress.held_out(total_steps, figures)
    output = loop.save_output(engine, cfg.model, stage, figures)
    stage.log.info("sft: wrote %s (held-out loss %s)", output, f"{figures['loss']:.4f}" if figures else "n/a")
    return output


def _device(module) -> torch.device:
    return next(module.parameters()).device
