"""PPO-RLHF math: pure tensor functions, no I/O, no DeepSpeed, no ZeroMQ.

Every function takes and returns tensors; shapes are in each docstring with
``B`` = batch (sequences), ``T`` = response length (right-padded), ``V`` = vocab.
A ``response_mask`` is 1.0 (or True) at real response tokens and 0 at padding;
every reduction is masked, so padding never reaches a loss or a statistic.
Inputs that would silently broadcast, NaN inputs and rows without a single
valid token are rejected with a ``ValueError`` that names the argument.

How each function maps to the formulas of docs/design.md, "The math":

=============================  ==============================================================
formula                        function
=============================  ==============================================================
log pi(y_t | s_t)              ``logprobs_from_logits`` (logits / temperature, as sampled)
KL estimate per token          ``kl_per_token``: k1 = log(pi/pi_ref), k2 = 0.5 log(pi/pi_ref)^2,
                               k3 = (pi_ref/pi - 1) - log(pi_ref/pi)   (Schulman 2020)
r_t = -beta KL_t, + r_RM at T  ``token_rewards`` (RM score at the last real token)
rho_t = pi_theta / pi_old      ``ppo_policy_loss`` (``ratio``)
s_i = exp(1/|y_i| sum_t log    ``sequence_ratio``: GSPO (Zheng et al. 2025, eq. 7), clipped per
  rho_t); GSPO-token s_i,t =     sequence; GSPO-token (eq. 13), each token s_i's value with its own
  sg[s_i] pi_t / sg[pi_t]        logprob's gradient (``PolicyLossOptions(ratio_level="sequence")``)
L_CISPO = -sg(clip(rho_t, 1-   ``PolicyLossOptions(policy_loss="cispo")`` (MiniMax-M1, Chen et al.
  eps, 1+eps_h)) A_t log pi_t    2025, eq. 4): every token keeps its gradient, the weight is clipped
w = pi_old / pi_behavior,      ``behavior_weights``: truncated IS (min(w, C); Ionides 2008, Yao et
  truncated or masked, per       al. 2025) or masked IS (w 1[low <= w <= C]: MIS, Liu et al. 2025;
  token or per sequence          IcePop, Ling team 2025), of each token or of the sequence's
  (W_i = prod_t w_t)             product W_i (sequence-level IS)
1/G sum_i 1/L sum_t l_i,t      ``aggregate_loss("seq-mean-token-sum-norm")``: Dr. GRPO's constant
  (L a constant)                 length normaliser (Liu et al. 2025, "Understanding R1-Zero")
L_clip = -E[min(rho A,         ``ppo_policy_loss``; dual clip (Ye et al. 2020) and the decoupled
  clip(rho, 1-eps, 1+eps) A)]    off-policy form (Hilton et al. 2022) are options of it
                               (``PolicyLossOptions``, ``behavior_weights``)
delta_t = r_t + gamma V_{t+1}  ``gae_advantages``
  - V_t; A_t = sum (gamma
  lambda)^l delta_{t+l}
v_s = V_s + sum_t gamma^(t-s)     ``vtrace_targets``: the critic's targets corrected for stale
  (prod_{i<t} c_i) rho_t delta_t   samples (V-trace, Espeholt et al. 2018, eq. 1), rho_t =
  (rho, c: truncated pi / mu)      min(rho_clip, pi_prox/pi_behavior), c_i = lambda min(c_clip,
                                   ratio); at ratio 1 they are GAE's returns
R_e = sum over e's parts of     ``episode_totals``: an episode in parts (a rewritten context) is one
  sum_t r_t                      outcome for GRPO/RLOO, its advantage on every part's tokens
r_last(part) += sum of later   ``rewards_across_parts``: each part's return still to come, so
  parts' sum_t r_t               GAE and reward-to-go run per row as on the whole episode (gamma 1)
r_t += -beta_d (log pi_old -    ``distill_rewards``: on-policy distillation's reward per token, the
  log pi_teacher)                reverse KL to the teacher on the token sampled (GKD, Agarwal et al.
                                 2024); ``distill_advantages``: A_t = that alone, undiscounted
                                 (Thinking Machines, "On-Policy Distillation", 2025)
beta <- max(0, beta (1 + clip  ``learner.kl_control.adaptive_kl_coef`` (Ziegler et al. 2019)
  ((KL-target)/target, ±0.2)
  n/horizon))
=============================  ==============================================================

Worked checks from docs/design.md, both asserted in tests/test_ppo_math.py:
logprobs -1.2 vs reference -1.6 with beta 0.05 gives a penalty of -0.02; ratio 1.3,
eps 0.2, A = 2 gives min(2.6, 2.4) = 2.4 (a loss of -2.4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

# the sampled distribution's math is shared with the scorer; it lives where neither role owns it
from common.distributions import entropy_from_logits, logprobs_from_logits  # noqa: F401  (the table below)

KLEstimator = Literal["k1", "k2", "k3"]
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
RatioLevel = Literal["token", "sequence"]
PolicyLoss = Literal["ppo", "cispo"]
BehaviorCorrection = Literal["truncate", "mask"]

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
LOSS_AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                      "seq-mean-token-sum-norm")
# the quantiles of the behavior weights each step reports (behavior_ratio_p05 ...)
RATIO_QUANTILES: tuple[float, ...] = (0.05, 0.5, 0.95)
FLOAT32_LOG_MAX = 88.0  # exp of more overflows float32


# --------------------------------------------------------------------------- input checks


def _check_finite(name: str, tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() and not torch.isfinite(tensor).all():
        raise ValueError(f"{name} contains NaN or inf")


def _check_shape(name: str, tensor: torch.Tensor, expected: torch.Size, expected_from: str) -> None:
    if tensor.shape != expected:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} but {expected_from} has shape {tuple(expected)}"
        )


def _check_mask(mask: torch.Tensor, name: str = "response_mask") -> torch.Tensor:
    """Validate a [B, T] mask and return it as float; every row needs one valid token."""
    if mask.dim() != 2:
        raise ValueError(f"{name} must be [batch, resp_len], got shape {tuple(mask.shape)}")
    mask = mask.to(torch.float32) if not mask.is_floating_point() else mask
    if ((mask != 0) & (mask != 1)).any():
        raise ValueError(f"{name} must hold only 0 and 1")
    empty_rows = (mask.sum(dim=-1) == 0).nonzero().flatten().tolist()
    if empty_rows:
        raise ValueError(f"{name} has no valid token in row(s) {empty_rows}")
    return mask


def _check_token_tensors(mask: torch.Tensor, **tensors: torch.Tensor) -> torch.Tensor:
    """Check every [B, T] tensor against the mask's shape and for NaN; return the float mask."""
    mask = _check_mask(mask)
    for name, tensor in tensors.items():
        _check_shape(name, tensor, mask.shape, "response_mask")
        _check_finite(name, tensor)
    return mask


# --------------------------------------------------------------------------- masked statistics


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1. values, mask: same shape. Returns a scalar or
    the tensor reduced over ``dim``."""
    _check_shape("values", values, mask.shape, "mask")
    mask = mask.to(values.dtype)
    product = values * mask
    return product.sum() if dim is None else product.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1.

    values, mask: same shape. ``dim=None`` gives a scalar over every valid entry; ``dim=-1``
    on [B, T] gives [B] per-row means. A reduction over no valid entry is an error.
    """
    count = masked_sum(torch.ones_like(values), mask, dim)
    if (count == 0).any():
        raise ValueError("masked_mean over a mask with no valid entry")
    return masked_sum(values, mask, dim) / count


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over the mask, a scalar. values, mask: same shape.

    ``unbiased`` applies Bessel's correction n / (n - 1) (needs at least two valid entries).
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.to(values.dtype).sum()
        if count < 2:
            raise ValueError("unbiased masked_var needs at least two valid entries")
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise ``values`` to mean 0 and (unbiased) variance 1 over the mask.

    values, mask: same shape; returns the same shape with padding set to 0.
    ``shift_mean=False`` only rescales (keeps the mean): the choice of OpenAI's
    lm-human-preferences for rewards, where the sign of the mean carries meaning. A single valid
    entry has no spread to scale by: it is only centred (a batch of one one-token response).
    """
    mean = masked_mean(values, mask)
    if mask.to(values.dtype).sum() < 2:
        return (values - mean if shift_mean else values) * mask.to(values.dtype)
    variance = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(variance + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(values.dtype)


# --------------------------------------------------------------------------- KL and rewards


def kl_per_token(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k1"
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi.

    logprobs, ref_logprobs: [B, T] log-probabilities of the sampled tokens. Returns [B, T].
    Estimators after Schulman, "Approximating KL divergence" (2020), with r = pi_ref / pi:
      k1 = -log r = logprobs - ref_logprobs        (unbiased, can be negative)
      k2 = 0.5 (log r)^2                           (biased, low variance, >= 0)
      k3 = (r - 1) - log r                         (unbiased, >= 0)
    The reference is detached: no gradient ever flows into the frozen SFT model.
    """
    _check_shape("ref_logprobs", ref_logprobs, logprobs.shape, "logprobs")
    _check_finite("logprobs", logprobs)
    _check_finite("ref_logprobs", ref_logprobs)
    log_ratio = ref_logprobs.detach() - logprobs  # log r
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def last_token_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last valid token of each row. response_mask: [B, T]. Returns [B] long."""
    mask = _check_mask(response_mask)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask > 0, positions, -1).max(dim=-1).values


def token_rewards(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_estimator: KLEstimator = "k1",
    truncated: torch.Tensor | None = None,
    truncation_penalty: float = 0.0,
    score_clip: float | None = None,
    turn_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards of InstructGPT's PPO: r_t = -beta KL_t, plus r_RM at the last token.

    logprobs, ref_logprobs, response_mask: [B, T]; scores: [B] (already normalised if the
    caller normalises, see ``RunningMoments``). ``truncated``: [B] bool, True where a response
    hit the length cap without an end-of-sequence token; ``truncation_penalty`` is added to its
    score (use a negative number), after ``score_clip`` clips scores to [-score_clip, score_clip].

    In an episode ``response_mask`` is 1 at the policy's tokens only (the environment's are 0,
    like padding): the KL is per policy token, the score lands on the last policy token, and
    ``turn_rewards`` [B, T] (an environment's reward for a turn, on that turn's last policy token)
    are added where they sit; one on a token the mask leaves out is an error.

    Returns (rewards [B, T], kl [B, T]), both zero at padding. The RM score lands on the last
    real token of each row, so rows of different lengths each get theirs at their own end.
    """
    mask = _check_token_tensors(response_mask, logprobs=logprobs, ref_logprobs=ref_logprobs)
    _check_shape("scores", scores, mask.shape[:1], "response_mask[:, 0]")
    _check_finite("scores", scores)
    if kl_coef < 0 or not math.isfinite(kl_coef):
        raise ValueError(f"kl_coef must be a finite number >= 0, got {kl_coef}")
    scores = scores.detach().float()
    if score_clip is not None:
        scores = scores.clamp(-score_clip, score_clip)
    if truncated is not None:
        _check_shape("truncated", truncated, mask.shape[:1], "response_mask[:, 0]")
        scores = scores + truncation_penalty * truncated.float()
    kl = kl_per_token(logprobs.detach().float(), ref_logprobs.float(), kl_estimator) * mask
    rewards = -kl_coef * kl
    last = last_token_index(mask)
    rewards = rewards.scatter_add(1, last.unsqueeze(1), scores.unsqueeze(1))
    if turn_rewards is not None:
        _check_shape("turn_rewards", turn_rewards, mask.shape, "response_mask")
        _check_finite("turn_rewards", turn_rewards)
        if bool(((turn_rewards != 0) & (mask == 0)).any()):
            raise ValueError("turn_rewards has a reward on a token response_mask leaves out: GAE would skip it")
        rewards = rewards + turn_rewards.detach().float()
    return rewards, kl


def distill_rewards(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, response_mask: torch.Tensor,
                    distill_coef: float) -> torch.Tensor:
    """On-policy distillation's token rewards: -distill_coef (log pi_old(y_t) - log pi_teacher(y_t))
    at every policy token, the sampled-token estimate of the reverse KL to the teacher (GKD, Agarwal
    et al. 2024), added to the token rewards as the KL tether is. logprobs, teacher_logprobs,
    response_mask: [B, T] (the mask 1 at the policy's tokens: an episode's environment tokens and
    padding get 0). Returns [B, T]."""
    mask = _check_token_tensors(response_mask, logprobs=logprobs, teacher_logprobs=teacher_logprobs)
    if distill_coef < 0 or not math.isfinite(distill_coef):
        raise ValueError(f"distill_coef must be a finite number >= 0, got {distill_coef}")
    return -distill_coef * (logprobs.detach().float() - teacher_logprobs.float()) * mask


def distill_advantages(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, response_mask: torch.Tensor,
                       distill_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure on-policy distillation (learner.distill_only): each token's advantage is its own
    negative reverse KL to the teacher times distill_coef, not discounted across tokens and not
    whitened (Thinking Machines, "On-Policy Distillation", 2025). Shapes as ``distill_rewards``.
    Returns (advantages [B, T], returns [B, T]: the same; no critic reads them)."""
    advantages = distill_rewards(logprobs, teacher_logprobs, response_mask, distill_coef)
    return advantages, advantages


def episode_totals(row_totals: torch.Tensor, episode_ids: torch.Tensor, episodes: int) -> torch.Tensor:
    """The total reward of each episode: row_totals [B] (each row's sum of token rewards) summed
    over the rows of one episode, episode_ids [B] long in [0, episodes). Returns [episodes]. An
    episode that rewrote its context is several rows (its parts); a group estimator compares one
    outcome per episode, so an episode that splits weighs no more than one that does not."""
    _check_shape("episode_ids", episode_ids, row_totals.shape, "row_totals")
    _check_finite("row_totals", row_totals)
    return torch.zeros(episodes, dtype=row_totals.dtype, device=row_totals.device).index_add(0, episode_ids,
                                                                                            row_totals)


def rewards_across_parts(rewards: torch.Tensor, response_mask: torch.Tensor, later: torch.Tensor) -> torch.Tensor:
    """Token rewards [B, T] of rows that may be parts of one episode, with each row's last valid
    token also given the undiscounted sum of the token rewards of its episode's later parts
    (``later`` [B, B] bool: row j is a later part of row i's episode). Reward-to-go then runs per
    row as on the whole episode, exactly at gamma = 1 (at gamma < 1 a later part's rewards are not
    discounted by the length of the parts in between); GAE too at gamma = lambda = 1, while at
    lambda < 1 a part's end bootstraps from the later parts' actual rewards, not the critic's value
    of the next part's first token (its context differs). Returns [B, T]; rows with no later part
    unchanged."""
    mask = _check_mask(response_mask)
    _check_shape("rewards", rewards, mask.shape, "response_mask")
    _check_shape("later", later, (mask.shape[0], mask.shape[0]), "[B, B]")
    to_go = later.to(rewards.dtype) @ masked_sum(rewards, mask, dim=-1)
    return rewards.scatter_add(1, last_token_index(mask).unsqueeze(1), to_go.unsqueeze(1))


class RunningMoments:
    """Running mean and standard deviation of RM scores (Chan et al. parallel update).

    Used to normalise scores across steps; its state goes into the learner checkpoint so a
    resumed run normalises exactly as the uninterrupted one would.
    """

    def __init__(self) -> None:
        self.mean = 0.0
        self.var = 1.0
        self.count = 0

    def update(self, scores: torch.Tensor) -> None:
        """Fold a batch of scores [N] into the running moments."""
        _check_finite("scores", scores)
        scores = scores.detach().double().flatten()
        batch_count = scores.numel()
        if batch_count == 0:
            return
        batch_mean = scores.mean().item()
        batch_var = scores.var(unbiased=False).item()
        total = self.count + batch_count
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * batch_count + delta**2 * self.count * batch_count / total
        self.mean += delta * batch_count / total
        self.var = m2 / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.var * self.count / (self.count - 1)) if self.count > 1 else 1.0

    def normalize(self, scores: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
        """Scores [N] scaled by the running std (and shifted by the running mean)."""
        centred = scores - self.mean if shift_mean else scores
        return centred / (self.std + eps)

    def state_dict(self) -> dict[str, float | int]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), int(state["count"])


# --------------------------------------------------------------------------- advantages


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over token sequences.

    rewards, values, response_mask: [B, T]. Returns (advantages [B, T], returns [B, T]),
    zero at masked positions; returns = advantages + values (the critic's regression target).

    delta_t = r_t + gamma V(s_{t+1}) - V(s_t);  A_t = delta_t + gamma lambda A_{t+1}.
    The recursion runs over valid tokens only: a masked position (left padding of a prompt,
    right padding after the response, a hole in the middle) is skipped, so "t+1" is the next
    valid token and the value after the last valid token is 0 (the episode ends there).
    Values are detached: the critic learns from ``value_loss``, not through the advantages.
    """
    mask = _check_token_tensors(response_mask, rewards=rewards, values=values)
    rewards, values = rewards.detach().float(), values.detach().float()
    batch, length = mask.shape
    next_value = torch.zeros(batch, device=values.device)
    next_advantage = torch.zeros(batch, device=values.device)
    advantages = torch.zeros_like(values)
    for t in reversed(range(length)):
        valid = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(valid, advantage, 0.0)
        next_value = torch.where(valid, values[:, t], next_value)
        next_advantage = torch.where(valid, advantage, next_advantage)
    returns = (advantages + values) * mask
    return advantages, returns


def vtrace_targets(
    rewards: torch.Tensor,
    values: torch.Tensor,
    log_ratios: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    rho_clip: float = 1.0,
    c_clip: float = 1.0,
) -> torch.Tensor:
    """V-trace value targets (Espeholt et al. 2018, IMPALA, eq. 1, with its lambda): the critic's
    regression targets when the samples came from an older policy mu than the one trained, pi.

    rewards, values, log_ratios (log pi - log mu per token: proximal minus behavior logprobs),
    response_mask: [B, T]. Returns v [B, T], zero at masked positions.

    v_s = V(x_s) + sum_{t>=s} gamma^(t-s) (prod_{i=s}^{t-1} c_i) rho_t delta_t,
    delta_t = r_t + gamma V(x_{t+1}) - V(x_t), rho_t = min(rho_clip, pi/mu), c_i = lam min(c_clip, pi/mu);
    computed backwards: v_s - V(x_s) = rho_s delta_s + gamma c_s (v_{s+1} - V(x_{s+1})).
    With every ratio 1 (k = 0: the behavior policy is the one trained) and both clips >= 1 this
    is GAE's return, A_s + V(x_s). rho_clip bounds how far a stale sample moves the fixed point
    (the value of min(rho_clip pi, mu), normalised); c_clip how far its correction reaches back.
    Masked positions are skipped as in ``gae_advantages`` (the next valid token is "t+1").
    """
    mask = _check_token_tensors(response_mask, rewards=rewards, values=values, log_ratios=log_ratios)
    if rho_clip <= 0 or c_clip <= 0:
        raise ValueError(f"rho_clip and c_clip must be > 0, got {rho_clip} and {c_clip}")
    rewards, values = rewards.detach().float(), values.detach().float()
    ratios = torch.exp(log_ratios.detach().float())
    rho, c = ratios.clamp(max=rho_clip), lam * ratios.clamp(max=c_clip)
    batch, length = mask.shape
    next_value = torch.zeros(batch, device=values.device)
    next_correction = torch.zeros(batch, device=values.device)  # v_{t+1} - V(x_{t+1})
    targets = torch.zeros_like(values)
    for t in reversed(range(length)):
        valid = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        correction = rho[:, t] * delta + gamma * c[:, t] * next_correction
        targets[:, t] = torch.where(valid, values[:, t] + correction, 0.0)
        next_value = torch.where(valid, values[:, t], next_value)
        next_correction = torch.where(valid, correction, next_correction)
    return targets * mask


def _group_scores(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """[num_prompts * n] -> [num_prompts, n]; responses to one prompt are contiguous."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be [batch], got shape {tuple(scores.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for a group baseline, got {group_size}")
    if scores.numel() % group_size:
        raise ValueError(f"batch of {scores.numel()} scores is not a multiple of group_size {group_size}")
    _check_finite("scores", scores)
    return scores.detach().float().view(-1, group_size)


def grpo_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    group_size: int,
    normalize_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO outcome advantages (Shao et al. 2024, DeepSeekMath): A_i = (R_i - mean_g) / std_g.

    scores: [B] with B = prompts x group_size, the responses of one prompt contiguous;
    response_mask: [B, T]. Returns [B, T]: each response's advantage on all of its tokens.
    ``normalize_by_std=False`` drops the division (Dr. GRPO, Liu et al. 2025). std is unbiased.
    """
    mask = _check_mask(response_mask)
    grouped = _group_scores(scores, group_size)
    centred = grouped - grouped.mean(dim=-1, keepdim=True)
    if normalize_by_std:
        centred = centred / (grouped.std(dim=-1, keepdim=True) + eps)
    return centred.flatten().unsqueeze(-1) * mask


def rloo_advantages(scores: torch.Tensor, response_mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO advantages (Ahmadian et al. 2024): A_i = R_i - mean of the other n-1 responses.

    scores: [B] with the group_size responses of a prompt contiguous; response_mask: [B, T].
    Returns [B, T], each response's advantage on all of its tokens.
    """
    mask = _check_mask(response_mask)
    grouped = _group_scores(scores, group_size)
    baseline = (grouped.sum(dim=-1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - baseline).flatten().unsqueeze(-1) * mask


def reinforce_pp_advantages(
    rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted reward-to-go of the token rewards, whitened over the batch.

    rewards: [B, T] token rewards from ``token_rewards`` (per-token -beta KL plus the RM score at
    the last token); response_mask: [B, T]. Returns (advantages [B, T], returns [B, T]):
    returns G_t = sum_{l>=0} gamma^l r_{t+l} over valid tokens, advantages = whiten(G) over
    every valid token of the batch (the global baseline that replaces the critic).
    """
    zeros = torch.zeros_like(rewards)
    # Reward-to-go is GAE with V = 0 and lambda = 1: the same masked recursion, written once.
    returns, _ = gae_advantages(rewards, zeros, response_mask, gamma=gamma, lam=1.0)
    return masked_whiten(returns, response_mask), returns


# --------------------------------------------------------------------------- losses


def aggregate_loss(loss_per_token: torch.Tensor, response_mask: torch.Tensor, loss_aggregation: LossAggregation,
                   norm_length: float | None = None) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar.

    - ``token-mean``: sum over every valid token / number of valid tokens. Long responses weigh
      more. DAPO (Yu et al. 2025), veRL's default, TRL's PPOTrainer (masked_mean).
    - ``seq-mean-token-mean``: mean over sequences of each sequence's token mean. Every
      response weighs the same. The GRPO paper (DeepSeekMath) and OpenRLHF's PPO actor.
    - ``seq-mean-token-sum``: mean over sequences of each sequence's token sum. No length
      normalisation inside a sequence; classic REINFORCE.
    - ``seq-mean-token-sum-norm``: each sequence's token sum over ``norm_length``, a constant (the
      generation budget), mean over sequences: Dr. GRPO (Liu et al. 2025), which removes the
      per-response length normaliser that biases GRPO toward long wrong answers.
    """
    mask = _check_token_tensors(response_mask, loss_per_token=loss_per_token)
    if loss_aggregation == "token-mean":
        return masked_mean(loss_per_token, mask)
    if loss_aggregation == "seq-mean-token-mean":
        return masked_mean(loss_per_token, mask, dim=-1).mean()
    if loss_aggregation == "seq-mean-token-sum":
        return masked_sum(loss_per_token, mask, dim=-1).mean()
    if loss_aggregation == "seq-mean-token-sum-norm":
        if norm_length is None or norm_length <= 0:
            raise ValueError(f"seq-mean-token-sum-norm divides by a constant length > 0, got norm_length={norm_length}")
        return masked_sum(loss_per_token, mask, dim=-1).mean() / norm_length
    raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}, got {loss_aggregation!r}")


def data_parallel_scale(local_mask: torch.Tensor, minibatch_mask: torch.Tensor, loss_aggregation: LossAggregation,
                        world_size: int) -> float:
    """Factor for one rank's loss, aggregated over its rows of a minibatch, such that the mean over
    ranks of the scaled losses (what data-parallel gradient averaging computes) is the loss
    aggregated over the whole minibatch, as one rank would compute it.

    local_mask: [b, T] this rank's rows; minibatch_mask: [B, T] all rows (b about B / world_size).
    token-mean: world_size * local tokens / all tokens (ranks whose rows hold more tokens weigh
    more); seq-mean-*: world_size * b / B (= 1: every rank holds as many sequences).
    """
    if loss_aggregation == "token-mean":
        return world_size * float(local_mask.sum()) / float(minibatch_mask.sum())
    if loss_aggregation in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        return world_size * local_mask.shape[0] / minibatch_mask.shape[0]
    raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}, got {loss_aggregation!r}")


def sequence_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence ratio (Zheng et al. 2025, eq. 7): the length-normalised geometric mean of a
    sequence's token ratios, s_i = exp(1/|y_i| sum_t log rho_t). log_ratio, response_mask: [B, T]
    (log pi_theta - log pi_old). Returns [B]; its gradient is that of the mean of the log ratios."""
    mask = _check_token_tensors(response_mask, log_ratio=log_ratio)
    return torch.exp(masked_mean(log_ratio, mask, dim=-1))


def behavior_weights(
    old_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    correction: BehaviorCorrection = "truncate",
    level: RatioLevel = "token",
    high: float | None = 2.0,
    low: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The weights that correct each token's gradient for the behavior policy (the rollout's
    engine, possibly stale) not being the proximal one: w_t = pi_old / pi_behavior, no gradient.

    old_logprobs, behavior_logprobs, response_mask: [B, T]. Returns (weights [B, T], stats).
    - ``level`` token: each token's own w_t; sequence: the sequence's W_i = prod_t w_t on each of
      its tokens (sequence-level importance sampling, Liu et al. 2025).
    - ``correction`` truncate: min(w, high) (truncated IS; ``high`` None: no cap); mask: w where
      low <= w <= high, else 0 (masked IS, MIS: Liu et al. 2025; IcePop's two-sided token mask,
      Ling team 2025; ``low`` None: one-sided). A masked token keeps its place in the loss's
      normaliser with weight 0, as in both papers' estimators.

    stats: the share of tokens whose weight was truncated or masked (``correction_truncated_frac``,
    ``correction_masked_frac``), of sequences (``correction_seq_truncated_frac``, ``correction_seq_masked_frac``:
    a sequence with any such token at token level, the sequence itself at sequence level), the
    mean weight, and the quantiles (``RATIO_QUANTILES``) of the token ratios w_t and of the
    sequence ratios W_i over the batch (``behavior_ratio_p05`` ..., ``behavior_seq_ratio_p05`` ...).
    """
    mask = _check_token_tensors(response_mask, old_logprobs=old_logprobs, behavior_logprobs=behavior_logprobs)
    if correction not in ("truncate", "mask"):
        raise ValueError(f"behavior correction must be truncate or mask, got {correction!r}")
    if level not in ("token", "sequence"):
        raise ValueError(f"behavior correction level must be token or sequence, got {level!r}")
    if (high is not None and high <= 0) or (low is not None and low < 0) or (
            high is not None and low is not None and low >= high):
        raise ValueError(f"behavior weight bounds must satisfy 0 <= low < high, got low={low}, high={high}")
    with torch.no_grad():
        valid = mask > 0
        log_weights = (old_logprobs - behavior_logprobs).double() * mask
        sequence_log = log_weights.sum(dim=-1)  # log W_i
        # exp of a sequence's sum overflows float64 past ~709: the bounds decide on the logs
        log = sequence_log.unsqueeze(-1).expand_as(log_weights) if level == "sequence" else log_weights
        above = log > math.log(high) if high is not None else torch.zeros_like(valid)
        below = log < math.log(low) if low else torch.zeros_like(valid)
        # a weight past float32's range (an uncapped sequence's product) is held at its largest
        weights = torch.exp(log.clamp(max=FLOAT32_LOG_MAX))
        if correction == "truncate":
            affected = above & valid
            weights = torch.where(above, torch.full_like(weights, high or 0.0), weights)
        else:
            affected = (above | below) & valid
            weights = torch.where(above | below, torch.zeros_like(weights), weights)
        weights = (weights * mask).to(old_logprobs.dtype)
        token_frac = float(affected.sum()) / float(valid.sum())
        seq_frac = float(affected.any(dim=-1).double().mean())
        token_q = _quantiles(torch.exp(log_weights[valid].clamp(max=700.0)), RATIO_QUANTILES)
        seq_q = _quantiles(torch.exp(sequence_log.clamp(max=700.0)), RATIO_QUANTILES)
        kind = "truncated" if correction == "truncate" else "masked"
        # not behavior_truncated_frac: that is the token-level health buffer.max_staleness auto reads
        stats = {f"correction_{kind}_frac": token_frac, f"correction_seq_{kind}_frac": seq_frac,
                 "behavior_weight_mean": float(masked_mean(weights.double(), mask.double())),
                 **{f"behavior_ratio_p{round(q * 100):02d}": float(v) for q, v in zip(RATIO_QUANTILES, token_q)},
                 **{f"behavior_seq_ratio_p{round(q * 100):02d}": float(v) for q, v in zip(RATIO_QUANTILES, seq_q)}}
    return weights, stats


def _quantiles(values: torch.Tensor, quantiles: tuple[float, ...]) -> list[float]:
    """``torch.quantile``'s linear interpolation, by one sort: it refuses more than 2^24 values (a
    batch's tokens can be more)."""
    ordered = values.flatten().sort().values
    last = ordered.numel() - 1
    result = []
    for q in quantiles:
        position = q * last
        low = int(math.floor(position))
        high = min(low + 1, last)
        result.append(float(ordered[low] + (ordered[high] - ordered[low]) * (position - low)))
    return result


@dataclass(frozen=True)
class PolicyLossOptions:
    """How ``ppo_policy_loss`` clips, weighs and sums: the learner's settings of the same names
    (``learner.*``), each checked here, where the options are made."""
    clip_eps: float = 0.2  # eps: rho clipped to [1 - eps, 1 + eps_high] (Schulman et al. 2017)
    clip_eps_high: float | None = None  # eps_high, None: clip_eps; a larger one is DAPO's "clip-higher"
    dual_clip: float | None = None  # c > 1: for A < 0 the loss also bounded by -c A (Ye et al. 2020)
    loss_aggregation: LossAggregation = "token-mean"  # [B, T] losses to a scalar (``aggregate_loss``)
    ratio_level: RatioLevel = "token"  # sequence: GSPO-token's s_i,t (Zheng et al. 2025, eq. 13)
    policy_loss: PolicyLoss = "ppo"  # cispo: the clipped ratio as a weight (MiniMax-M1, Chen et al. 2025)
    norm_length: float | None = None  # seq-mean-token-sum-norm's constant length (Dr. GRPO)

    def __post_init__(self) -> None:
        if self.clip_eps <= 0 or self.eps_high <= 0:
            raise ValueError(f"clip ranges must be > 0, got clip_eps={self.clip_eps}, clip_eps_high={self.eps_high}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.policy_loss not in ("ppo", "cispo"):
            raise ValueError(f"policy_loss must be ppo or cispo, got {self.policy_loss!r}")
        if self.policy_loss == "cispo" and (self.ratio_level != "token" or self.dual_clip is not None):
            raise ValueError("cispo clips each token's weight: it takes ratio_level token and no dual_clip")
        if self.ratio_level not in ("token", "sequence"):
            raise ValueError(f"ratio_level must be token or sequence, got {self.ratio_level!r}")

    @property
    def eps_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    behavior_weights: torch.Tensor | None = None,
    options: PolicyLossOptions = PolicyLossOptions(),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss with the options tether's learner uses (``PolicyLossOptions``).

    logprobs: [B, T] of the policy being trained (carries the gradient);
    old_logprobs: [B, T] of the anchor policy. On-policy this is pi_old; with stale samples it
    is the *proximal* policy: the learner's own logprobs recomputed at the start of the step;
    advantages, response_mask: [B, T]; behavior_weights: [B, T] (``behavior_weights``), or None.

    L = -w_t min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps_high) A_t),  rho_t = pi_theta / pi_old
    - ``clip_eps_high`` defaults to ``clip_eps`` (a larger one is DAPO's "clip-higher").
    - ``dual_clip`` = c > 1 (Ye et al. 2020, "Mastering complex control in MOBA games"): for
      A < 0 the loss is also bounded by -c A, so one very unlikely token cannot blow up a step.
    - Decoupled off-policy PPO (Hilton et al. 2022, "Batch size-invariance for policy
      optimization"; AReaL): w_t = pi_old / pi_behavior, truncated or masked
      (``behavior_weights``); without them w_t = 1 and the loss is plain PPO.
    - ``ratio_level`` sequence: GSPO-token (Zheng et al. 2025, eq. 13): rho_t is replaced by
      s_i,t = sg[s_i] pi_theta(y_t) / sg[pi_theta(y_t)], the sequence ratio's value
      (``sequence_ratio``) with each token's own gradient, clipped per sequence; with one advantage
      per sequence and ``seq-mean-token-mean`` it is GSPO itself (eq. 5) in value and gradient.
    - ``policy_loss`` cispo (MiniMax-M1, Chen et al. 2025, eq. 4): L = -w_t sg(clip(rho_t, 1 - eps,
      1 + eps_high)) A_t log pi_theta(y_t): the clip bounds the weight and no token loses its
      gradient (PPO's clip drops the tokens outside the range).

    Returns (loss scalar, stats) with stats: ``clipfrac`` (share of tokens where the clipped
    branch is taken, or, in CISPO, the weight clipped), ``approx_kl`` (k3 estimate of
    KL(pi_old || pi_theta)), ``ratio_mean`` and ``dual_clip_frac``.
    """
    tensors = {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages}
    if behavior_weights is not None:
        tensors["behavior_weights"] = behavior_weights
    mask = _check_token_tensors(response_mask, **tensors)
    eps_low, eps_high, dual_clip = options.clip_eps, options.eps_high, options.dual_clip

    old_logprobs, advantages = old_logprobs.detach(), advantages.detach()
    log_ratio = logprobs - old_logprobs
    if options.ratio_level == "sequence":
        ratio = sequence_ratio(log_ratio.detach(), mask).unsqueeze(-1) * torch.exp(logprobs - logprobs.detach())
    else:
        ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    if options.policy_loss == "cispo":
        loss_per_token = -advantages * clipped_ratio.detach() * logprobs
        clipped_taken = (clipped_ratio != ratio).float()
    else:
        unclipped = -advantages * ratio
        clipped = -advantages * clipped_ratio
        loss_per_token = torch.maximum(unclipped, clipped)
        clipped_taken = (clipped > unclipped).float()

    dual_clipped_taken = torch.zeros_like(loss_per_token)
    if dual_clip is not None:
        lower_bound = -advantages * dual_clip
        negative = advantages < 0
        dual_clipped_taken = (negative & (loss_per_token > lower_bound)).float()
        loss_per_token = torch.where(negative, torch.minimum(loss_per_token, lower_bound), loss_per_token)

    if behavior_weights is not None:
        loss_per_token = loss_per_token * behavior_weights.detach()

    loss = aggregate_loss(loss_per_token, mask, options.loss_aggregation, options.norm_length)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean(clipped_taken, mask),
            "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "dual_clip_frac": masked_mean(dual_clipped_taken, mask),
        }
    return loss, {name: value.detach() for name, value in stats.items()}


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    value_clip: float | None = 0.2,
    loss_aggregation: LossAggregation = "token-mean",
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic loss: 0.5 (V - R)^2, or its clipped form (PPO2 baselines, "value clipping").

    values: [B, T] of the critic being trained (carries the gradient); old_values: [B, T] from
    the start of the step; returns: [B, T] targets from GAE; response_mask: [B, T].
    Clipped: 0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), ``value_clip=None``
    for unclipped. Returns (loss, stats) with ``vf_clipfrac`` (share where the clipped term wins)
    and ``value_mean``.
    """
    mask = _check_token_tensors(response_mask, values=values, old_values=old_values, returns=returns)
    old_values, returns = old_values.detach(), returns.detach()
    squared_error = (values - returns) ** 2
    clip_taken = torch.zeros_like(squared_error)
    if value_clip is not None:
        if value_clip <= 0:
            raise ValueError(f"value_clip must be > 0 or None, got {value_clip}")
        clipped_values = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
        clipped_error = (clipped_values - returns) ** 2
        clip_taken = (clipped_error > squared_error).float()
        squared_error = torch.maximum(squared_error, clipped_error)
    loss = 0.5 * aggregate_loss(squared_error, mask, loss_aggregation, norm_length)
    with torch.no_grad():
        stats = {"vf_clipfrac": masked_mean(clip_taken, mask), "value_mean": masked_mean(values, mask)}
    return loss, {name: value.detach() for name, value in stats.items()}
