"""The staleness bound the learner asks the buffer for: fixed (``buffer.max_staleness: k``) or tuned
as the run goes (``auto``), from the off-policy health of each batch it trains.

Health is read where staleness costs: the importance weights pi_prox / pi_behavior the decoupled
PPO loss multiplies each token's gradient by (``learner.ppo.ppo_policy_loss``). Three figures of
them, each with a target (``buffer.staleness_*``):

- ``behavior_ess``: their effective sample size as a share of the tokens, (sum w)^2 / (n sum w^2)
  (Kong 1992): 1 when every weight is equal, lower as a few tokens carry the batch's gradient;
- ``behavior_truncated_frac``: the share of tokens whose weight ``learner.behavior_weight_cap``
  cuts, where the correction stops being unbiased;
- ``behavior_kl``: KL(behavior || proximal) per token, mean of log pi_behavior - log pi_prox over
  the sampled tokens (the k1 estimate under the behavior policy, which sampled them).

The rule is additive increase, multiplicative decrease (as TCP's congestion window): after
``staleness_raise_after`` healthy steps in a row k rises by one, up to ``staleness_max``; a step
outside any target halves it, down to ``staleness_min``. A raise is slow to take effect (the
batches of the new bound come a step or more later) and cheap to undo; a step over a target means
the batches trained now are already too stale, so the fall is fast. Each change comes with its
reason, for the learner's metrics and log.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.config import BufferConfig


def behavior_health(old_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor,
                    cap: float | None) -> dict[str, float]:
    """The batch's off-policy health. All [B, T]: the proximal and the behavior logprobs of the
    sampled tokens, mask 1 at the policy's tokens. Returns behavior_ess, behavior_truncated_frac
    and behavior_kl (see the module docstring)."""
    tokens = mask > 0
    log_weights = (old_logprobs - behavior_logprobs)[tokens].double()
    if log_weights.numel() == 0:
        return {"behavior_ess": 1.0, "behavior_truncated_frac": 0.0, "behavior_kl": 0.0}
    weights = torch.exp(log_weights - log_weights.max())  # the ratio is scale-free: no overflow
    ess = float(weights.sum() ** 2 / (weights.numel() * (weights ** 2).sum()))
    truncated = float((log_weights > torch.log(torch.tensor(cap, dtype=torch.float64))).double().mean()) if cap else 0.0
    return {"behavior_ess": ess, "behavior_truncated_frac": truncated, "behavior_kl": float(-log_weights.mean())}


@dataclass
class StalenessController:
    """k for the next batches. ``update`` takes a step's statistics and returns the reason when k
    changed (None when not); a fixed bound never changes."""
    cfg: BufferConfig
    k: int = 0
    healthy_steps: int = 0

    def __post_init__(self) -> None:
        self.k = self.cfg.initial_staleness

    @property
    def auto(self) -> bool:
        return self.cfg.max_staleness == "auto"

    def update(self, stats: dict) -> str | None:
        if not self.auto:
            return None
        cfg = self.cfg
        over = [f"{name} {stats[name]:.3g} {sign} {limit:g}" for name, sign, limit, bad in (
            ("behavior_ess", "<", cfg.staleness_ess_min, stats["behavior_ess"] < cfg.staleness_ess_min),
            ("behavior_truncated_frac", ">", cfg.staleness_truncated_max,
             stats["behavior_truncated_frac"] > cfg.staleness_truncated_max),
            ("behavior_kl", ">", cfg.staleness_kl_max, stats["behavior_kl"] > cfg.staleness_kl_max)) if bad]
        if over:
            self.healthy_steps = 0
            lowered = max(cfg.staleness_min, self.k // 2)
            if lowered == self.k:
                return None
            previous, self.k = self.k, lowered
            return f"k {previous} -> {lowered}: {', '.join(over)}"
        self.healthy_steps += 1
        if self.healthy_steps < cfg.staleness_raise_after or self.k >= cfg.staleness_max:
            return None
        self.healthy_steps = 0
        self.k += 1
        return (f"k {self.k - 1} -> {self.k}: {cfg.staleness_raise_after} steps within targets (ess "
                f"{stats['behavior_ess']:.3g} >= {cfg.staleness_ess_min:g}, truncated "
                f"{stats['behavior_truncated_frac']:.3g} <= {cfg.staleness_truncated_max:g}, kl "
                f"{stats['behavior_kl']:.3g} <= {cfg.staleness_kl_max:g})")

    def state_dict(self) -> dict:
        return {"k": self.k, "healthy_steps": self.healthy_steps}

    def load_state_dict(self, state: dict) -> None:
        self.k, self.healthy_steps = int(state["k"]), int(state["healthy_steps"])
