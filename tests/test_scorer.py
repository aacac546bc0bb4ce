"""Sequence packing and the scorer's math on real (tiny) transformers models."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from protocol.samples import Sample
from protocol.sequences import collate, gather_response
from scorer.scoring import REWARD_OFFSET_KEY, reference_logprobs, reward_scores


def sample(prompt, response, sample_id="x"):
    return Sample(sample_id, 0, 0, np.array(prompt, np.int32), np.array(response, np.int32),
                  np.zeros(len(response), np.float32), "stop")


def test_collate_puts_each_response_token_after_the_logits_that_predict_it():
    batch = collate([sample([1, 3, 7], [9, 2]), sample([1, 4], [8, 8, 8, 2])], pad_token_id=0)
    assert batch.input_ids.tolist() == [[1, 3, 7, 9, 2, 0], [1, 4, 8, 8, 8, 2]]
    assert batch.response_positions.tolist() == [[2, 3, 0, 0], [1, 2, 3, 4]]
    assert batch.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch.last_positions.tolist() == [4, 5]
    # positions pick the row the token follows: input_ids at position p + 1 is the token scored at p
    following = gather_response(batch.input_ids[:, 1:], batch.response_positions.clamp(max=4))
    assert (following * batch.response_mask.long()).tolist() == [[9, 2, 0, 0], [8, 8, 8, 2]]


def test_reference_logprobs_match_a_plain_forward_pass_whatever_the_padding(tiny_assets):
    reference = AutoModelForCausalLM.from_pretrained(tiny_assets["policy"]).eval()
    short, long = sample([1, 3, 7, 8, 5], [9, 2], "a"), sample([1, 4, 6, 6, 5], [8, 10, 12, 6, 2], "b")
    batched = reference_logprobs(reference, [short, long], pad_token_id=0, temperature=0.7)
    with torch.no_grad():
        ids = torch.tensor([[1, 3, 7, 8, 5, 9, 2]])
        expected = torch.log_softmax(reference(input_ids=ids).logits[0, 4:6] / 0.7, dim=-1)
        expected = expected[torch.arange(2), torch.tensor([9, 2])]
    torch.testing.assert_close(batched[0], expected, atol=1e-5, rtol=0)
    alone = reference_logprobs(reference, [long], pad_token_id=0, temperature=0.7)
    torch.testing.assert_close(batched[1], alone[0], atol=1e-5, rtol=0)


def test_reward_scores_use_the_last_real_token_and_subtract_the_offset(tiny_assets):
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_assets["reward"], num_labels=1).eval()
    offset = getattr(rm.config, REWARD_OFFSET_KEY)
    a, b = sample([1, 3, 7, 8, 5], [9, 2], "a"), sample([1, 4, 6, 6, 5], [8, 10, 12, 6, 2], "b")
    together = reward_scores(rm, [a, b], pad_token_id=0)
    assert together.shape == (2,)
    torch.testing.assert_close(together[0], reward_scores(rm, [a], pad_token_id=0)[0], atol=1e-5, rtol=0)
    with torch.no_grad():
        hidden = rm.base_model(input_ids=torch.tensor([[1, 4, 6, 6, 5, 8, 10, 12, 6, 2]])).last_hidden_state
        expected = rm.score(hidden[0, -1]).item() - offset
    assert together[1].item() == pytest.approx(expected, abs=1e-5)
