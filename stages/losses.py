"""The offline stages' math: pure tensor functions, no I/O, no DeepSpeed.

``B`` = rows, ``L`` = sequence length (right-padded), ``V`` = vocab, ``G`` = prompts (groups),
``K`` = responses per prompt (padded to the group's most), ``P`` = preference pairs.

==================================  ===========================================================
formula                             function
==================================  ===========================================================
-log pi(x_t | x_<t) at the          ``token_nll`` (SFT: the mean over every loss token of a
  tokens taught                       batch, as transformers' ``labels`` loss)
log pi(y | x) = sum_t log pi(y_t)   ``sequence_logprobs`` (DPO)
loss(r) = -1/C(K,2) E_(x, y_w, y_l)  ``kwise_ranking_loss`` (InstructGPT, Ouyang et al. 2022,
  [log sigmoid(r(x,y_w) -             eq. 1): every pair a ranking orders, from one score per
  r(x,y_l))]                          response, so one forward pass of the K responses serves all
                                      C(K, 2) pairs; the mean over a prompt's pairs keeps a
                                      prompt of K = 9 from outweighing one of K = 2 by 36 to 1
L_DPO = -log sigmoid(beta           ``dpo_loss`` (Rafailov et al. 2023, eq. 7); the implicit
  [(log pi(y_w) - log pi_ref(y_w))    rewards beta (log pi - log pi_ref) are its metrics
  - (log pi(y_l) - log pi_ref(y_l))])
==================================  ===========================================================
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.distributions import logprobs_from_logits


def token_nll(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss at each position whose next token is taught. logits: [B, L, V] (any dtype,
    computed in fp32); input_ids, loss_mask: [B, L] (loss_mask 1 at the tokens taught: a response,
    an assistant's turn). Returns (nll [B, L - 1], mask [B, L - 1] float): position ``p`` predicts
    token ``p + 1``, so the mask is ``loss_mask`` shifted by one."""
    if logits.shape[:2] != input_ids.shape or input_ids.shape != loss_mask.shape:
        raise ValueError(f"logits {tuple(logits.shape)}, input_ids {tuple(input_ids.shape)} and loss_mask "
                         f"{tuple(loss_mask.shape)} must agree on [B, L]")
    return -logprobs_from_logits(logits[:, :-1], input_ids[:, 1:]), loss_mask[:, 1:].float()


def sequence_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """log pi(response | prompt) of each row: the sum of its taught tokens' logprobs. Shapes as
    ``token_nll``; returns [B] fp32."""
    nll, mask = token_nll(logits, input_ids, loss_mask)
    return -(nll * mask).sum(dim=1)


def kwise_ranking_loss(scores: torch.Tensor, ranks: torch.Tensor, present: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reward model's loss over every pair of each prompt's ranked responses.

    scores: [G, K] float, one scalar per response; ranks: [G, K] (0 the best; equal ranks are a
    tie and make no pair); present: [G, K] bool (False where a group has fewer than K responses).
    Returns (loss [G]: the mean over the group's pairs of -log sigmoid(r_w - r_l), 0 for a group
    without a pair; pairs [G] long: how many pairs; correct [G] long: pairs whose better response
    scores higher)."""
    if scores.shape != ranks.shape or scores.shape != present.shape or scores.dim() != 2:
        raise ValueError(f"scores {tuple(scores.shape)}, ranks {tuple(ranks.shape)} and present "
                         f"{tuple(present.shape)} must all be [G, K]")
    if not torch.isfinite(scores[present]).all():
        raise ValueError("scores contains NaN or inf")
    # pair (i, j): response i ranked above response j, both present
    better = (ranks[:, :, None] < ranks[:, None, :]) & present[:, :, None] & present[:, None, :]
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))  # a bf16 score's margin in fp32
    margins = scores[:, :, None] - scores[:, None, :]  # [G, K, K]: r_i - r_j
    pair_losses = -F.logsigmoid(margins) * better
    pairs = better.sum(dim=(1, 2))
    loss = pair_losses.sum(dim=(1, 2)) / pairs.clamp(min=1)
    correct = ((margins > 0) & better).sum(dim=(1, 2))
    return loss, pairs, correct


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO's sigmoid loss. Each input [P]: log pi(y | x) summed over the response (policy and
    frozen reference, chosen and rejected). Returns (loss [P], chosen_reward [P], rejected_reward
    [P]), the rewards beta (log pi - log pi_ref) detached (metrics: margin, accuracy)."""
    shapes = {tuple(t.shape) for t in (policy_chosen, policy_rejected, reference_chosen, reference_rejected)}
    if len(shapes) != 1 or policy_chosen.dim() != 1:
        raise ValueError(f"the four logprob vectors must all be [P], got shapes {sorted(shapes)}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    chosen = policy_chosen.float() - reference_chosen.float()
    rejected = policy_rejected.float() - reference_rejected.float()
    loss = -F.logsigmoid(beta * (chosen - rejected))
    return loss, (beta * chosen).detach(), (beta * rejected).detach()
