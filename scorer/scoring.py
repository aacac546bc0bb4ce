"""Reference logprobs and RM scores for a list of samples: model forward passes, no transport."""

from __future__ import annotations

import torch
from torch import nn

from protocol.distributions import logprobs_from_logits
from protocol.samples import Sample
from protocol.sequences import classification_head, collate, gather_response

REWARD_OFFSET_KEY = "tether_reward_offset"  # in the RM's config.json: subtracted from every raw score


@torch.no_grad()
def reference_logprobs(reference: nn.Module, samples: list[Sample], pad_token_id: int,
                       temperature: float) -> list[torch.Tensor]:
    """Per-token log pi_ref of each sample's response, under the sampling temperature."""
    batch = collate(samples, pad_token_id).to(next(reference.parameters()).device)
    logits = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logprobs = logprobs_from_logits(gather_response(logits, batch.response_positions), batch.response_tokens,
                                    temperature)
    return [logprobs[i, :len(s.response_tokens)].float().cpu() for i, s in enumerate(samples)]


@torch.no_grad()
def reward_scores(reward_model: nn.Module, samples: list[Sample], pad_token_id: int) -> torch.Tensor:
    """One scalar per sample: the RM head on the last real token of prompt + response, minus the
    offset stored with the RM. Pooling is done here, not by the HF head, so padding side and
    pad-token conventions of the RM cannot change a score."""
    batch = collate(samples, pad_token_id).to(next(reward_model.parameters()).device)
    hidden = reward_model.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    last_hidden = hidden[torch.arange(len(samples), device=hidden.device), batch.last_positions]
    scores = classification_head(reward_model)(last_hidden).squeeze(-1).float()
    return (scores - float(getattr(reward_model.config, REWARD_OFFSET_KEY, 0.0))).cpu()
