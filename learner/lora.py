"""LoRA (peft) on the actor and the critic: only the adapters (and the critic's value head) train.
The rollout gets the adapters alone where vLLM's LoRA serves the family (``learner.lora_sync``,
``rollout.adapters``), else the merged weights under the base model's own names, which vLLM loads
as any checkpoint of the family; the HF export is merged. The reference stays the frozen base.
"""

from __future__ import annotations

import torch
from torch import nn

from common.config import LearnerConfig

ADAPTER = "default"  # peft's name for the one adapter tether trains


def with_lora(model: nn.Module, cfg: LearnerConfig, exclude: list[str] | None = None) -> nn.Module:
    """``model`` with LoRA adapters on ``cfg.lora_target_modules`` ("all-linear": every linear layer
    but the output head) save the modules named in ``exclude`` (a reward model's score head, which
    peft takes for one more linear layer), everything else frozen; ``model`` itself when
    ``cfg.lora_rank`` is 0. ``cfg``: the learner's section or a stage's (same names)."""
    if cfg.lora_rank == 0:
        return model
    from peft import LoraConfig, get_peft_model

    target = "all-linear" if cfg.lora_target_modules == ["all-linear"] else cfg.lora_target_modules
    return get_peft_model(model, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                            target_modules=target, exclude_modules=exclude or None))


def critic_with_lora(critic: nn.Module, cfg: LearnerConfig) -> nn.Module:
    """A ``ValueModel`` with LoRA on its body; its value head trains whole (it is new or the RM's)."""
    if cfg.lora_rank:
        critic.body = with_lora(critic.body, cfg)
    return critic


def is_lora(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


@torch.no_grad()
def adapter_named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The adapter's tensors alone, named as peft saves them (``base_model.model.<module>.lora_A
    .weight``): what vLLM's LoRA loads (``learner.lora_sync: adapters``, ``rollout.adapters``)."""
    from peft import get_peft_model_state_dict

    return [(name, tensor.detach()) for name, tensor in get_peft_model_state_dict(model, adapter_name=ADAPTER).items()]


@torch.no_grad()
def merged_named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's tensors as the base model names them, each LoRA layer's weight merged
    (W + B A x scaling) out of place: merging in place and back would drift the base weights by
    rounding, version after version. A model without LoRA: its state dict as it is."""
    if not is_lora(model):
        return list(model.state_dict(keep_vars=True).items())
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    layers = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    merged = []
    for name, tensor in base.state_dict(keep_vars=True).items():
        if ".lora_" in name:
            continue
        if ".base_layer." in name:
            layer_name, _, parameter = name.rpartition(".base_layer.")
            if parameter == "weight":
                tensor = tensor.detach() + layers[layer_name].get_delta_weight(ADAPTER).to(tensor.dtype)
            name = f"{layer_name}.{parameter}"
        merged.append((name, tensor))
    return merged
