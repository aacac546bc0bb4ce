"""The off-policy and ratio options of the policy loss (learner/ppo.py) against per-sample loops
written from each paper's formula: GSPO and GSPO-token (Zheng et al. 2025), CISPO (MiniMax-M1,
Chen et al. 2025), truncated and masked importance weights per token and per sequence (Liu et al.
2025; IcePop), Dr. GRPO's constant normaliser and unnormalised advantages (Liu et al. 2025). Each
test also runs a mutated loop (a sign, a normaliser, a stop-gradient off by one) and asserts it
differs, so a comparison that could not fail would show here."""

import math

import pytest
import torch

from learner import ppo

EPS, EPS_HIGH = 0.05, 0.08


def batch(seed: int, rows: int = 5, length: int = 7, spread: float = 0.15):
    """Policy logprobs (a leaf with a gradient), old ones near them (ratios of about e^±spread: both
    clips bite), a mask with right padding and a hole (an episode's environment tokens)."""
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, length, generator=generator) * 2 - 0.1
    logprobs = (old + spread * torch.randn(rows, length, generator=generator)).requires_grad_(True)
    mask = torch.ones(rows, length)
    mask[0, 5:] = 0
    mask[1, 2:4] = 0
    mask[3, 1:] = 0  # one token
    return logprobs, old, mask, generator


def valid_tokens(mask: torch.Tensor, row: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if mask[row, t] > 0]


def value_and_gradient(loss: torch.Tensor, logprobs: torch.Tensor) -> tuple[float, torch.Tensor]:
    (gradient,) = torch.autograd.grad(loss, logprobs)
    return float(loss.detach()), gradient


def assert_same(ours, paper) -> None:
    assert ours[0] == pytest.approx(paper[0], rel=1e-5, abs=1e-7)
    torch.testing.assert_close(ours[1], paper[1], rtol=1e-5, atol=1e-7)


def assert_differs(ours, mutated) -> None:
    assert ours[0] != pytest.approx(mutated[0], rel=1e-3, abs=1e-6) or not torch.allclose(
        ours[1], mutated[1], rtol=1e-3, atol=1e-6)


# --------------------------------------------------------------------------- GSPO


def gspo_by_the_paper(logprobs, old, mask, advantages, normalise_length: bool = True) -> torch.Tensor:
    """GSPO, eq. 5 and 7: J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps, 1 + eps_h) A_i), s_i =
    (pi(y_i) / pi_old(y_i))^(1/|y_i|), one sequence at a time. ``normalise_length`` False: the
    mutation that forgets the 1/|y_i| (the plain sequence ratio)."""
    objective = 0.0
    for i in range(logprobs.shape[0]):
        tokens = valid_tokens(mask, i)
        log_s = sum(logprobs[i, t] - old[i, t] for t in tokens)
        s = torch.exp(log_s / len(tokens) if normalise_length else log_s)
        objective = objective + torch.minimum(s * advantages[i], torch.clamp(s, 1 - EPS, 1 + EPS_HIGH) * advantages[i])
    return -objective / logprobs.shape[0]


def test_gspo_is_the_papers_sequence_objective_in_value_and_gradient():
    logprobs, old, mask, generator = batch(1)
    per_sequence = torch.randn(5, generator=generator)  # GRPO-style: one advantage a sequence
    advantages = per_sequence.unsqueeze(-1) * mask
    loss, stats = ppo.ppo_policy_loss(logprobs, old, advantages, mask, options=ppo.PolicyLossOptions(
        EPS, EPS_HIGH, ratio_level="sequence", loss_aggregation="seq-mean-token-mean"))
    ours = value_and_gradient(loss, logprobs)
    assert_same(ours, value_and_gradient(gspo_by_the_paper(logprobs, old, mask, per_sequence), logprobs))
    assert_differs(ours, value_and_gradient(gspo_by_the_paper(logprobs, old, mask, per_sequence, False), logprobs))
    # the clip is per sequence: a sequence's tokens are all clipped or none is
    ratios = ppo.sequence_ratio((logprobs - old).detach(), mask)
    outside = (ratios < 1 - EPS) | (ratios > 1 + EPS_HIGH)
    assert outside.any() and not outside.all()  # the batch exercises both branches
    assert 0 < float(stats["clipfrac"]) < 1


def test_gspo_token_is_its_papers_per_token_formula():
    """GSPO-token, eq. 13-14, with an advantage per token (a critic's): s_i,t = sg[s_i] pi_t / sg[pi_t]."""
    logprobs, old, mask, generator = batch(2)
    advantages = torch.randn(5, 7, generator=generator) * mask

    def by_the_paper(detach_sequence: bool = True) -> torch.Tensor:
        objective = 0.0
        for i in range(5):
            tokens = valid_tokens(mask, i)
            log_s = sum(logprobs[i, t] - old[i, t] for t in tokens) / len(tokens)
            s = torch.exp(log_s.detach() if detach_sequence else log_s)
            row = 0.0
            for t in tokens:
                s_t = s * torch.exp(logprobs[i, t] - logprobs[i, t].detach())
                a = advantages[i, t]
                row = row + torch.minimum(s_t * a, torch.clamp(s_t, 1 - EPS, 1 + EPS_HIGH) * a)
            objective = objective + row / len(tokens)
        return -objective / 5

    loss, _ = ppo.ppo_policy_loss(logprobs, old, advantages, mask, options=ppo.PolicyLossOptions(
        EPS, EPS_HIGH, ratio_level="sequence", loss_aggregation="seq-mean-token-mean"))
    ours = value_and_gradient(loss, logprobs)
    assert_same(ours, value_and_gradient(by_the_paper(), logprobs))
    # the mutation: s_i's own gradient kept (its value the same, each token's gradient not)
    assert_differs(ours, value_and_gradient(by_the_paper(detach_sequence=False), logprobs))


# --------------------------------------------------------------------------- CISPO


def cispo_by_the_paper(logprobs, old, mask, advantages, stop_gradient: bool = True) -> torch.Tensor:
    """CISPO, eq. 4: J = 1 / sum_i |o_i| sum_i sum_t sg(clip(r_i,t, 1 - eps_l, 1 + eps_h)) A_i,t
    log pi(o_i,t), token by token."""
    objective, count = 0.0, 0
    for i in range(logprobs.shape[0]):
        for t in valid_tokens(mask, i):
            weight = torch.clamp(torch.exp(logprobs[i, t] - old[i, t]), 1 - EPS, 1 + EPS_HIGH)
            objective = objective + (weight.detach() if stop_gradient else weight) * advantages[i, t] * logprobs[i, t]
            count += 1
    return -objective / count


def test_cispo_is_its_papers_objective_and_keeps_every_tokens_gradient():
    logprobs, old, mask, generator = batch(3)
    advantages = torch.randn(5, 7, generator=generator) * mask
    loss, stats = ppo.ppo_policy_loss(logprobs, old, advantages, mask,
                                      options=ppo.PolicyLossOptions(EPS, EPS_HIGH, policy_loss="cispo"))
    ours = value_and_gradient(loss, logprobs)
    assert_same(ours, value_and_gradient(cispo_by_the_paper(logprobs, old, mask, advantages), logprobs))
    assert_differs(ours, value_and_gradient(cispo_by_the_paper(logprobs, old, mask, advantages, False), logprobs))
    # PPO's clip drops the gradient of a token past the range on its advantage's side; CISPO keeps it
    ratio = torch.exp(logprobs.detach() - old)
    dropped = (((ratio > 1 + EPS_HIGH) & (advantages > 0)) | ((ratio < 1 - EPS) & (advantages < 0))) & (mask > 0)
    assert dropped.any() and 0 < float(stats["clipfrac"]) < 1
    ppo_loss, _ = ppo.ppo_policy_loss(logprobs, old, advantages, mask, options=ppo.PolicyLossOptions(EPS, EPS_HIGH))
    _, ppo_gradient = value_and_gradient(ppo_loss, logprobs)
    assert (ppo_gradient[dropped] == 0).all() and (ours[1][dropped] != 0).all()


def test_cispo_refuses_what_it_does_not_define():
    """The loss's options are checked where they are made."""
    with pytest.raises(ValueError, match="cispo"):
        ppo.PolicyLossOptions(policy_loss="cispo", ratio_level="sequence")
    with pytest.raises(ValueError, match="cispo"):
        ppo.PolicyLossOptions(policy_loss="cispo", dual_clip=3.0)


# --------------------------------------------------------------------------- importance weights


def weights_by_the_papers(old, behavior, mask, correction, level, high, low, product: bool = True,
                          inverted: bool = False):
    """w = pi_old / pi_behavior of each token (or W_i = prod_t w_t of its sequence on each of its
    tokens): truncated, min(w, high) (TIS); masked, w if low <= w <= high else 0 (MIS, IcePop).
    The mutations: ``product`` False takes the sequence's geometric mean instead; ``inverted``
    the ratio the wrong way up (pi_behavior / pi_old, a sign error in the log)."""
    weights = torch.zeros_like(old, dtype=torch.float64)
    for i in range(old.shape[0]):
        tokens = valid_tokens(mask, i)
        logs = [float(old[i, t] - behavior[i, t]) * (-1 if inverted else 1) for t in tokens]
        sequence = math.exp(sum(logs) if product else sum(logs) / len(logs))
        for t, log in zip(tokens, logs):
            w = sequence if level == "sequence" else math.exp(log)
            if correction == "truncate":
                w = min(w, high)
            elif w > high or (low is not None and w < low):
                w = 0.0
            weights[i, t] = w
    return weights.float()


@pytest.mark.parametrize("correction", ["truncate", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_behavior_weights_are_the_papers_per_token_and_per_sequence(correction, level):
    _, old, mask, generator = batch(5, rows=8, spread=0.3)
    behavior = old + 0.3 * torch.randn(8, 7, generator=generator)
    high, low = (1.5, 0.6) if correction == "mask" else (1.5, None)
    ours, stats = ppo.behavior_weights(old, behavior, mask, correction, level, high, low)
    paper = weights_by_the_papers(old, behavior, mask, correction, level, high, low)
    torch.testing.assert_close(ours, paper, rtol=1e-5, atol=1e-6)
    inverted = weights_by_the_papers(old, behavior, mask, correction, level, high, low, inverted=True)
    assert not torch.allclose(ours, inverted, rtol=1e-3, atol=1e-6)
    if level == "sequence":
        mutated = weights_by_the_papers(old, behavior, mask, correction, level, high, low, product=False)
        assert not torch.allclose(ours, mutated, rtol=1e-3, atol=1e-6)
    # what the step reports: the shares of tokens and sequences the correction changed
    w = torch.exp(old - behavior)
    sequence = torch.exp(((old - behavior) * mask).sum(-1, keepdim=True)).expand_as(w)
    seen = sequence if level == "sequence" else w
    changed = ((seen > high) | ((seen < low) if low else torch.zeros_like(seen, dtype=torch.bool))) & (mask > 0)
    kind = "truncated" if correction == "truncate" else "masked"
    assert 0 < stats[f"correction_{kind}_frac"] < 1
    assert stats[f"correction_{kind}_frac"] == pytest.approx(float(changed.sum() / mask.sum()))
    assert stats[f"correction_seq_{kind}_frac"] == pytest.approx(float(changed.any(-1).float().mean()))
    tokens = w[mask > 0].double()
    assert stats["behavior_ratio_p50"] == pytest.approx(float(tokens.quantile(0.5)), rel=1e-5)
    assert stats["behavior_seq_ratio_p95"] == pytest.approx(float(sequence[:, 0].double().quantile(0.95)), rel=1e-5)


def test_a_sequence_ratio_past_the_float_range_is_masked_or_truncated_not_nan():
    old = torch.zeros(2, 300)
    behavior = torch.full((2, 300), -3.0)  # W = e^900 for each sequence
    behavior[1] = 0.0
    for correction in ("truncate", "mask"):
        weights, stats = ppo.behavior_weights(old, behavior, torch.ones(2, 300), correction, "sequence", 2.0)
        assert torch.isfinite(weights).all()
        assert weights[0, 0] == (2.0 if correction == "truncate" else 0.0) and weights[1, 0] == 1.0


def test_the_loss_weighs_each_token_by_its_behavior_weight():
    """A masked token keeps its place in token-mean's normaliser with weight 0 (the papers'
    estimators): the loss is the plain one with that token's term removed, over all tokens."""
    logprobs, old, mask, generator = batch(6)
    advantages = torch.randn(5, 7, generator=generator) * mask
    weights = (torch.rand(5, 7, generator=generator) > 0.3).float() * 1.3
    loss, _ = ppo.ppo_policy_loss(logprobs, old, advantages, mask, behavior_weights=weights)
    ratio = torch.exp(logprobs - old)
    per_token = -torch.minimum(ratio * advantages, torch.clamp(ratio, 0.8, 1.2) * advantages)
    expected = (per_token * weights * mask).sum().detach() / mask.sum()
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-5)


# --------------------------------------------------------------------------- Dr. GRPO


def test_dr_grpo_divides_each_sequences_sum_by_a_constant_and_keeps_the_std():
    generator = torch.Generator().manual_seed(7)
    losses, mask = torch.randn(4, 6, generator=generator), torch.ones(4, 6)
    mask[1, 3:] = 0
    mask[2, 1:] = 0
    by_the_paper = sum(float(losses[i, t]) for i in range(4) for t in valid_tokens(mask, i)) / (4 * 20)
    ours = float(ppo.aggregate_loss(losses, mask, "seq-mean-token-sum-norm", norm_length=20))
    assert ours == pytest.approx(by_the_paper, rel=1e-6)
    # the mutation: each sequence over its own length is GRPO's seq-mean-token-mean, not Dr. GRPO's
    assert ours != pytest.approx(float(ppo.aggregate_loss(losses, mask, "seq-mean-token-mean")), rel=1e-3)
    with pytest.raises(ValueError, match="norm_length"):
        ppo.aggregate_loss(losses, mask, "seq-mean-token-sum-norm")
    # data-parallel: every rank holds as many sequences, as in the other seq-mean modes
    assert ppo.data_parallel_scale(mask[:2], mask, "seq-mean-token-sum-norm", 2) == 1.0

    scores = torch.tensor([1.0, 0.0, 0.0, 3.0, 2.0, 2.0])
    centred = ppo.grpo_advantages(scores, torch.ones(6, 2), 3, normalize_by_std=False)[:, 0]
    assert centred.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 2 / 3, -1 / 3, -1 / 3])


def test_the_learners_advantages_follow_grpo_std_normalize():
    from common.config import LearnerConfig
    from learner.step import advantages_of

    rewards, mask = torch.zeros(4, 3), torch.ones(4, 3)
    rewards[:, -1] = torch.tensor([1.0, 3.0, 0.0, 0.0])
    unbiased = LearnerConfig(advantage_estimator="grpo", grpo_std_normalize=False)
    plain, _ = advantages_of(rewards, None, mask, unbiased, 2)
    assert plain[:, 0].tolist() == pytest.approx([-1.0, 1.0, 0.0, 0.0])
    normalised, _ = advantages_of(rewards, None, mask, LearnerConfig(advantage_estimator="grpo"), 2)
    assert normalised[0, 0] == pytest.approx(-1.0 / math.sqrt(2.0), rel=1e-4)


# --------------------------------------------------------------------------- DAPO's overlong shaping


def overlong_by_the_paper(length: int, max_length: int, buffer: int, off_by_one: int = 0) -> float:
    """DAPO eq. 13: 0 if |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache if L_max -
    L_cache < |y| <= L_max; -1 past L_max. ``off_by_one`` 1: the mutation that divides by
    L_cache + 1."""
    if length <= max_length - buffer:
        return 0.0
    if length <= max_length:
        return ((max_length - buffer) - length) / (buffer + off_by_one)
    return -1.0


def test_overlong_shaping_is_dapos_soft_punishment():
    from scorer.scoring import overlong_penalty

    lengths = list(range(0, 40))
    ours = overlong_penalty(torch.tensor(lengths), max_length=32, buffer=8, penalty=0.5).tolist()
    assert ours == pytest.approx([0.5 * overlong_by_the_paper(n, 32, 8) for n in lengths])
    assert ours != pytest.approx([0.5 * overlong_by_the_paper(n, 32, 8, off_by_one=1) for n in lengths])
    assert ours[24] == 0.0 and ours[28] == pytest.approx(-0.25) and ours[32] == ours[39] == -0.5
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(torch.tensor([1]), max_length=8, buffer=8)


def test_quantiles_are_torchs_by_one_sort():
    """torch.quantile refuses more than 2^24 values; the sort gives its figures."""
    values = torch.rand(1001, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    ours = ppo._quantiles(values, (0.0, 0.05, 0.5, 0.95, 1.0))
    assert ours == pytest.approx(torch.quantile(values, torch.tensor([0.0, 0.05, 0.5, 0.95, 1.0],
                                                                     dtype=torch.float64)).tolist(), rel=1e-12)
