"""Every model tether runs, loaded in one place: whether two read the same tokens, and how each is
loaded (the policy and the reference as causal LMs, the critic as a per-token value model built for
any family, the reward model as a one-label sequence classifier) with dropout off and one rule for
the pad token. Where each model is (a directory or a hub id) is ``common.model_dirs``', which needs
no torch: ``tether run`` resolves the models before it starts the roles.
"""

from __future__ import annotations

import inspect
import os

import torch
from torch import nn

from common.config import ConfigError, TetherConfig


def same_tokens(policy_dir: str, other_dir: str) -> bool:
    """Whether the model in ``other_dir`` reads token ids as the policy does: the same vocabulary
    and special tokens (a directory without a tokenizer of its own is taken to share the policy's)."""
    from transformers import AutoTokenizer

    if not _has_tokenizer(other_dir) or os.path.realpath(policy_dir) == os.path.realpath(other_dir):
        return True
    policy, other = AutoTokenizer.from_pretrained(policy_dir), AutoTokenizer.from_pretrained(other_dir)
    return policy.get_vocab() == other.get_vocab() and policy.all_special_ids == other.all_special_ids


def _has_tokenizer(directory: str) -> bool:
    return any(os.path.exists(os.path.join(directory, name))
               for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"))


def critic_source(config: TetherConfig) -> str:
    """The model whose body the critic starts from (``models.critic_init``, resolved). The critic
    reads the policy's token ids, so a reward model with a tokenizer of its own cannot be it."""
    models = config.models
    if models.critic_init == "policy" or models.reward is None:
        return models.policy
    if same_tokens(models.policy, models.reward):
        return models.reward
    if models.critic_init == "reward":
        raise ConfigError(f"models.critic_init: the reward model {models.reward} has a tokenizer of its own, and the "
                          "critic reads the policy's tokens; use critic_init: policy (or auto)")
    return models.policy


def load_causal_lm(path: str, dtype: str = "float32") -> nn.Module:
    """The causal LM in ``path`` (the policy, the reference, a stage's model), dropout off; a
    vision-language one (``common.processors.sees_images``) with its vision tower."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from common.processors import sees_images

    family = AutoModelForImageTextToText if sees_images(path) else AutoModelForCausalLM
    return disable_dropout(family.from_pretrained(path, dtype=getattr(torch, dtype)))


HEAD_FILE = "tether_head.safetensors"  # a ValueModel's head, beside its body's HF files


class ValueModel(nn.Module):
    """A per-token value model: a causal LM's transformer body with a one-output head on every
    position. Built by tether for every family alike, so no family needs a token-classification
    class of its own (OPT has none) nor a head of a given attribute name. ``forward`` returns
    ``.logits`` of shape [B, L, 1], as HF's token classifiers do. It is also the reward model of a
    family without a sequence-classification class (a vision-language model: ``tether rm`` trains
    it, the scorer reads it), read at the last token as HF's classifiers are
    (``scorer.scoring.raw_scores``); saved as its body's HF directory with its head beside it."""

    def __init__(self, body: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.body, self.head, self.config = body, head, body.config
        # a decoder builds a KV cache at every forward unless told not to (a concat per layer, for nothing)
        self.no_cache = {"use_cache": False} if "use_cache" in inspect.signature(body.forward).parameters else {}

    @property
    def base_model(self) -> nn.Module:
        """The body, where HF's models keep theirs (``classification_head`` looks outside it)."""
        return self.body

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                output_hidden_states: bool = False, position_ids: torch.Tensor | None = None, **inputs):
        """``inputs``: a body that sees images takes their inputs (``SequenceBatch.model_inputs``), a
        packed pass its segments; ``output_hidden_states``: the body's last hidden states too, as
        ``hidden_states[-1]``; ``position_ids``: a packed pass's (``common.packing``)."""
        from transformers.modeling_outputs import TokenClassifierOutput

        positions = {} if position_ids is None else {"position_ids": position_ids}
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, **positions, **inputs,
                           **self.no_cache).last_hidden_state
        return TokenClassifierOutput(logits=self.head(hidden),
                                     hidden_states=(hidden,) if output_hidden_states else None)

    def save_pretrained(self, directory: str, safe_serialization: bool = True,
                        state_dict: dict[str, torch.Tensor] | None = None, **_) -> None:
        """The body as its family's HF directory (``AutoModel`` loads it) and the head in ``HEAD_FILE``;
        ``state_dict``: the tensors to save in place of the modules' own (LoRA merged), named as
        this model names them (``body.``, ``head.``)."""
        from safetensors.torch import save_file

        state = state_dict if state_dict is not None else self.state_dict()
        part = {prefix: {name.removeprefix(prefix): tensor for name, tensor in state.items() if name.startswith(prefix)}
                for prefix in ("body.", "head.")}
        self.body.save_pretrained(directory, safe_serialization=safe_serialization, state_dict=part["body."])
        save_file({name: tensor.detach().contiguous() for name, tensor in part["head."].items()},
                  os.path.join(directory, HEAD_FILE))

    @staticmethod
    def load(path: str, dtype: str = "float32", new_head: bool = True) -> "ValueModel":
        """The body of the model in ``path`` (a VLM's: its towers and text model) with the head saved
        beside it, else (``new_head``) a new one (HF's score-head init, bias 0); without ``new_head``
        a missing head is a ConfigError (a reward model to score with must have been trained)."""
        from transformers import AutoModel

        if not new_head and not os.path.exists(os.path.join(path, HEAD_FILE)):
            raise ConfigError(f"{path} has no sequence-classification class in transformers and no head of "
                              f"tether's ({HEAD_FILE}): it is no reward model yet; train one with `tether rm`")

        body = AutoModel.from_pretrained(path, dtype=getattr(torch, dtype))
        body.config.num_labels = 1  # a score, as tether's sequence classifiers have
        width = body.config.get_text_config().hidden_size
        head = nn.Linear(width, 1, dtype=getattr(torch, dtype))
        saved = os.path.join(path, HEAD_FILE)
        with torch.no_grad():
            if os.path.exists(saved):
                from safetensors.torch import load_file

                head.load_state_dict(load_file(saved))
            else:
                head.weight.normal_(0.0, 1.0 / (width + 1))  # HF's score-head init
                head.bias.zero_()
        return disable_dropout(ValueModel(body, head))


def load_critic(path: str, dtype: str = "float32") -> nn.Module:
    """The critic from ``path``: the transformer body of the model there with a one-output head on
    every position. From a reward model the head starts as the RM's score head (found by
    ``classification_head``, whatever its name); from a policy it starts fresh. A bias starts at
    zero, so an RM-initialised critic starts out predicting the RM's own score at each position."""
    from transformers import AutoModelForSequenceClassification

    if not has_sequence_classifier(path):  # its body and tether's head
        source = ValueModel.load(path, dtype)
        with torch.no_grad():
            source.head.bias.zero_()
        return source
    source = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=getattr(torch, dtype))
    head = classification_head(source)
    if head.bias is not None:
        with torch.no_grad():
            head.bias.zero_()
    return disable_dropout(ValueModel(source.base_model, head))


def load_reward_model(path: str, dtype: str, tokenizer, new_head: bool = True) -> nn.Module:
    """A one-label sequence-classification model of ``path``'s family, dropout off: from a policy
    its body and a new score head; its pad token the tokenizer's (else end-of-sequence), which
    HF's own pooling needs even where tether pools itself. A family without a sequence-classification
    class (a vision-language model) is tether's ``ValueModel``, read at the last token alike, whose
    head must be there unless ``new_head`` (``tether rm`` starting from a policy)."""
    from transformers import AutoModelForSequenceClassification

    if has_sequence_classifier(path):
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=getattr(torch, dtype))
    else:
        model = ValueModel.load(path, dtype, new_head)
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = (tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                     else tokenizer.eos_token_id)
    return disable_dropout(model)


def has_sequence_classifier(path: str) -> bool:
    """Whether transformers has a sequence-classification class for the family of the model in ``path``."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    return type(AutoConfig.from_pretrained(path)) in AutoModelForSequenceClassification._model_mapping


def pad_token_id(model: nn.Module) -> int:
    """The id a model's batches are padded with: its config's pad token, else 0. Padding is never
    attended to nor scored (the attention mask and ``response_mask`` hide it), so any id in the
    vocabulary serves; the scorer and the learner must only agree, which one rule makes sure of. A
    vision-language family may keep it in its text config alone (Qwen2-VL, LLaVA)."""
    for config in (model.config, model.config.get_text_config()):
        if getattr(config, "pad_token_id", None) is not None:
            return config.pad_token_id
    return 0


def disable_dropout(model: nn.Module) -> nn.Module:
    """Dropout off in every model tether runs (policy, reference, RM, critic): PPO's ratio and the
    KL tether compare forward passes that must be deterministic."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        # a family that calls functional dropout keeps its rate as a float of its own (OPT's layers:
        # ``self.dropout = config.dropout``), which no nn.Dropout holds
        for name, value in vars(module).items():
            if ("dropout" in name or name.endswith("pdrop")) and isinstance(value, float):
                setattr(module, name, 0.0)
    for key, value in model.config.to_dict().items():
        if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float) and value:
            setattr(model.config, key, 0.0)
    return model


def classification_head(model: nn.Module) -> nn.Linear:
    """The output layer of a HF sequence-classification model, found by what it is rather than by
    its attribute name (Llama and Qwen2 call it ``score``, token classifiers and BERT-likes
    ``classifier``, ...): the one ``nn.Linear`` outside the transformer body that maps a hidden
    state to the labels. A head that is more than that layer (a pooler, a dense layer first) is
    refused: tether pools the last token itself and applies the head to its hidden state."""
    body = {id(module) for module in model.base_model.modules()}
    outside = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and id(module) not in body]
    labels = [(name, module) for name, module in outside if module.out_features == model.config.num_labels]
    if len(outside) != 1 or len(labels) != 1:
        raise ValueError(f"{type(model).__name__}: expected one linear head on the hidden states, found "
                         f"{[name for name, _ in outside] or 'none'}")
    return labels[0][1]
