"""The learner's models: the actor (the policy, a causal LM) and the critic (a per-token value model
built for any family), loaded with dropout off."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from common.sequences import classification_head, disable_dropout


def load_actor(path: str, dtype: str = "float32") -> nn.Module:
    from transformers import AutoModelForCausalLM

    return disable_dropout(AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)))

class ValueModel(nn.Module):
    """A per-token value model: a causal LM's transformer body with a one-output head on every
    position. Built by tether for every family alike, so no family needs a token-classification
    class of its own (OPT has none) nor a head of a given attribute name. ``forward`` returns
    ``.logits`` of shape [B, L, 1], as HF's token classifiers do."""

    def __init__(self, body: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.body, self.head, self.config = body, head, body.config
        # a decoder builds a KV cache at every forward unless told not to (a concat per layer, for nothing)
        self.no_cache = {"use_cache": False} if "use_cache" in inspect.signature(body.forward).parameters else {}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        from transformers.modeling_outputs import TokenClassifierOutput

        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, **self.no_cache).last_hidden_state
        return TokenClassifierOutput(logits=self.head(hidden))

def load_critic(path: str, dtype: str = "float32") -> nn.Module:
    """The critic from ``path``: the transformer body of the model there with a one-output head on
    every position. From a reward model the head starts as the RM's score head (found by
    ``classification_head``, whatever its name); from a policy it starts fresh. A bias starts at
    zero, so an RM-initialised critic starts out predicting the RM's own score at each position."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    try:
        source = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=getattr(torch, dtype))
    except ValueError:  # a family without a sequence-classification class: its body and a new head
        body = AutoModel.from_pretrained(path, dtype=getattr(torch, dtype))
        head = nn.Linear(body.config.hidden_size, 1, dtype=getattr(torch, dtype))
        with torch.no_grad():
            head.weight.normal_(0.0, 1.0 / (body.config.hidden_size + 1))  # HF's score-head init
            head.bias.zero_()
        return disable_dropout(ValueModel(body, head))
    head = classification_head(source)
    if head.bias is not None:
        with torch.no_grad():
            head.bias.zero_()
    return disable_dropout(ValueModel(source.base_model, head))


def load_reward_model(path: str, dtype: str, tokenizer) -> nn.Module:
    """A one-label sequence-classification model of ``path``'s family, dropout off: from a policy
    its body and a new score head; its pad token the tokenizer's (else end-of-sequence), which
    HF's own pooling needs even where tether pools itself."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=getattr(torch, dtype))
    if model.config.pad_token_id is None:
        model.config.pad_token_id = (tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                     else tokenizer.eos_token_id)
    return disable_dropout(model)
