"""What a healthy PPO-RLHF run looks like (docs/design.md, "What a healthy run shows"), checked
every step, and an alert (a log line and a metric) for each way it goes wrong.

| signal           | healthy                         | alert                                          |
|------------------|---------------------------------|------------------------------------------------|
| kl               | in a band around the target     | above ``kl_budget``; ~0 for ``kl_zero_steps``  |
| response_length  | stable                          | > ``length_spike_ratio`` x baseline while the  |
|                  |                                 | reward is above its baseline: length hacking   |
| entropy          | slowly falling                  | < ``entropy_collapse_ratio`` x baseline        |
| value_loss       | bounded                         | > ``value_loss_factor`` x baseline, or not finite |
| clipfrac         | neither ~0 nor high             | < ``clipfrac_low`` for ``clipfrac_low_steps``; |
|                  |                                 | > ``clipfrac_high`` (learning rate too high)   |
| loss             | finite                          | NaN: the learner checkpoints and stops         |
| behavior_logprob_gap | ~0 (the rollout's logprobs are the learner's for the same weights) | above ``behavior_gap_max``: weight sync or sampling disagree |

Baselines are the means of the first ``warmup_steps`` steps; nothing but NaN alerts before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from common.config import HealthConfig


@dataclass
class Alert:
    name: str
    message: str


@dataclass
class HealthMonitor:
    config: HealthConfig
    _warmup: list[dict] = field(default_factory=list)
    _baseline: dict[str, float] = field(default_factory=dict)
    _kl_zero_run: int = 0
    _clip_low_run: int = 0

    def observe(self, record: dict) -> list[Alert]:
        """One learner step's metrics in, the alerts they raise out."""
        cfg, alerts = self.config, []
        for key in ("policy_loss", "value_loss"):  # no value loss without a critic (critic-free estimators)
            if key in record and not math.isfinite(record[key]):
                alerts.append(Alert("nan_loss", f"{key} is {record[key]}"))
        gap = record.get("behavior_logprob_gap")
        if gap is not None and gap > cfg.behavior_gap_max:
            alerts.append(Alert("behavior_logprob_gap", f"the rollout's logprobs differ from the learner's by up to "
                                                        f"{gap:.3g} for the same weights (> {cfg.behavior_gap_max}): "
                                                        "the engine's weights or sampling settings are not the "
                                                        "learner's, and every importance weight is off"))
        if len(self._warmup) < cfg.warmup_steps:
            self._warmup.append(record)
            if len(self._warmup) == cfg.warmup_steps:
                keys = [k for k in ("reward", "response_length", "entropy", "value_loss") if k in record]
                self._baseline = {k: sum(r[k] for r in self._warmup) / len(self._warmup) for k in keys}
            return alerts

        base = self._baseline
        kl, length, reward = record["kl"], record["response_length"], record["reward"]
        if kl > cfg.kl_budget:
            alerts.append(Alert("kl_above_budget", f"kl {kl:.3f} is above the budget of {cfg.kl_budget}"))
        self._kl_zero_run = self._kl_zero_run + 1 if abs(kl) < cfg.kl_zero_eps else 0
        if self._kl_zero_run >= cfg.kl_zero_steps:
            alerts.append(Alert("kl_stuck_at_zero", f"kl has stayed ~0 for {self._kl_zero_run} steps: "
                                                    "is the policy learning at all?"))
        if length > cfg.length_spike_ratio * base["response_length"] and reward > base["reward"]:
            alerts.append(Alert("length_hacking", f"response length {length:.1f} is over "
                                                  f"{cfg.length_spike_ratio}x its baseline {base['response_length']:.1f} "
                                                  f"while the reward rises ({reward:.3f} > {base['reward']:.3f})"))
        if record["entropy"] < cfg.entropy_collapse_ratio * base["entropy"]:
            alerts.append(Alert("entropy_collapse", f"entropy {record['entropy']:.4f} fell under "
                                                    f"{cfg.entropy_collapse_ratio}x its baseline {base['entropy']:.4f}"))
        if ("value_loss" in base and math.isfinite(record["value_loss"])
                and record["value_loss"] > cfg.value_loss_factor * base["value_loss"]):
            alerts.append(Alert("value_loss_exploding", f"value loss {record['value_loss']:.3g} is over "
                                                        f"{cfg.value_loss_factor}x its baseline {base['value_loss']:.3g}"))
        clipfrac = record["clipfrac"]
        self._clip_low_run = self._clip_low_run + 1 if clipfrac < cfg.clipfrac_low else 0
        if self._clip_low_run >= cfg.clipfrac_low_steps:
            alerts.append(Alert("clipfrac_near_zero", f"clip fraction {clipfrac:.4f} for {self._clip_low_run} steps: "
                                                      "updates too small to matter?"))
        if clipfrac > cfg.clipfrac_high:
            alerts.append(Alert("clipfrac_high", f"clip fraction {clipfrac:.3f} is above {cfg.clipfrac_high}: "
                                                 "the learning rate is likely too high"))
        return alerts
