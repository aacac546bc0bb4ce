"""One optimizer step of one or more DeepSpeed engines, guarded: a step whose gradients hold NaN or
inf on any rank is skipped on every rank (weights and optimizer state stay as they were) and
counted, too many in a row stop training; and the step's gradient norm, read where it is true.
The PPO learner and the offline stages (``tether sft``, ``rm``, ``dpo``) step through here alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from training import parallel
from training.deepspeed_engine import skip_step

log = logging.getLogger("learner")


def grad_norm_before_step(engine) -> float | None:
    """The gradient norm where only the gradients tell it: ZeRO-0, whose whole gradients are on
    every parameter until the step clears them. None under ZeRO 1-3 (``grad_norm_after_step``)."""
    if engine.zero_optimization_stage() > 0:
        return None
    grads = [p.grad.detach().float().norm() for p in engine.module.parameters() if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else 0.0


def grad_norm_after_step(engine, before: float | None) -> float:
    """The norm DeepSpeed computed inside ``step()`` (ZeRO 1-3, and bf16 / fp16 at any stage, where
    ``p.grad`` holds a scaled or partial gradient): read before the step it would be the previous
    step's. ``before``: the norm of the plain gradients, for fp32 ZeRO-0, which computes none."""
    norm = engine.get_global_grad_norm()
    if norm is not None:
        return float(norm)
    return before if before is not None else float("nan")


class NonFiniteGradients(FloatingPointError):
    """Optimizer steps kept finding NaN or inf gradients: ``SkippedSteps.limit`` in a row."""


@dataclass
class SkippedSteps:
    """Optimizer steps skipped for non-finite gradients, in all and in a row; ``limit`` in a row
    stops the learner (a model that keeps producing them will not recover by itself)."""
    limit: int
    setting: str = "learner.max_skipped_steps"  # what the limit is called in the error
    total: int = 0
    in_a_row: int = 0


def step_unless_nonfinite(engines: list, skipped: SkippedSteps, where: str) -> bool:
    """At the last micro-batch of a minibatch: step every engine, or, if any rank saw a NaN or inf
    gradient in any of them, step none (``skip_step``: weights and optimizer state stay as they
    were, the gradients are cleared) and count it. Returns whether the step was applied."""
    bad = parallel.any_rank(any(engine.gradient_guard.take() for engine in engines))
    if not bad:
        for engine in engines:
            engine.step()
        skipped.in_a_row = 0
        return True
    for engine in engines:
        skip_step(engine)
    skipped.total += 1
    skipped.in_a_row += 1
    log.warning("non-finite gradients at %s: optimizer step skipped (%d in a row, %d in all)",
                where, skipped.in_a_row, skipped.total)
    if skipped.in_a_row >= skipped.limit:
        raise NonFiniteGradients(f"{skipped.in_a_row} optimizer steps in a row had NaN or inf gradients "
                                 f"({skipped.setting} {skipped.limit}) at {where}")
    return False


def guarded_step(engines: list, skipped: SkippedSteps, where: str) -> float | None:
    """``step_unless_nonfinite`` at an accumulation boundary, and the first engine's gradient norm
    for the step: None when the step was skipped. ``where``: what the warning and the error name
    (``policy version 12``, ``step 40``)."""
    before = grad_norm_before_step(engines[0])
    if not step_unless_nonfinite(engines, skipped, where):
        return None
    return grad_norm_after_step(engines[0], before)
