"""The distribution the rollout samples from, as both the scorer (reference logprobs) and the
learner (policy logprobs, entropy) compute it: pure tensor functions, shapes in each docstring.

vLLM reports logprobs of the processed distribution (``logprobs_mode="processed_logprobs"``):
the banned tokens' logits set to -inf (its bad words), then logits divided by the temperature, then
top-k and top-p (the tokens outside them get no mass and the rest is renormalised). The policy's
logprobs are computed here the same way, so pi_prox / pi_behavior and the PPO ratio compare like
with like. The reference's are not truncated: the KL tether is to the whole SFT distribution
(truncated, a token outside the reference's nucleus would make it infinite), less the banned tokens,
which no response holds.
"""

from __future__ import annotations

import torch

from common.config import SamplingConfig

# no temperature and no truncation: the model's own distribution
PLAIN = SamplingConfig()

# A taken token the truncation leaves no mass (the learner's nucleus differs from the rollout's at
# the boundary, or moved during the update) gets this, not -inf: the ratio is ~0, gradients finite.
LOGPROB_FLOOR = -100.0


def _check_sampling(sampling) -> None:
    if not isinstance(sampling, SamplingConfig):  # a bare temperature, as these functions once took
        raise TypeError(f"sampling must be a SamplingConfig (config.sampling), got {type(sampling).__name__}")


def truncated_logits(scaled: torch.Tensor, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """``scaled`` [..., V] with the tokens top-k and top-p leave out set to -inf: vLLM's rule
    (``apply_top_k_top_p``), so both sides keep the same set. Top-k keeps the k largest (ties at the
    k-th kept); top-p then drops, smallest first, the tokens whose cumulative mass is <= 1 - p, and
    always keeps the largest. ``top_k`` 0 and ``top_p`` 1: unchanged."""
    if top_k <= 0 and top_p >= 1.0:
        return scaled
    ordered, order = scaled.sort(dim=-1, descending=False)
    if top_k > 0:
        kth = ordered[..., max(0, ordered.size(-1) - top_k)].unsqueeze(-1)
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    if top_p < 1.0:
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        dropped = cumulative <= 1 - top_p
        dropped[..., -1] = False
        ordered = ordered.masked_fill(dropped, float("-inf"))
    return torch.empty_like(ordered).scatter_(-1, order, ordered)


def scaled_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """``logits`` [..., V] (float32) as sampled: ``sampling.banned_tokens`` at -inf, divided by the
    temperature, then top-k / top-p (``truncated_logits``)."""
    if sampling.banned_tokens:
        logits = logits.index_fill(-1, torch.as_tensor(sampling.banned_tokens, device=logits.device), float("-inf"))
    return truncated_logits(logits / sampling.temperature, sampling.top_p, sampling.top_k)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, sampling: SamplingConfig = PLAIN) -> torch.Tensor:
    """Log-probabilities of the taken tokens.

    logits: [B, T, V] (position t scores token t, i.e. already shifted); tokens: [B, T] int.
    Returns [B, T]. The banned tokens are left out, logits divided by ``sampling.temperature``, then
    truncated by its ``top_k`` / ``top_p`` (``scaled_logits``), so the result is the log-probability under the
    same distribution the rollout sampled from; a token the truncation leaves out gets
    ``LOGPROB_FLOOR``.
    """
    _check_sampling(sampling)
    if logits.dim() != 3:
        raise ValueError(f"logits must be [batch, resp_len, vocab], got shape {tuple(logits.shape)}")
    if tokens.shape != logits.shape[:2]:
        raise ValueError(f"tokens has shape {tuple(tokens.shape)} but logits[..., 0] has shape "
                         f"{tuple(logits.shape[:2])}")
    if not torch.isfinite(logits).all():
        raise ValueError("logits contains NaN or inf")
    scaled = scaled_logits(logits.float(), sampling)
    # log_softmax then gather: numerically the same as gather minus logsumexp, one pass less.
    log_normaliser = torch.logsumexp(scaled, dim=-1)
    taken = torch.gather(scaled, -1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return (taken - log_normaliser).clamp(min=LOGPROB_FLOOR)


def entropy_from_logits(logits: torch.Tensor, sampling: SamplingConfig = PLAIN) -> torch.Tensor:
    """Entropy of the next-token distribution sampled from (banned tokens out, temperature, then
    top-k / top-p) per position.

    logits: [B, T, V]. Returns [B, T] in nats: H = logsumexp(z) - sum softmax(z) z, over the tokens
    the truncation keeps.
    """
    _check_sampling(sampling)
    if not torch.isfinite(logits).all():
        raise ValueError("logits contains NaN or inf")
    scaled = scaled_logits(logits.float(), sampling)
    probs = torch.softmax(scaled, dim=-1)
    kept = torch.where(torch.isfinite(scaled), scaled, torch.zeros_like(scaled))  # 0 x -inf is NaN
    return torch.logsumexp(scaled, dim=-1) - (probs * kept).sum(dim=-1)
