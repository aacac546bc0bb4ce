"""KL coefficient controllers: the strength of the tether to the reference policy.

Fixed: beta never changes. Adaptive (Ziegler et al. 2019, "Fine-Tuning Language Models from
Human Preferences", section 2.2): a proportional controller that steers the measured KL
towards a target,

    e_t  = clip((KL_t - KL_target) / KL_target, -0.2, 0.2)
    beta <- max(0, beta (1 + K_beta e_t)),   K_beta = n_steps / horizon

where n_steps is the number of samples (or steps, the caller chooses the unit) since the last
update. Both controllers keep their state in a plain dict so a checkpoint restores them exactly.
"""

from __future__ import annotations

import math


def adaptive_kl_coef(kl_coef: float, current_kl: float, target: float, n_steps: int, horizon: float) -> float:
    """One update of the adaptive controller; scalars in, the new coefficient out."""
    if target <= 0 or horizon <= 0:
        raise ValueError(f"target and horizon must be > 0, got target={target}, horizon={horizon}")
    if not math.isfinite(current_kl):
        raise ValueError(f"current_kl must be finite, got {current_kl}")
    proportional_error = min(max((current_kl - target) / target, -0.2), 0.2)
    return max(0.0, kl_coef * (1 + proportional_error * n_steps / horizon))


class FixedKLController:
    """beta stays at its initial value."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """beta follows ``adaptive_kl_coef`` towards ``target`` KL per sequence."""

    def __init__(self, kl_coef: float, target: float, horizon: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value, self.target, self.horizon = float(kl_coef), float(target), float(horizon)
        adaptive_kl_coef(self.value, 0.0, self.target, 0, self.horizon)  # validates target/horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        self.value = adaptive_kl_coef(self.value, current_kl, self.target, n_steps, self.horizon)
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value, self.target, self.horizon = (float(state[k]) for k in ("value", "target", "horizon"))


def make_kl_controller(
    kind: str, kl_coef: float, target: float | None = None, horizon: float | None = None
) -> FixedKLController | AdaptiveKLController:
    """Build a controller by name: ``fixed`` or ``adaptive`` (which needs target and horizon)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target is None or horizon is None:
            raise ValueError("the adaptive KL controller needs kl_target and kl_horizon")
        return AdaptiveKLController(kl_coef, target, horizon)
    raise ValueError(f"kl controller must be 'fixed' or 'adaptive', got {kind!r}")
