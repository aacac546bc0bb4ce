"""The PPO-RLHF math core against hand-computed vectors (worked by hand in the comments)."""

import copy
import math

import pytest
import torch

from learner import ppo
from learner.kl_control import AdaptiveKLController, FixedKLController, adaptive_kl_coef, make_kl_controller


def t(values, **kwargs):
    return torch.tensor(values, dtype=torch.float32, **kwargs)


def assert_close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual.detach().float(), t(expected), atol=atol, rtol=0)


# Two rows, the second one shorter: padding sits in the middle of the batch tensor.
MASK = t([[1, 1, 1], [1, 1, 0]])


# --------------------------------------------------------------------------- KL and rewards


def test_kl_estimators_by_hand():
    logprobs, ref = t([[-1.2]]), t([[-1.6]])
    # log r = log(pi_ref / pi) = -0.4
    assert ppo.kl_per_token(logprobs, ref, "k1").item() == pytest.approx(0.4, abs=1e-6)
    assert ppo.kl_per_token(logprobs, ref, "k2").item() == pytest.approx(0.08, abs=1e-6)
    assert ppo.kl_per_token(logprobs, ref, "k3").item() == pytest.approx(math.exp(-0.4) - 1 + 0.4, abs=1e-6)
    with pytest.raises(ValueError, match="k4"):
        ppo.kl_per_token(logprobs, ref, "k4")


def test_kl_is_zero_when_policy_equals_reference():
    logprobs = t([[-0.3, -2.0]])
    for estimator in ppo.KL_ESTIMATORS:
        assert ppo.kl_per_token(logprobs, logprobs.clone(), estimator).abs().max().item() == 0.0


def test_token_rewards_worked_example_from_the_design_notes():
    # logprobs -1.2 vs -1.6 with beta 0.05 gives a penalty of -0.02 on every token;
    # the RM score lands on the last real token of each row (row 1 has length 2).
    logprobs = t([[-1.2, -1.2, -1.2], [-1.2, -1.2, 7.0]])
    ref = t([[-1.6, -1.6, -1.6], [-1.6, -1.6, 3.0]])
    rewards, kl = ppo.token_rewards(logprobs, ref, t([1.0, -0.5]), MASK, kl_coef=0.05)
    assert_close(rewards, [[-0.02, -0.02, 0.98], [-0.02, -0.52, 0.0]], atol=1e-6)
    assert_close(kl, [[0.4, 0.4, 0.4], [0.4, 0.4, 0.0]], atol=1e-6)


def test_token_rewards_clip_scores_and_penalise_truncation():
    zeros = torch.zeros(2, 3)
    rewards, _ = ppo.token_rewards(
        zeros, zeros, t([5.0, -5.0]), MASK, kl_coef=0.1,
        truncated=torch.tensor([True, False]), truncation_penalty=-1.0, score_clip=2.0,
    )
    # row 0: clip(5) = 2, truncated -> 2 - 1 = 1 at t=2; row 1: clip(-5) = -2 at t=1
    assert_close(rewards, [[0, 0, 1.0], [0, -2.0, 0]], atol=1e-6)


def test_token_rewards_carry_no_gradient_into_reference_or_policy():
    logprobs = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    ref = t([[-1.5] * 3] * 2, requires_grad=True)
    rewards, _ = ppo.token_rewards(logprobs, ref, t([1.0, 1.0]), MASK, kl_coef=0.1)
    assert not rewards.requires_grad


def test_running_moments_normalise_and_round_trip_through_a_checkpoint():
    moments = ppo.RunningMoments()
    moments.update(t([1.0, 2.0, 3.0]))
    moments.update(t([4.0, 5.0]))
    # all five scores: mean 3, unbiased variance 10 / 4 = 2.5
    assert moments.mean == pytest.approx(3.0)
    assert moments.std == pytest.approx(math.sqrt(2.5))
    assert ppo.RunningMoments().std == 1.0  # no data yet: identity scale
    normalised = moments.normalize(t([3.0, 3.0 + math.sqrt(2.5)]))
    assert normalised.tolist() == pytest.approx([0.0, 1.0], abs=1e-6)
    restored = ppo.RunningMoments()
    restored.load_state_dict(moments.state_dict())
    assert restored.normalize(t([5.0])).item() == pytest.approx(moments.normalize(t([5.0])).item())


# --------------------------------------------------------------------------- KL controllers


def test_fixed_kl_controller_never_moves():
    controller = FixedKLController(0.05)
    assert controller.update(current_kl=100.0, n_steps=1000) == 0.05


def test_adaptive_kl_controller_by_hand():
    # error = clip((12 - 6) / 6, -0.2, 0.2) = 0.2; beta = 0.1 * (1 + 0.2 * 256 / 10000)
    assert adaptive_kl_coef(0.1, 12.0, 6.0, 256, 10000) == pytest.approx(0.1 * (1 + 0.2 * 0.0256))
    # error = (6.6 - 6) / 6 = 0.1 inside the clip
    assert adaptive_kl_coef(0.1, 6.6, 6.0, 100, 1000) == pytest.approx(0.1 * (1 + 0.1 * 0.1))
    # KL far below target: error -0.2; a huge step would go negative, beta floors at 0
    assert adaptive_kl_coef(0.1, 0.0, 6.0, 100, 1000) == pytest.approx(0.1 * 0.98)
    assert adaptive_kl_coef(0.1, 0.0, 6.0, 100, 10) == 0.0


def test_adaptive_controller_state_round_trip():
    controller = make_kl_controller("adaptive", 0.2, target=6.0, horizon=1000)
    controller.update(12.0, 500)
    assert controller.value == pytest.approx(0.2 * 1.1)
    restored = AdaptiveKLController(1.0, 1.0, 1.0)
    restored.load_state_dict(controller.state_dict())
    assert restored.update(3.0, 100) == controller.update(3.0, 100)
    with pytest.raises(ValueError, match="kl_target"):
        make_kl_controller("adaptive", 0.2)
    with pytest.raises(ValueError, match="pid"):
        make_kl_controller("pid", 0.2)


# --------------------------------------------------------------------------- GAE


def test_gae_by_hand():
    # gamma 0.9, lambda 0.8: t=2 delta = 1 - 0.7 = 0.3
    # t=1 delta = 0.9 * 0.7 - 0.6 = 0.03, A = 0.03 + 0.72 * 0.3 = 0.246
    # t=0 delta = 0.9 * 0.6 - 0.5 = 0.04, A = 0.04 + 0.72 * 0.246 = 0.21712
    rewards, values = t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]])
    advantages, returns = ppo.gae_advantages(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    assert_close(advantages, [[0.21712, 0.246, 0.3]], atol=1e-6)
    assert_close(returns, [[0.71712, 0.846, 1.0]], atol=1e-6)


def test_gae_right_and_left_padding_give_the_same_answer_as_no_padding():
    rewards, values = t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]])
    reference, _ = ppo.gae_advantages(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    # right padding with junk values/rewards after the end, in a batch with a full row
    rewards_rp = t([[0.0, 0.0, 1.0, 9.0, 9.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    values_rp = t([[0.5, 0.6, 0.7, 9.0, 9.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    mask_rp = t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    adv_rp, ret_rp = ppo.gae_advantages(rewards_rp, values_rp, mask_rp, gamma=0.9, lam=0.8)
    assert adv_rp[0, :3].tolist() == pytest.approx(reference[0].tolist(), abs=1e-6)
    assert adv_rp[0, 3:].tolist() == [0.0, 0.0] and ret_rp[0, 3:].tolist() == [0.0, 0.0]
    # left padding (a left-padded prompt region in front of the response)
    rewards_lp = t([[5.0, 5.0, 0.0, 0.0, 1.0]])
    values_lp = t([[3.0, 3.0, 0.5, 0.6, 0.7]])
    adv_lp, _ = ppo.gae_advantages(rewards_lp, values_lp, t([[0, 0, 1, 1, 1]]), gamma=0.9, lam=0.8)
    assert adv_lp[0, 2:].tolist() == pytest.approx(reference[0].tolist(), abs=1e-6)
    assert adv_lp[0, :2].tolist() == [0.0, 0.0]


def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value():
    torch.manual_seed(0)
    rewards, values = torch.randn(4, 6), torch.randn(4, 6)
    mask = t([[1] * 6, [1, 1, 1, 0, 0, 0], [1] * 5 + [0], [1, 0, 0, 0, 0, 0]])
    advantages, returns = ppo.gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    reward_to_go = torch.flip(torch.cumsum(torch.flip(rewards * mask, [1]), 1), [1])
    assert torch.allclose(advantages, (reward_to_go - values) * mask, atol=1e-5)
    assert torch.allclose(returns, reward_to_go * mask, atol=1e-5)


def test_gae_does_not_backpropagate_into_values():
    values = torch.zeros(1, 3, requires_grad=True)
    advantages, returns = ppo.gae_advantages(torch.ones(1, 3), values, torch.ones(1, 3))
    assert not advantages.requires_grad and not returns.requires_grad


# --------------------------------------------------------------------------- masked statistics


def test_masked_mean_and_var_ignore_padding():
    values = t([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])
    assert ppo.masked_mean(values, MASK).item() == pytest.approx(3.0)
    assert ppo.masked_mean(values, MASK, dim=-1).tolist() == pytest.approx([2.0, 4.5])
    # values 1..5: unbiased variance 2.5, population variance 2
    assert ppo.masked_var(values, MASK).item() == pytest.approx(2.5)
    assert ppo.masked_var(values, MASK, unbiased=False).item() == pytest.approx(2.0)


def test_whitening_gives_mean_zero_variance_one_over_the_mask():
    torch.manual_seed(1)
    values = torch.randn(3, 7) * 5 + 2
    mask = (torch.rand(3, 7) > 0.3).float()
    mask[:, 0] = 1
    whitened = ppo.masked_whiten(values, mask)
    assert ppo.masked_mean(whitened, mask).item() == pytest.approx(0.0, abs=1e-5)
    assert ppo.masked_var(whitened, mask).item() == pytest.approx(1.0, abs=1e-4)
    assert (whitened[mask == 0] == 0).all()
    kept = ppo.masked_whiten(values, mask, shift_mean=False)
    assert ppo.masked_mean(kept, mask).item() == pytest.approx(ppo.masked_mean(values, mask).item(), abs=1e-4)


# --------------------------------------------------------------------------- losses


def test_aggregation_modes_by_hand():
    loss = t([[1.0, 2.0, 3.0], [4.0, 50.0, 60.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    assert ppo.aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert ppo.aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert ppo.aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    with pytest.raises(ValueError, match="token-max"):
        ppo.aggregate_loss(loss, mask, "token-max")


def test_policy_loss_worked_example_from_the_design_notes():
    # ratio 1.3, eps 0.2, A = 2: min(2.6, 2.4) = 2.4, so the loss is -2.4 and the clip is active
    old = t([[-1.0]])
    current = old + math.log(1.3)
    loss, stats = ppo.ppo_policy_loss(current, old, t([[2.0]]), t([[1.0]]),
                                      options=ppo.PolicyLossOptions(clip_eps=0.2))
    assert loss.item() == pytest.approx(-2.4, abs=1e-6)
    assert stats["clipfrac"].item() == 1.0
    assert stats["ratio_mean"].item() == pytest.approx(1.3, abs=1e-6)
    # approx_kl is k3 of log r = log 1.3
    assert stats["approx_kl"].item() == pytest.approx(0.3 - math.log(1.3), abs=1e-6)


def test_policy_loss_negative_advantage_dual_clip_and_clip_higher():
    old = t([[0.0, 0.0, 0.0]])
    current = torch.log(t([[0.5, 5.0, 1.25]]))
    advantages = t([[-1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)
    # ratio 0.5, A=-1: max(0.5, 0.8) = 0.8 (clipped); ratio 5, A=-1: max(5, 1.2) = 5;
    # ratio 1.25, A=2: max(-2.5, -2.4) = -2.4 (clipped)
    loss, stats = ppo.ppo_policy_loss(current, old, advantages, mask, options=ppo.PolicyLossOptions(clip_eps=0.2))
    assert loss.item() == pytest.approx((0.8 + 5.0 - 2.4) / 3, abs=1e-5)
    assert stats["clipfrac"].item() == pytest.approx(2 / 3)
    # dual clip c = 3 bounds the ratio-5 token at 3
    loss, stats = ppo.ppo_policy_loss(current, old, advantages, mask,
                                      options=ppo.PolicyLossOptions(clip_eps=0.2, dual_clip=3.0))
    assert loss.item() == pytest.approx((0.8 + 3.0 - 2.4) / 3, abs=1e-5)
    assert stats["dual_clip_frac"].item() == pytest.approx(1 / 3)
    # clip-higher eps_high = 0.28: ratio 1.25 is inside [0.8, 1.28] -> -2.5
    loss, _ = ppo.ppo_policy_loss(current, old, advantages, mask,
                                  options=ppo.PolicyLossOptions(clip_eps=0.2, clip_eps_high=0.28))
    assert loss.item() == pytest.approx((0.8 + 5.0 - 2.5) / 3, abs=1e-5)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo.PolicyLossOptions(dual_clip=0.5)  # the options are checked where they are made


def test_off_policy_loss_equals_ppo_when_behavior_equals_proximal_equals_current():
    torch.manual_seed(2)
    logprobs = -torch.rand(3, 5)
    advantages = torch.randn(3, 5)
    mask = t([[1] * 5, [1, 1, 0, 0, 0], [1] * 4 + [0]])
    plain, plain_stats = ppo.ppo_policy_loss(logprobs, logprobs.clone(), advantages, mask)
    weights, stats = ppo.behavior_weights(logprobs.clone(), logprobs.clone(), mask, "truncate", "token", 2.0)
    decoupled, _ = ppo.ppo_policy_loss(logprobs, logprobs.clone(), advantages, mask, behavior_weights=weights)
    assert decoupled.item() == pytest.approx(plain.item(), abs=1e-6)
    assert stats["behavior_weight_mean"] == pytest.approx(1.0)
    assert stats["correction_truncated_frac"] == 0.0 and stats["correction_seq_truncated_frac"] == 0.0
    assert stats["behavior_ratio_p50"] == pytest.approx(1.0) and stats["behavior_seq_ratio_p95"] == pytest.approx(1.0)


def test_off_policy_importance_weight_is_truncated_at_the_cap():
    # proximal -1.0, behavior -1.5: w = e^0.5 = 1.6487 -> truncated to 1.5; ratio 1, A = 1
    old = t([[-1.0, -1.0]])
    behavior = t([[-1.5, -1.0]])
    weights, stats = ppo.behavior_weights(old, behavior, torch.ones(1, 2), "truncate", "token", 1.5)
    loss, _ = ppo.ppo_policy_loss(old.clone(), old, t([[1.0, 1.0]]), torch.ones(1, 2), behavior_weights=weights)
    assert loss.item() == pytest.approx((-1.5 - 1.0) / 2, abs=1e-6)
    assert stats["correction_truncated_frac"] == 0.5 and stats["correction_seq_truncated_frac"] == 1.0
    uncapped, _ = ppo.behavior_weights(old, behavior, torch.ones(1, 2), "truncate", "token", None)
    loss, _ = ppo.ppo_policy_loss(old.clone(), old, t([[1.0, 1.0]]), torch.ones(1, 2), behavior_weights=uncapped)
    assert loss.item() == pytest.approx((-math.exp(0.5) - 1.0) / 2, abs=1e-6)


def test_policy_gradient_flows_into_the_policy_only():
    current = t([[-1.0, -2.0]], requires_grad=True)
    old = t([[-1.0, -2.0]], requires_grad=True)
    behavior = t([[-1.1, -2.1]], requires_grad=True)
    advantages = t([[2.0, -1.0]], requires_grad=True)
    weights, _ = ppo.behavior_weights(old, behavior, torch.ones(1, 2), high=None)
    assert not weights.requires_grad  # computed from the logprobs with no gradient
    weights = weights.clone().requires_grad_(True)  # the loss must not reach into them either
    loss, _ = ppo.ppo_policy_loss(current, old, advantages, torch.ones(1, 2), behavior_weights=weights)
    loss.backward()
    # at ratio 1 the unclipped branch is active: d/dlogp (-A r w) / 2 = -A w / 2, w = e^0.1
    assert_close(current.grad, [[-2.0 * math.exp(0.1) / 2, 1.0 * math.exp(0.1) / 2]], atol=1e-5)
    assert old.grad is None and behavior.grad is None and advantages.grad is None and weights.grad is None


def test_value_loss_clipped_and_unclipped_by_hand():
    values = t([[1.5, 2.1]], requires_grad=True)
    old_values = t([[1.0, 2.0]], requires_grad=True)
    returns = t([[2.0, 2.0]], requires_grad=True)
    mask = torch.ones(1, 2)
    # token 0: (1.5-2)^2 = 0.25 vs clipped value 1.2: (1.2-2)^2 = 0.64 -> 0.64
    # token 1: (2.1-2)^2 = 0.01, clip not active (|2.1-2.0| < 0.2) -> 0.01
    loss, stats = ppo.value_loss(values, old_values, returns, mask, value_clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.01) / 2, abs=1e-6)
    assert stats["vf_clipfrac"].item() == 0.5
    loss.backward()
    assert old_values.grad is None and returns.grad is None
    unclipped, _ = ppo.value_loss(values, old_values, returns, mask, value_clip=None)
    assert unclipped.item() == pytest.approx(0.5 * (0.25 + 0.01) / 2, abs=1e-6)


# --------------------------------------------------------------------------- critic-free estimators


def test_grpo_advantages_by_hand():
    mask = t([[1, 1], [1, 0], [1, 1], [1, 1]])
    # group [1, 0]: mean 0.5, unbiased std sqrt(0.5); group [2, 2]: all zero
    advantages = ppo.grpo_advantages(t([1.0, 0.0, 2.0, 2.0]), mask, group_size=2)
    s = 0.5 / math.sqrt(0.5)
    assert_close(advantages, [[s, s], [-s, 0.0], [0.0, 0.0], [0.0, 0.0]], atol=1e-5)
    dr_grpo = ppo.grpo_advantages(t([1.0, 0.0, 2.0, 2.0]), mask, group_size=2, normalize_by_std=False)
    assert dr_grpo[:, 0].tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])
    with pytest.raises(ValueError, match="multiple of group_size"):
        ppo.grpo_advantages(t([1.0, 0.0, 2.0]), mask[:3], group_size=2)


def test_rloo_advantages_by_hand():
    # group [1, 2, 6]: baselines (2+6)/2 = 4, (1+6)/2 = 3.5, (1+2)/2 = 1.5
    advantages = ppo.rloo_advantages(t([1.0, 2.0, 6.0]), torch.ones(3, 2), group_size=3)
    assert advantages[:, 1].tolist() == pytest.approx([-3.0, -1.5, 4.5])


def test_reinforce_pp_advantages_by_hand():
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]])
    advantages, returns = ppo.reinforce_pp_advantages(rewards, MASK)
    assert_close(returns, [[1, 1, 1], [2, 2, 0]])
    # valid returns 1,1,1,2,2: mean 1.4, unbiased variance (3 * 0.16 + 2 * 0.36) / 4 = 0.3
    std = math.sqrt(0.3)
    low, high = (1 - 1.4) / std, (2 - 1.4) / std
    assert_close(advantages, [[low, low, low], [high, high, 0.0]], atol=1e-4)


# --------------------------------------------------------------------------- bad input


def test_mismatched_shapes_are_errors_not_broadcasts():
    with pytest.raises(ValueError, match="advantages has shape \\(1, 3\\)"):
        ppo.ppo_policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(1, 3), MASK)
    with pytest.raises(ValueError, match="scores"):
        ppo.token_rewards(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 1), MASK, kl_coef=0.1)
    with pytest.raises(ValueError, match="tokens"):
        ppo.logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_a_row_without_any_valid_token_is_an_error():
    mask = t([[1, 1, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match=r"no valid token in row\(s\) \[1\]"):
        ppo.gae_advantages(torch.zeros(2, 3), torch.zeros(2, 3), mask)
    with pytest.raises(ValueError, match="no valid token"):
        ppo.value_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), mask)


def test_nan_inputs_are_errors():
    values = t([[0.0, float("nan"), 0.0], [0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="values contains NaN"):
        ppo.gae_advantages(torch.zeros(2, 3), values, MASK)
    with pytest.raises(ValueError, match="logits contains NaN"):
        ppo.logprobs_from_logits(torch.full((1, 1, 3), float("nan")), torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="scores contains NaN"):
        ppo.token_rewards(torch.zeros(2, 3), torch.zeros(2, 3), t([0.0, float("inf")]), MASK, kl_coef=0.1)
    with pytest.raises(ValueError, match="current_kl"):
        adaptive_kl_coef(0.1, float("nan"), 6.0, 1, 10)


# --------------------------------------------------------------------------- advantages by estimator


def test_group_advantages_compare_each_responses_total_reward_with_its_groups():
    from common.config import LearnerConfig
    from learner.step import advantages_of

    scores = torch.tensor([1.0, 3.0, 0.0, 0.0, 2.0, 5.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    logprobs, ref = torch.full((6, 3), -1.0), torch.full((6, 3), -1.5)  # KL 0.5 a token
    for kl_coef, totals in ((0.0, scores), (0.2, scores - 0.2 * 0.5 * mask.sum(dim=1))):
        rewards, _ = ppo.token_rewards(logprobs, ref, scores, mask, kl_coef)
        for estimator, group in (("grpo", 3), ("rloo", 2)):
            cfg = LearnerConfig(advantage_estimator=estimator)
            advantages, _ = advantages_of(rewards, None, mask, cfg, group)
            if estimator == "grpo":
                grouped = totals.view(-1, 3)
                expected = ((grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-6))
            else:
                grouped = totals.view(-1, 2)
                expected = grouped - grouped.flip(dims=[1])  # the other response is the baseline
            torch.testing.assert_close(advantages, expected.flatten().unsqueeze(-1) * mask)


def test_whitening_a_single_token_only_centres_it():
    single = torch.tensor([[2.5, 0.0]])
    mask = torch.tensor([[1.0, 0.0]])
    assert ppo.masked_whiten(single, mask).tolist() == [[0.0, 0.0]]
    assert ppo.masked_whiten(single, mask, shift_mean=False).tolist() == [[2.5, 0.0]]




# --------------------------------------------------------------------------- episodes


def _episode_by_hand(logprobs, ref, values, policy, turn_rewards, score, kl_coef, gamma, lam):
    """One episode's advantages and KL computed on its policy tokens alone, in plain Python: the
    environment's tokens are cut out, the per-token rewards built and GAE run on what is left,
    then everything is put back at the policy tokens' places (0 elsewhere)."""
    where = [t for t, p in enumerate(policy) if p]
    kl = [logprobs[t] - ref[t] for t in where]
    rewards = [-kl_coef * k + turn_rewards[t] for k, t in zip(kl, where)]
    rewards[-1] += score  # the score on the last policy token
    advantages, next_value, next_advantage = [0.0] * len(where), 0.0, 0.0
    for j in reversed(range(len(where))):
        delta = rewards[j] + gamma * next_value - values[where[j]]
        next_advantage = advantages[j] = delta + gamma * lam * next_advantage
        next_value = values[where[j]]
    full_advantages, full_kl = [0.0] * len(policy), [0.0] * len(policy)
    for j, t in enumerate(where):
        full_advantages[t], full_kl[t] = advantages[j], kl[j]
    return full_advantages, full_kl


def test_advantages_over_interleaved_policy_and_environment_tokens_equal_an_independent_computation():
    # two episodes, 1 = the policy's token, 0 = the environment's (an observation), then padding:
    # a turn reward after the first turn; the second episode ends on an observation
    policy = [[1, 1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 0, 0, 0]]
    lengths = [6, 4]
    logprobs = t([[-1.0, -0.5, 0.0, 0.0, -2.0, -0.3, 0.0], [-0.7, 0.0, -1.1, 0.0, 0.0, 0.0, 0.0]])
    ref = t([[-1.2, -0.4, -3.0, -9.0, -1.5, -0.3, 0.0], [-0.9, -5.0, -1.0, -7.0, 0.0, 0.0, 0.0]])
    values = t([[0.2, 0.4, 9.0, 9.0, 0.1, -0.3, 0.0], [0.5, 9.0, 0.3, 9.0, 0.0, 0.0, 0.0]])
    turn = t([[0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0], [0.0] * 7])
    scores, kl_coef, gamma, lam = t([1.0, -2.0]), 0.1, 0.9, 0.8
    mask = t(policy)
    rewards, kl = ppo.token_rewards(logprobs, ref, scores, mask, kl_coef, turn_rewards=turn)
    advantages, returns = ppo.gae_advantages(rewards, values, mask, gamma, lam)
    for row in range(2):
        n = lengths[row]
        expected_advantages, expected_kl = _episode_by_hand(
            logprobs[row, :n].tolist(), ref[row, :n].tolist(), values[row, :n].tolist(), policy[row][:n],
            turn[row, :n].tolist(), float(scores[row]), kl_coef, gamma, lam)
        assert advantages[row, :n].tolist() == pytest.approx(expected_advantages, abs=1e-6)
        assert kl[row, :n].tolist() == pytest.approx(expected_kl, abs=1e-6)  # none at the environment's tokens
    assert torch.equal(returns * (1 - mask), torch.zeros_like(returns))


def test_a_turn_reward_on_an_environment_token_is_an_error():
    mask = t([[1, 0, 1]])
    with pytest.raises(ValueError, match="turn_rewards has a reward on a token response_mask leaves out"):
        ppo.token_rewards(torch.zeros(1, 3), torch.zeros(1, 3), t([0.0]), mask, 0.1,
                          turn_rewards=t([[0.0, 1.0, 0.0]]))


# --------------------------------------------------------------------------- V-trace value targets


def vtrace_by_the_sum(rewards, values, ratios, gamma, lam, rho_clip, c_clip) -> list[float]:
    """Espeholt et al. 2018, eq. 1, term by term for one trajectory (its valid tokens in order):
    v_s = V_s + sum_{t>=s} gamma^(t-s) (prod_{i=s}^{t-1} c_i) rho_t (r_t + gamma V_{t+1} - V_t)."""
    n = len(rewards)
    rho = [min(rho_clip, ratio) for ratio in ratios]
    c = [lam * min(c_clip, ratio) for ratio in ratios]
    following = [*values[1:], 0.0]
    targets = []
    for s in range(n):
        total, trace = values[s], 1.0
        for t in range(s, n):
            total += gamma ** (t - s) * trace * rho[t] * (rewards[t] + gamma * following[t] - values[t])
            trace *= c[t]
        targets.append(total)
    return targets


def test_vtrace_by_hand():
    from learner.ppo import vtrace_targets

    # ratios 2 and 0.5, both clips 1: rho = c = [1, 0.5]; delta_1 = 1 - 0.2 = 0.8 -> v_1 = 0.2 + 0.4 = 0.6;
    # delta_0 = 0.2 - 0.5 = -0.3 -> v_0 = 0.5 - 0.3 + 1 x (v_1 - V_1 = 0.4) = 0.6
    targets = vtrace_targets(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.2]]),
                             torch.log(torch.tensor([[2.0, 0.5]])), torch.ones(1, 2), gamma=1.0, lam=1.0)
    assert targets[0].tolist() == pytest.approx([0.6, 0.6])


@pytest.mark.parametrize("rho_clip, c_clip", [(1.0, 1.0), (2.0, 0.5), (0.7, 1.5)])
def test_vtrace_matches_the_papers_sum_on_trajectories_with_holes(rho_clip, c_clip):
    from learner.ppo import vtrace_targets

    generator = torch.Generator().manual_seed(3)
    rewards, values = torch.randn(4, 7, generator=generator), torch.randn(4, 7, generator=generator)
    log_ratios = torch.randn(4, 7, generator=generator)  # ratios from 0.1 to 10: both clips bite
    mask = torch.ones(4, 7)
    mask[0, 5:] = 0  # right padding
    mask[1, 2:4] = 0  # a hole (an episode's environment tokens)
    mask[2, 0] = 0
    gamma, lam = 0.9, 0.8
    targets = vtrace_targets(rewards, values, log_ratios, mask, gamma, lam, rho_clip, c_clip)
    for row in range(4):
        valid = mask[row].bool()
        expected = vtrace_by_the_sum(rewards[row][valid].tolist(), values[row][valid].tolist(),
                                     log_ratios[row][valid].exp().tolist(), gamma, lam, rho_clip, c_clip)
        assert targets[row][valid].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-5)
        assert (targets[row][~valid] == 0).all()


def test_vtrace_is_gae_on_policy_and_clipped_ratios_are_the_clip():
    from learner.ppo import gae_advantages, vtrace_targets

    generator = torch.Generator().manual_seed(4)
    rewards, values = torch.randn(3, 6, generator=generator), torch.randn(3, 6, generator=generator)
    mask = torch.ones(3, 6)
    mask[1, 4:] = 0
    _, returns = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.95)
    on_policy = vtrace_targets(rewards, values, torch.zeros(3, 6), mask, 1.0, 0.95, rho_clip=1.0, c_clip=1.0)
    assert torch.allclose(on_policy, returns, atol=1e-6)  # k = 0: the same targets
    # every ratio above both clips counts as the clip: ratios of 3 and of 1 give the same targets at clip 1
    above = vtrace_targets(rewards, values, torch.full((3, 6), math.log(3.0)), mask, 1.0, 0.95, 1.0, 1.0)
    assert torch.allclose(above, returns, atol=1e-6)
    raised = vtrace_targets(rewards, values, torch.full((3, 6), math.log(3.0)), mask, 1.0, 0.95, 2.0, 2.0)
    assert not torch.allclose(raised, returns, atol=1e-3)  # at clip 2 the weight 2 enters
    with pytest.raises(ValueError, match="rho_clip"):
        vtrace_targets(rewards, values, torch.zeros(3, 6), mask, rho_clip=0.0)


def test_the_learners_step_trains_the_critic_toward_vtrace_targets_when_asked():
    """rewards_and_advantages, the learner step's part 2: value_targets vtrace changes the critic's
    targets only, and only where the behavior policy differs from the proximal one."""
    from common.config import LearnerConfig
    from learner.step import rewards_and_advantages

    generator = torch.Generator().manual_seed(5)
    old, values = -torch.rand(4, 5, generator=generator), torch.randn(4, 5, generator=generator)
    mask = torch.ones(4, 5)
    mask[2, 3:] = 0
    scores, truncated = torch.randn(4, generator=generator), torch.zeros(4, dtype=torch.bool)
    results = {}
    for targets in ("gae", "vtrace"):
        cfg = LearnerConfig(value_targets=targets)
        for name, behavior in (("fresh", old), ("stale", old + 0.7)):  # pi_prox / pi_behavior = e^-0.7
            results[targets, name] = rewards_and_advantages([], old, values, old - 0.1, scores, truncated, mask, cfg,
                                                            0.05, None, 1, None, behavior)
    for name in ("fresh", "stale"):  # the policy's advantages are GAE's either way
        torch.testing.assert_close(results["gae", name][1], results["vtrace", name][1])
    torch.testing.assert_close(results["gae", "fresh"][2], results["vtrace", "fresh"][2])
    rewards, _ = ppo.token_rewards(old, old - 0.1, scores, mask, 0.05)
    expected = ppo.vtrace_targets(rewards, values, torch.full((4, 5), -0.7) * mask, mask, 1.0, 0.95)
    torch.testing.assert_close(results["vtrace", "stale"][2], expected)
    assert not torch.allclose(results["vtrace", "stale"][2], results["gae", "stale"][2], atol=1e-3)


# --------------------------------------------------------------------------- episodes in parts


def _episode_batches():
    """The same four episodes (two prompts, two each) as four rows, and with the first episode in two
    parts (its program rewrote its context after three tokens): its first part's score is the
    scorer's reading of the cut conversation, which the episode's outcome must not count."""
    from tests.helpers import sample_of

    generator = torch.Generator().manual_seed(11)
    old, ref = -torch.rand(4, 6, generator=generator), -torch.rand(4, 6, generator=generator)
    values, scores = torch.randn(4, 6, generator=generator), torch.tensor([1.0, 0.0, 0.5, -1.0])
    turns = torch.zeros(4, 6)
    turns[0, 1] = 0.25  # a turn reward before the rewrite
    whole = [sample_of([1], [1] * 6, f"e{i}", prompt_index=i // 2, reward=float(scores[i])) for i in range(4)]

    def rows(tensor):  # [4, 6] -> [5, 6]: episode 0's tokens 0-2 and 3-5 as two rows, padded with zeros
        first, rest = torch.zeros(1, 6), torch.zeros(1, 6)
        first[0, :3], rest[0, :3] = tensor[0, :3], tensor[0, 3:]
        return torch.cat([first, rest, tensor[1:]])

    parts = [sample_of([1], [1] * 3, "e0a", 0, reward=99.0), sample_of([1], [1] * 3, "e0b", 0, reward=1.0),
             *whole[1:]]
    for s, (episode, part, count) in zip(parts, [(0, 0, 2), (0, 1, 2), (1, 0, 1), (0, 0, 1), (1, 0, 1)]):
        s.episode_index, s.part_index, s.episode_parts = episode, part, count
    mask = torch.ones(4, 6)
    split = (parts, rows(old), rows(values), rows(ref), torch.tensor([99.0, 1.0, 0.0, 0.5, -1.0]),
             torch.zeros(5, dtype=torch.bool), rows(mask), rows(turns))
    return (whole, old, values, ref, scores, torch.zeros(4, dtype=torch.bool), mask, turns), split


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp", "gae"])
@pytest.mark.parametrize("normalize", [False, True])
def test_an_episode_in_parts_trains_as_the_same_episode_in_one_row(estimator, normalize):
    """Each part of a split episode gets, token for token, the advantage and return its tokens get
    when the episode is one row: one outcome per episode for GRPO/RLOO, the return still to come for
    GAE (gamma = lambda = 1) and REINFORCE++; the running moments count each episode once."""
    from common.config import LearnerConfig
    from learner.step import rewards_and_advantages

    cfg = LearnerConfig(advantage_estimator=estimator, gamma=1.0, lam=1.0, whiten_advantages=False)
    whole, split = _episode_batches()
    out = {}
    for name, (samples, old, values, ref, scores, truncated, mask, turns) in (("whole", whole), ("split", split)):
        moments = ppo.RunningMoments() if normalize else None
        out[name] = rewards_and_advantages(samples, old, values if estimator == "gae" else None, ref, scores,
                                           truncated, mask, cfg, 0.05, moments, 2, turns)
        if moments is not None:
            assert moments.count == 4
    for index in (1, 2):  # advantages, returns
        one_row, parted = out["whole"][index], out["split"][index]
        if estimator in ("grpo", "rloo"):  # the episode's outcome on each of its tokens: its return too
            torch.testing.assert_close(parted[0, :3], one_row[0, :3])
            torch.testing.assert_close(parted[1, :3], one_row[0, 3:])
        else:
            torch.testing.assert_close(torch.cat([parted[0, :3], parted[1, :3]]), one_row[0])
        torch.testing.assert_close(parted[2:], one_row[1:])
    assert not torch.equal(out["split"][1][0, :3], out["split"][1][2, :3])  # not all one value: it means something


def test_a_batch_of_one_part_episodes_comes_out_bit_for_bit_as_samples_without_parts():
    from common.config import LearnerConfig
    from learner.step import rewards_and_advantages

    whole, _ = _episode_batches()
    numbered = [copy.copy(s) for s in whole[0]]
    for s in numbered:
        s.episode_index, s.part_index, s.episode_parts = int(s.sample_id[1]) % 2, 0, 1
    for estimator in ("grpo", "rloo", "reinforce_pp", "gae"):
        cfg = LearnerConfig(advantage_estimator=estimator)
        plain = rewards_and_advantages(*whole[:1], *whole[1:7], cfg, 0.05, None, 2, whole[7])
        parted = rewards_and_advantages(numbered, *whole[1:7], cfg, 0.05, None, 2, whole[7])
        assert all(torch.equal(a, b) for a, b in zip(plain, parted)), estimator


def test_distillation_rewards_each_policy_token_by_its_reverse_kl_to_the_teacher():
    """-beta (log pi_old - log pi_teacher) per token, 0 at an episode's environment tokens and at
    padding; pure distillation takes it as the advantage, undiscounted."""
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.2, -0.4, 0.0, 0.0]])
    teacher = torch.tensor([[-1.5, -1.0, -0.5, -9.0], [-0.2, -1.4, -7.0, -7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]])  # an environment token, then padding
    rewards = ppo.distill_rewards(old, teacher, mask, 0.5)
    assert rewards.tolist() == [[-0.25, 0.5, 0.0, -3.0], [0.0, -0.5, 0.0, 0.0]]
    advantages, returns = ppo.distill_advantages(old, teacher, mask, 0.5)
    assert advantages.tolist() == rewards.tolist() == returns.tolist()
    with pytest.raises(ValueError, match="distill_coef must be a finite number >= 0"):
        ppo.distill_rewards(old, teacher, mask, -1.0)
    with pytest.raises(ValueError, match="teacher_logprobs"):
        ppo.distill_rewards(old, teacher[:, :3], mask, 0.5)
