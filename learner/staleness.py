"""The staleness bound the learner asks the buffer for: fixed (``buffer.max_staleness: k``) or tuned
as the run goes (``auto``), from the off-policy health of each batch it trains.

Health is read where staleness costs: the importance weights pi_prox / pi_behavior the decoupled
PPO loss multiplies each token's gradient by (``learner.ppo.ppo_policy_loss``). Three figures of
them, each with a target (``buffer.auto_staleness.*``):

- ``behavior_ess``: their effective sample size as a share of the tokens, (sum w)^2 / (n sum w^2)
  (Kong 1992): 1 when every weight is equal, lower as a few tokens carry the batch's gradient;
- ``behavior_truncated_frac``: the share of tokens whose weight ``learner.behavior_weight_cap``
  cuts, where the correction stops being unbiased;
- ``behavior_kl``: KL(behavior || proximal) per token, mean of log pi_behavior - log pi_prox over
  the sampled tokens (the k1 estimate under the behavior policy, which sampled them).

The rule is additive increase, multiplicative decrease (as TCP's congestion window): when the
mean health of ``auto_staleness.raise_after`` steps at a bound is within every target k rises by one,
up to ``auto_staleness.max``; a mean outside any target halves it, down to ``auto_staleness.min``. Until the
first fall a raise doubles k instead (TCP's slow start): a task where every bound is healthy (the
long-tail demo) reaches k = 8 in 9 steps rather than 21, which over a 40-step run was the 12%
of throughput auto lost to the best fixed k (docs/benchmarks.md). Health
measured at k says little of k + 1 (at k = 0 it is perfect whatever k = 1 would do), so after a
fall the next raise waits twice as long (at most 16 x ``auto_staleness.raise_after``), and a raise
that holds (its bound earns a raise in turn) halves the wait again: a run where a higher bound keeps hurting probes it less and
less often (the demo at a raised learning rate, docs/benchmarks.md). A raise is slow to take effect (the
batches of the new bound come a step or more later) and cheap to undo; health over a target means
the batches trained now are already too stale, so the fall is fast. Each change comes with its
reason, for the learner's metrics and log.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


HEALTH = (("behavior_ess", "<", "ess_min"), ("behavior_truncated_frac", ">", "truncated_max"),
          ("behavior_kl", ">", "kl_max"))


@dataclass
class StalenessController:
    """k for the next batches. ``update`` takes a step's statistics and returns the reason when k
    changed (None when not); a fixed bound never changes. The health compared with the targets is
    the mean over the steps since k last changed, at most ``auto_staleness.raise_after`` of them and at
    least 2 before a fall: one batch's spike (measured on the demo at k = 1: behavior_kl 0.038 on
    one step, 0.007 the median) is not a trend."""
    cfg: BufferConfig
    k: int = 0
    window: list = field(default_factory=list)  # health of the last steps at this bound, newest last
    steps: int = 0  # steps trained since k last changed
    patience: int = 0  # steps at a bound before a raise: auto_staleness.raise_after, doubled by each fall
    fallen: bool = False  # a fall ends the slow start: raises add one from then on
    raised: bool = False  # the last change was a raise: the next raise means it held

    def __post_init__(self) -> None:
        self.k, self.patience = self.cfg.initial_staleness, self.cfg.auto_staleness.raise_after

    @property
    def auto(self) -> bool:
        return self.cfg.max_staleness == "auto"

    def update(self, stats: dict) -> str | None:
        if not self.auto:
            return None
        auto = self.cfg.auto_staleness
        base = auto.raise_after
        self.steps += 1
        self.window = [*self.window, {name: float(stats[name]) for name, _, _ in HEALTH}][-base:]
        mean = {name: sum(step[name] for step in self.window) / len(self.window) for name, _, _ in HEALTH}
        over = [f"{name} {mean[name]:.3g} {sign} {getattr(auto, limit):g}" for name, sign, limit in HEALTH
                if (mean[name] < getattr(auto, limit) if sign == "<" else mean[name] > getattr(auto, limit))]
        steps = f"mean of {len(self.window)} step{'s' if len(self.window) > 1 else ''}"
        if over:
            lowered = max(auto.min, self.k // 2)
            if len(self.window) < min(2, base) or lowered == self.k:
                return None
            # health at a bound says nothing of the next one up (at k = 0 it is perfect): a raise that
            # fell is tried again only after twice as long
            previous, self.k, self.window, self.steps, self.fallen, self.raised = self.k, lowered, [], 0, True, False
            self.patience = min(16 * base, 2 * self.patience)
            return f"k {previous} -> {lowered}: {', '.join(over)} ({steps}); next raise after {self.patience} steps"
        if self.steps < self.patience or len(self.window) < base or self.k >= auto.max:
            return None
        previous, self.window, self.steps = self.k, [], 0
        self.k = self.k + 1 if self.fallen else min(auto.max, max(self.k + 1, 2 * self.k))
        if self.raised:  # the bound the last raise reached held: the wait it was given halves
            self.patience = max(base, self.patience // 2)
        self.raised = True
        return (f"k {previous} -> {self.k}: within targets ({steps}: ess {mean['behavior_ess']:.3g} >= "
                f"{auto.ess_min:g}, truncated {mean['behavior_truncated_frac']:.3g} <= "
                f"{auto.truncated_max:g}, kl {mean['behavior_kl']:.3g} <= {auto.kl_max:g})")

    def state_dict(self) -> dict:
        return {"k": self.k, "window": self.window, "steps": self.steps, "patience": self.patience,
                "fallen": self.fallen, "raised": self.raised}

    def load_state_dict(self, state: dict) -> None:
        self.k, self.window = int(state["k"]), list(state["window"])
        self.steps, self.patience = int(state["steps"]), int(state["patience"])
        self.fallen, self.raised = bool(state["fallen"]), bool(state["raised"])
