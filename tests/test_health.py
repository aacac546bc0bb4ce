"""The health monitor on synthetic metric streams: silent on a healthy run, each alert on its cue."""

import math

import pytest

from common.config import HealthConfig
from learner.health import HealthMonitor


def healthy(step):
    """A run as docs/design.md describes a healthy one: reward slowly rising, kl in a band, length stable,
    entropy slowly falling, value loss bounded, some clipping."""
    return {"reward": 0.1 * step, "kl": 2.0 + 0.5 * math.sin(step), "response_length": 20 + (step % 3),
            "entropy": 2.0 - 0.01 * step, "value_loss": 1.0 + 0.1 * math.cos(step), "clipfrac": 0.05,
            "policy_loss": -0.01}


def alerts_for(records):
    monitor = HealthMonitor(HealthConfig())
    return [{alert.name for alert in monitor.observe(record)} for record in records]


def test_a_healthy_run_raises_nothing():
    assert all(not fired for fired in alerts_for([healthy(step) for step in range(60)]))


@pytest.mark.parametrize("alert, change", [
    ("kl_above_budget", {"kl": 25.0}),
    ("length_hacking", {"response_length": 40.0, "reward": 5.0}),
    ("entropy_collapse", {"entropy": 0.05}),
    ("value_loss_exploding", {"value_loss": 500.0}),
    ("clipfrac_high", {"clipfrac": 0.35}),
    ("nan_loss", {"policy_loss": float("nan")}),
    ("behavior_logprob_gap", {"behavior_logprob_gap": 1.2}),  # what a tied head left stale showed (issue 10)
])
def test_each_alert_fires_on_its_cue(alert, change):
    records = [healthy(step) for step in range(10)] + [{**healthy(10), **change}]
    fired = alerts_for(records)
    assert alert in fired[-1] and not any(fired[:-1])


def test_length_without_reward_gain_is_not_hacking():
    records = [healthy(step) for step in range(10)] + [{**healthy(10), "response_length": 40.0, "reward": -1.0}]
    assert "length_hacking" not in alerts_for(records)[-1]


def test_kl_stuck_at_zero_and_clipfrac_near_zero_need_a_run_of_steps():
    stuck = [{**healthy(step), "kl": 0.0, "clipfrac": 0.0} for step in range(3, 12)]
    fired = alerts_for([healthy(step) for step in range(3)] + stuck)
    # warm-up of 3 steps, then 5 steps in a row before either alert
    assert not any(fired[:7])
    assert {"kl_stuck_at_zero", "clipfrac_near_zero"} <= fired[7]


def test_thresholds_are_config():
    monitor = HealthMonitor(HealthConfig(kl_budget=1.0, warmup_steps=1))
    monitor.observe(healthy(0))
    assert [a.name for a in monitor.observe(healthy(1))] == ["kl_above_budget"]


def test_a_logprob_gap_alerts_from_the_first_step_and_not_when_unmeasured():
    monitor = HealthMonitor(HealthConfig())
    assert [a.name for a in monitor.observe({**healthy(0), "behavior_logprob_gap": 0.9})] == ["behavior_logprob_gap"]
    assert monitor.observe({**healthy(1), "behavior_logprob_gap": None}) == []
    assert monitor.observe({**healthy(2), "behavior_logprob_gap": 3e-6}) == []
