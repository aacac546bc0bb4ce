"""Reward heads and critics found by what the model is, for families that name the head
differently (Llama `score`, GPT-2 with Conv1D projections, OPT with no token-classification class
at all): the scorer's RM score and the critic's value at the last token are both what the HF
model's own forward gives for the same unpadded sequence."""

import numpy as np
import pytest
import torch

from common.models import ValueModel, classification_head, load_critic
from common.sequences import collate
from learner.step import forward_values
from protocol.samples import Sample
from scorer.scoring import reward_scores

SEQUENCES = [[1, 5, 9, 3, 7, 2], [1, 4, 4, 8]]


def tiny_reward_model(family: str, directory: str) -> str:
    from transformers import (GPT2Config, GPT2ForSequenceClassification, LlamaConfig, LlamaForSequenceClassification,
                              OPTConfig, OPTForSequenceClassification)

    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForSequenceClassification(LlamaConfig(vocab_size=16, hidden_size=64, intermediate_size=128,
                                                           num_hidden_layers=2, num_attention_heads=2, num_labels=1,
                                                           pad_token_id=0))
    elif family == "gpt2":
        model = GPT2ForSequenceClassification(GPT2Config(vocab_size=16, n_embd=64, n_layer=2, n_head=2, n_positions=32,
                                                         num_labels=1, pad_token_id=0))
    else:
        model = OPTForSequenceClassification(OPTConfig(vocab_size=16, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                                       num_attention_heads=2, word_embed_proj_dim=64,
                                                       max_position_embeddings=32, num_labels=1, pad_token_id=0))
    with torch.no_grad():  # a head that is not zero, so agreement means something
        classification_head(model).weight.normal_(0, 1.0)
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_rm_scores_and_critic_values_match_the_hf_forward(tmp_path, family):
    from transformers import AutoModelForSequenceClassification

    path = tiny_reward_model(family, str(tmp_path / family))
    rm = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
    with torch.no_grad():
        expected = [float(rm(input_ids=torch.tensor([ids])).logits[0, 0]) for ids in SEQUENCES]
    assert np.std(expected) > 1e-3  # different sequences, different scores

    samples = [Sample(f"s{i}", i, 0, np.array(ids[:2], np.int32), np.array(ids[2:], np.int32),
                      np.zeros(len(ids) - 2, np.float32), "stop") for i, ids in enumerate(SEQUENCES)]
    scores = reward_scores(rm, samples, pad_token_id=0)  # padded batch, pooled by tether
    np.testing.assert_allclose(scores.numpy(), expected, atol=1e-5)

    critic = load_critic(path).eval()
    assert isinstance(critic, ValueModel)
    batch = collate(samples, pad_token_id=0)
    with torch.no_grad():
        values = forward_values(critic, batch)  # [B, T]: V(s_t) before each response token
    # the value before the token after the last one is the RM's score of the whole sequence:
    # position P + T - 1, i.e. the critic's output at each sample's last real token
    with torch.no_grad():
        last = critic(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[..., 0]
    np.testing.assert_allclose([float(last[i, batch.last_positions[i]]) for i in range(len(samples))], expected,
                               atol=1e-5)
    assert values.shape == batch.response_mask.shape and torch.isfinite(values).all()


def test_a_head_that_is_more_than_one_layer_is_refused_with_its_names():
    from transformers import RobertaConfig, RobertaForSequenceClassification

    model = RobertaForSequenceClassification(RobertaConfig(vocab_size=16, hidden_size=32, num_hidden_layers=1,
                                                           num_attention_heads=2, intermediate_size=64, num_labels=1))
    with pytest.raises(ValueError, match="RobertaForSequenceClassification: expected one linear head.*classifier.dense"):
        classification_head(model)


def test_a_critic_from_a_family_without_a_sequence_classification_class(tmp_path):
    """Granite has a causal LM and no sequence-classification class in transformers: the critic is
    its body with a fresh one-output head, and trains (a gradient reaches body and head)."""
    from transformers import AutoModelForCausalLM, GraniteConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(GraniteConfig(vocab_size=16, hidden_size=64, intermediate_size=128,
                                                   num_hidden_layers=2, num_attention_heads=2,
                                                   pad_token_id=0)).save_pretrained(tmp_path / "granite")
    from transformers import AutoModelForSequenceClassification

    with pytest.raises(ValueError):  # what sends load_critic to its fallback
        AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "granite"), num_labels=1)
    critic = load_critic(str(tmp_path / "granite"))
    assert isinstance(critic, ValueModel) and critic.head.out_features == 1 and float(critic.head.bias) == 0.0
    samples = [Sample(f"s{i}", i, 0, np.array(ids[:2], np.int32), np.array(ids[2:], np.int32),
                      np.zeros(len(ids) - 2, np.float32), "stop") for i, ids in enumerate(SEQUENCES)]
    batch = collate(samples, pad_token_id=0)
    values = forward_values(critic, batch)
    assert values.shape == batch.response_mask.shape and torch.isfinite(values).all()
    (values * batch.response_mask).sum().backward()
    assert critic.head.weight.grad.abs().sum() > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in critic.body.parameters())
