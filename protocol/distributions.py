"""The distribution the rollout samples from, as both the scorer (reference logprobs) and the
learner (policy logprobs, entropy) compute it: pure tensor functions, shapes in each docstring.

vLLM reports logprobs of the processed distribution (``logprobs_mode="processed_logprobs"``):
logits divided by the temperature. Anything that changes that distribution (top-k / top-p
renormalisation) belongs here, so every role applies it the same way.
"""

from __future__ import annotations

import torch


def logprobs_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probabilities of the taken tokens.

    logits: [B, T, V] (position t scores token t, i.e. already shifted); tokens: [B, T] int.
    Returns [B, T]. Logits are divided by the sampling ``temperature`` first, so the result is
    the log-probability under the same distribution the rollout sampled from (vLLM's logprobs
    are of the temperature-scaled distribution).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.dim() != 3:
        raise ValueError(f"logits must be [batch, resp_len, vocab], got shape {tuple(logits.shape)}")
    if tokens.shape != logits.shape[:2]:
        raise ValueError(f"tokens has shape {tuple(tokens.shape)} but logits[..., 0] has shape "
                         f"{tuple(logits.shape[:2])}")
    if not torch.isfinite(logits).all():
        raise ValueError("logits contains NaN or inf")
    scaled = logits.float() / temperature
    # log_softmax then gather: numerically the same as gather minus logsumexp, one pass less.
    log_normaliser = torch.logsumexp(scaled, dim=-1)
    taken = torch.gather(scaled, -1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return taken - log_normaliser


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the (temperature-scaled) next-token distribution per position.

    logits: [B, T, V]. Returns [B, T] in nats: H = logsumexp(z) - sum softmax(z) z.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not torch.isfinite(logits).all():
        raise ValueError("logits contains NaN or inf")
    scaled = logits.float() / temperature
    probs = torch.softmax(scaled, dim=-1)
    return torch.logsumexp(scaled, dim=-1) - (probs * scaled).sum(dim=-1)
