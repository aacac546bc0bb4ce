"""Reference logprobs and RM scores for a list of samples: model forward passes, no transport."""

from __future__ import annotations

import torch
from torch import nn

from common.config import SamplingConfig
from common.distributions import logprobs_from_logits
from common.models import classification_head
from common.packing import Packing, packed
from common.sequences import SequenceBatch, collate, pad_rows
from protocol.samples import Sample
from training.micro_batches import pass_shares, passes

# in the RM's config.json (tether rm's calibration): a score is (raw - offset) / scale
REWARD_OFFSET_KEY = "tether_reward_offset"
REWARD_SCALE_KEY = "tether_reward_scale"


@torch.no_grad()
def reference_logprobs(reference: nn.Module, samples: list[Sample], pad_token_id: int,
                       sampling: SamplingConfig, processor=None, packing: Packing = "none",
                       max_tokens: int | None = None) -> list[torch.Tensor]:
    """Per-token log pi_ref of each sample's response, under ``sampling`` (the scorer passes the
    rollout's sampling without its truncation: ``SamplingConfig.without_truncation``); a reference
    that sees reads each sample's images through its ``processor``. Forward passes of at most
    ``max_tokens`` tokens (None: one pass), laid out as ``packing`` (``common.packing``)."""
    batch = collate(samples, pad_token_id, processor).to(next(reference.parameters()).device)
    out: list[torch.Tensor | None] = [None] * len(samples)
    for rows, run in _passes(reference, batch, packing, max_tokens):
        logits = reference(**run.model_inputs, use_cache=False).logits
        logprobs = logprobs_from_logits(run.gather(logits), run.response_tokens, sampling)
        for k, i in enumerate(rows.tolist()):
            out[i] = logprobs[k, :len(samples[i].response_tokens)].float().cpu()
    return out


def _passes(model: nn.Module, batch: SequenceBatch, packing: Packing, max_tokens: int | None):
    """(rows, the pass of those rows) for each forward pass over ``batch``: of at most ``max_tokens``
    tokens, as ``packing`` lays them out (a row longer than that goes alone)."""
    for rows in passes(batch.lengths, batch.input_ids, packing, None, max_tokens):
        yield rows, packed(batch.select(rows), packing, model)


def pass_shares_of(samples: list[Sample], max_tokens: int | None) -> dict[str, float]:
    """``training.micro_batches.pass_shares`` of the samples' rows in passes of ``max_tokens``."""
    batch = collate(samples, 0)
    return pass_shares(batch.input_ids, batch.lengths, None, max_tokens)


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), a reward term: 0 up to
    max_length - buffer tokens, then falling linearly to -penalty at max_length, -penalty past it.
    lengths: [B] the responses' policy tokens. Returns [B]."""
    if not 0 < buffer < max_length:
        raise ValueError(f"the overlong buffer ({buffer}) must be over 0 and under the length limit ({max_length})")
    past = (lengths.double() - (max_length - buffer)).clamp(min=0.0, max=float(buffer))
    return -penalty * past / buffer


@torch.no_grad()
def reward_scores(reward_model: nn.Module, samples: list[Sample], pad_token_id: int, processor=None,
                  packing: Packing = "none", max_tokens: int | None = None) -> torch.Tensor:
    """One scalar per sample, from the samples' own token ids (an RM that reads the policy's
    tokens): the RM head on the last real token of prompt + response, minus the offset stored
    with the RM. Pooling is done here, not by the HF head, so padding side and pad-token
    conventions of the RM cannot change a score. An RM that sees reads each sample's images
    through its ``processor``. Passes as ``reference_logprobs`` makes them."""
    batch = collate(samples, pad_token_id, processor).to(next(reward_model.parameters()).device)
    scores = torch.zeros(len(samples))
    for rows, run in _passes(reward_model, batch, packing, max_tokens):
        scores[rows.cpu()] = _pooled_scores(reward_model, run.last_positions, **run.model_inputs)
    return scores


@torch.no_grad()
def reward_scores_of_tokens(reward_model: nn.Module, rows: list[list[int]]) -> torch.Tensor:
    """One scalar per row of the reward model's own token ids (``reward_model_tokens``): for an RM
    whose vocabulary is not the policy's. Pooled as ``reward_scores``."""
    device = next(reward_model.parameters()).device
    input_ids, attention_mask = pad_rows(rows)
    return _pooled_scores(reward_model, (attention_mask.sum(dim=1) - 1).to(device), input_ids=input_ids.to(device),
                          attention_mask=attention_mask.to(device))


def _pooled_scores(reward_model: nn.Module, last_positions: torch.Tensor, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor | None, **inputs) -> torch.Tensor:
    """The scores of rows ``input_ids``, ``attention_mask`` [B, L] right-padded (or a packed pass's,
    ``SequenceBatch.model_inputs``), read at ``last_positions`` [B]; ``inputs``: the rows' image inputs
    (an RM that sees), a packed pass's positions and segments. Returns [B] on the CPU, calibrated by
    the offset and scale stored with the RM."""
    offset = float(getattr(reward_model.config, REWARD_OFFSET_KEY, 0.0))
    scale = float(getattr(reward_model.config, REWARD_SCALE_KEY, 1.0))
    return ((raw_scores(reward_model, input_ids, attention_mask, last_positions, **inputs) - offset) / scale).cpu()


def raw_scores(reward_model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               last_positions: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
    """[B] fp32, uncalibrated: the RM's head on the hidden state of each row's last real token
    (``last_positions`` [B]), as the scorer reads it and tether rm trains it; ``inputs``: the image
    inputs of an RM that sees, a packed pass's position_ids and segments (its packed rows hold every
    row's tokens, which ``last_positions`` index one packed row after another)."""
    from training.lora import is_lora

    model = reward_model.get_base_model() if is_lora(reward_model) else reward_model
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, **inputs).last_hidden_state
    if "position_ids" in inputs:  # a packed pass: last_positions index its rows' nodes one after another
        last_hidden = hidden.reshape(-1, hidden.shape[-1])[last_positions]
    else:
        last_hidden = hidden[torch.arange(len(input_ids), device=hidden.device), last_positions]
    return classification_head(model)(last_hidden).squeeze(-1).float()


def reward_model_tokens(sequence: str, conversation: list[dict[str, str]] | None, tokenizer,
                        max_tokens: int | None = None) -> list[int]:
    """What a reward model with its own tokenizer reads, as its token ids: the ``conversation`` (the
    chat with the response as the assistant's turn, or an episode's every turn) through the RM's
    chat template (which writes its special tokens itself), when there is one and the RM has a
    template; else ``sequence``, prompt and response decoded together (decoding them apart could
    change the text where they meet), tokenized with the RM's special tokens. Past ``max_tokens``
    the start is cut: the score is read at the last token."""
    if conversation is not None and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(sequence)["input_ids"]
    return list(ids[-max_tokens:] if max_tokens and len(ids) > max_tokens else ids)
