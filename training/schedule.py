"""The learning-rate schedule: a factor on ``actor_lr`` / ``critic_lr`` per learner step (on a stage's
``lr`` per optimizer step).

Linear warm-up over ``warmup_steps`` steps (step ``s`` < warm-up: ``(s + 1) / warmup_steps``), then
``constant``, ``linear`` or ``cosine`` decay from 1 to ``min_ratio`` at the last step:
``progress = (s - warmup_steps) / (total_steps - warmup_steps - 1)``, linear ``min + (1 - min)(1 -
progress)``, cosine ``min + (1 - min)(1 + cos(pi progress)) / 2``. A step is one policy version.
"""

from __future__ import annotations

import math
from typing import Literal

Schedule = Literal["constant", "linear", "cosine"]


def lr_factor(step: int, total_steps: int, warmup_steps: int = 0, schedule: Schedule = "constant",
              min_ratio: float = 0.0) -> float:
    """Factor on the base learning rate for learner step ``step`` (0-based: the step that makes
    policy version ``step + 1``)."""
    if step < 0 or total_steps < 1:
        raise ValueError(f"step {step} of {total_steps}: need step >= 0 and total_steps >= 1")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps - 1))  # 1 at the last step
    if schedule == "linear":
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr schedule must be constant, linear or cosine, got {schedule!r}")


def set_lr(engine, lr: float) -> None:
    """Every parameter group of a DeepSpeed engine's optimizer (ZeRO's wrapper passes them on)."""
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
