"""The sampled distribution's math (common.distributions): logprobs and entropy after temperature,
top-k and top-p, against hand-computed values."""

import math

import pytest
import torch

from common.config import SamplingConfig
from learner import ppo


def t(values, **kwargs):
    return torch.tensor(values, dtype=torch.float32, **kwargs)


def assert_close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual.detach().float(), t(expected), atol=atol, rtol=0)


def test_logprobs_from_logits_matches_log_softmax_by_hand():
    logits = t([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])
    tokens = torch.tensor([[2, 1]])
    expected_first = 3.0 - math.log(math.e + math.e**2 + math.e**3)
    expected_second = -math.log(3.0)
    got = ppo.logprobs_from_logits(logits, tokens)
    assert got.shape == (1, 2)
    assert_close(got, [[expected_first, expected_second]], atol=1e-6)


def test_logprobs_divide_logits_by_the_sampling_temperature():
    logits = t([[[1.0, 2.0, 3.0]]])
    tokens = torch.tensor([[2]])
    # temperature 2 -> logits 0.5, 1.0, 1.5
    expected = 1.5 - math.log(math.exp(0.5) + math.exp(1.0) + math.exp(1.5))
    assert ppo.logprobs_from_logits(logits, tokens, SamplingConfig(temperature=2.0)).item() == pytest.approx(expected, abs=1e-6)


def test_entropy_from_logits_by_hand():
    # uniform over 4 -> ln 4; p = (0.25, 0.75) -> -(0.25 ln 0.25 + 0.75 ln 0.75)
    logits = t([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]]])
    expected = [math.log(4.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    assert ppo.entropy_from_logits(logits)[0].tolist() == pytest.approx(expected, abs=1e-5)


def test_entropy_rises_with_temperature():
    logits = t([[[0.0, 1.0, 2.0]]])
    assert ppo.entropy_from_logits(logits, SamplingConfig(temperature=2.0)) > ppo.entropy_from_logits(logits)


def _kept_by_hand(probs: list[float], top_p: float, top_k: int) -> set[int]:
    """The tokens top-k then top-p keep, worked out one token at a time: top-k keeps the k largest;
    top-p, over what top-k kept (renormalised), keeps the largest and every token whose mass plus
    the mass of all tokens smaller than it is more than 1 - p."""
    order = sorted(range(len(probs)), key=lambda i: probs[i])  # ascending
    kept = set(order[-top_k:]) if top_k else set(order)
    total = sum(probs[i] for i in kept)
    mass, result = 0.0, set()
    for i in [i for i in order if i in kept]:
        mass += probs[i] / total
        if mass > 1 - top_p or i == order[-1]:
            result.add(i)
    return result


@pytest.mark.parametrize("top_p, top_k", [(0.9, 0), (0.5, 0), (1.0, 3), (0.8, 4), (0.3, 2)])
def test_top_k_top_p_keep_the_tokens_worked_out_by_hand_and_renormalise(top_p, top_k):
    from common.distributions import LOGPROB_FLOOR, entropy_from_logits, logprobs_from_logits

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=generator) * 2
    vocab = torch.arange(7).expand(2, 3, 7)
    every_token = torch.stack([logprobs_from_logits(logits, vocab[..., v], SamplingConfig(temperature=0.7, top_p=top_p, top_k=top_k)) for v in range(7)], -1)
    entropy = entropy_from_logits(logits, SamplingConfig(temperature=0.7, top_p=top_p, top_k=top_k))
    for b in range(2):
        for t in range(3):
            probs = torch.softmax(logits[b, t] / 0.7, -1).tolist()
            kept = sorted(_kept_by_hand(probs, top_p, top_k))
            renormalised = torch.log_softmax(logits[b, t, kept] / 0.7, -1)
            assert torch.allclose(every_token[b, t, kept], renormalised, atol=1e-6)
            left_out = [v for v in range(7) if v not in kept]
            assert all(every_token[b, t, v] == LOGPROB_FLOOR for v in left_out)
            by_hand = -(renormalised.exp() * renormalised).sum()
            assert entropy[b, t] == pytest.approx(float(by_hand), abs=1e-5)


def test_top_p_logprobs_have_finite_gradients_also_for_a_token_left_out():
    from common.distributions import logprobs_from_logits

    logits = torch.tensor([[[4.0, 3.0, -5.0, -6.0]]], requires_grad=True)
    kept, left_out = (logprobs_from_logits(logits, torch.tensor([[token]]), SamplingConfig(top_p=0.9)) for token in (0, 3))
    (kept.sum() + left_out.sum()).backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 0, 0] != 0


def test_the_sampled_distribution_is_one_value_not_loose_numbers():
    with pytest.raises(TypeError, match="sampling must be a SamplingConfig"):
        ppo.logprobs_from_logits(torch.zeros(1, 1, 3), torch.zeros(1, 1, dtype=torch.long), 0.7)
    with pytest.raises(TypeError, match="sampling must be a SamplingConfig"):
        ppo.entropy_from_logits(torch.zeros(1, 1, 3), 0.7)


def test_a_banned_token_gets_no_mass_and_the_others_renormalise_before_top_k():
    from common.distributions import LOGPROB_FLOOR, entropy_from_logits, logprobs_from_logits

    logits = torch.randn(1, 2, 6, generator=torch.Generator().manual_seed(3)) * 2
    logits[0, :, 4] = 6.0  # the banned token is the likeliest: its mass matters
    sampling = SamplingConfig(temperature=0.7, top_k=3, banned_tokens=(4,))
    every_token = torch.stack([logprobs_from_logits(logits, torch.full((1, 2), v), sampling) for v in range(6)], -1)
    for t in range(2):
        others = [v for v in range(6) if v != 4]
        kept = sorted(_kept_by_hand(torch.softmax(logits[0, t, others] / 0.7, -1).tolist(), 1.0, 3))
        kept = [others[i] for i in kept]  # top-k counts the tokens left after the ban
        assert torch.allclose(every_token[0, t, kept], torch.log_softmax(logits[0, t, kept] / 0.7, -1), atol=1e-6)
        assert all(every_token[0, t, v] == LOGPROB_FLOOR for v in range(6) if v not in kept)
    assert torch.isfinite(entropy_from_logits(logits, sampling)).all()


def test_banned_tokens_are_ids_and_banning_adds_to_them():
    from pydantic import ValidationError

    assert SamplingConfig(banned_tokens=(5, 2, 5)).banning([7, 2]).banned_tokens == (2, 5, 7)
    reference = SamplingConfig(top_k=2, banned_tokens=(3,)).without_truncation()
    assert reference.banned_tokens == (3,) and reference.top_k == 0  # no response holds a banned token
    with pytest.raises(ValidationError, match="token ids are >= 0"):
        SamplingConfig(banned_tokens=(-1,))
