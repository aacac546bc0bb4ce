"""`tether rm`: the reward model, InstructGPT's second stage. Each prompt's K ranked responses go
through the model in one forward pass, and the loss is the mean over their C(K, 2) pairs of
-log sigmoid(r_w - r_l) (``stages.losses.kwise_ranking_loss``), averaged over prompts. A score is
read as the scorer reads it: the head on the last real token of prompt + response. Calibration
(``rm.calibration``) goes into the output's config.json, where the scorer finds it; the output is
an HF sequence-classification directory that ``models.reward`` takes as is (a family without such a
class, a vision-language model among them: its body's directory with tether's head beside it,
``common.models.ValueModel``; it reads each row's images as the rollout does)."""

from __future__ import annotations

import torch

from common import models
from common.config import TetherConfig
from stages import loop
from stages.examples import Example, model_inputs, rows_of
from stages.losses import kwise_ranking_loss
from training import parallel
from training.lora import is_lora, with_lora
from training.optimizer_step import SkippedSteps
from training.signals import StopSignal


def scores_of(module, examples: list[Example], pad_token_id: int, processor=None) -> torch.Tensor:
    """[rows]: the raw score of every row of ``examples``, in order, from one forward pass (through
    the DeepSpeed engine when training: its forward hooks the backward). Pooled as the scorer
    pools (``scorer.scoring.raw_scores``): the head on each row's last real token. A model that
    sees (``processor``) reads each row's images."""
    device = next(module.parameters()).device
    inputs, _, _ = model_inputs(examples, pad_token_id, processor, device)
    hidden = module(**inputs, output_hidden_states=True).hidden_states[-1]
    rows = rows_of(examples)  # not a blank image's row after them
    last = hidden[torch.arange(rows, device=device), inputs["attention_mask"][:rows].sum(dim=1) - 1]
    return models.classification_head(_model(module))(last).squeeze(-1).float()


def _model(module):
    """The HF model inside a DeepSpeed engine and a peft wrapper."""
    module = getattr(module, "module", module) if type(module).__name__ == "DeepSpeedEngine" else module
    return module.get_base_model() if is_lora(module) else module


def grouped(examples: list[Example], flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``flat`` [rows] as (scores [G, K], ranks [G, K], present [G, K]), K the most responses of any
    of the G examples."""
    most = max(len(example.rows) for example in examples)
    scores = flat.new_zeros((len(examples), most))
    ranks = torch.zeros((len(examples), most), dtype=torch.long)
    present = torch.zeros((len(examples), most), dtype=torch.bool)
    start = 0
    for g, example in enumerate(examples):
        k = len(example.rows)
        scores[g, :k] = flat[start:start + k]
        ranks[g, :k] = torch.tensor(example.ranks)
        present[g, :k] = True
        start += k
    return scores, ranks.to(flat.device), present.to(flat.device)


def ranking_sums(module, examples: list[Example], pad_token_id: int,
                 processor=None) -> tuple[torch.Tensor, dict[str, float]]:
    """(summed per-prompt K-wise loss, {"prompts": prompts with a pair, "pairs", "correct"})."""
    loss, pairs, correct = kwise_ranking_loss(*grouped(examples, scores_of(module, examples, pad_token_id,
                                                                           processor)))
    return loss.sum(), {"prompts": float((pairs > 0).sum()), "pairs": float(pairs.sum()),
                        "correct": float(correct.sum())}


def has_pair(example: Example) -> bool:
    return len(set(example.ranks)) > 1


def held_out_accuracy(module, examples: list[Example], pad_token_id: int,
                      stage: loop.Stage, processor=None) -> dict[str, float]:
    if not examples:
        return {}
    sums = loop.forward_sums(module, examples, lambda m, part: ranking_sums(m, part, pad_token_id, processor),
                             stage)
    return {"accuracy": sums["correct"] / max(sums["pairs"], 1.0), "loss": sums["loss"] / max(sums["prompts"], 1.0),
            "pairs": sums["pairs"]}


@torch.no_grad()
def calibration(module, examples: list[Example], pad_token_id: int, how: str, stage: loop.Stage,
                processor=None) -> dict:
    """The config.json entries that calibrate the model: the mean raw score of the training
    responses (InstructGPT's are the SFT policy's, so the SFT policy scores 0 on average) as the
    offset, and with ``normalize`` their std as the scale."""
    from scorer.scoring import REWARD_OFFSET_KEY, REWARD_SCALE_KEY

    if how == "none":
        return {REWARD_OFFSET_KEY: 0.0, REWARD_SCALE_KEY: 1.0}
    was_training = module.training
    module.eval()
    scores = torch.cat([scores_of(module, part, pad_token_id, processor)
                        for part in loop.forward_parts(examples, stage)])
    module.train(was_training)
    offset, scale = float(scores.mean()), float(scores.std()) if how == "normalize" and len(scores) > 1 else 1.0
    return {REWARD_OFFSET_KEY: offset, REWARD_SCALE_KEY: scale if scale > 0 else 1.0}


def run(config: TetherConfig, fresh: bool = False) -> str:
    """Train ``rm.model`` (a policy: its body, a new score head) on ``rm.data``; returns the output."""
    from transformers import AutoTokenizer

    stage = loop.start(config, "rm", fresh)
    cfg = stage.cfg
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    processor = loop.processor_of(stage)  # a model that sees: the rows' images too
    train, evaluation = loop.examples_loaded(stage, tokenizer, processor)
    model = models.load_reward_model(cfg.model, cfg.dtype, tokenizer)
    pad_token_id = models.pad_token_id(model)
    head = models.classification_head(model)
    head_name = next(name for name, module in model.named_modules() if module is head)
    model = with_lora(model, cfg, exclude=[head_name])
    head.requires_grad_(True)  # new: it trains whole, also beside LoRA adapters
    engine = loop.engine_of(model, stage)
    total_steps = loop.total_steps(len(train), stage)
    stage.log.info("rm: %s for %d epoch(s), %d steps of %d rankings (K %d to %d), ZeRO-%d, %d rank(s)", cfg.model,
                   cfg.epochs, total_steps, cfg.batch_size, min(len(e.rows) for e in train),
                   max(len(e.rows) for e in train), cfg.zero_stage, parallel.world_size())
    progress, skipped, stop = loop.Progress(stage, total_steps), SkippedSteps(5), StopSignal()
    for step, epoch, indices, lr in loop.optimizer_steps(engine, stage, len(train)):
        prompts = sum(has_pair(train[int(i)]) for i in indices)
        if not prompts:
            continue  # every ranking in the batch is a tie: nothing to learn
        sums = loop.train_step(engine, loop.rank_parts(indices, train, stage), train,
                               lambda m, part: ranking_sums(m, part, pad_token_id, processor), prompts, skipped, step)
        progress.step(step, epoch, {"loss": sums["loss"] / max(sums["prompts"], 1.0), "lr": lr,
                                    "accuracy": sums["correct"] / max(sums["pairs"], 1.0),
                                    "grad_norm": sums["grad_norm"], "pairs": sums["pairs"]}, len(indices))
        if evaluation and loop.evaluate_due(step, len(train), stage):
            progress.held_out(step, held_out_accuracy(engine.module, evaluation, pad_token_id, stage, processor))
        loop.after_step(engine, stage, step, stop)
    figures = held_out_accuracy(engine.module, evaluation, pad_token_id, stage, processor) if evaluation else {}
    progress.held_out(total_steps, figures)
    calibrated = calibration(engine.module, train, pad_token_id, cfg.calibration, stage, processor)
    stage.log.info("rm: calibration %s", calibrated)
    output = loop.save_output(engine, cfg.model, stage, {**figures, **calibrated}, calibrated)
    stage.log.info("rm: wrote %s (held-out pair accuracy %s)", output,
                   f"{figures['accuracy']:.3f}" if figures else "n/a")
    return output
