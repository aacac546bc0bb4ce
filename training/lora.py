"""LoRA on the models tether trains: how a model gets its adapters (``with_lora``; the policy's and
the critic's, a vision tower kept as it is), whether it has them, and its tensors under the base
model's own names with each adapter merged (what the HF export writes and a ``merged`` run
publishes). The PPO learner and the offline stages wrap their models alike; what a version of the
adapters is on the wire is ``weight_sync.lora``'s."""

from __future__ import annotations

import torch
from torch import nn

from common.config import LearnerConfig, TetherConfig

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


def keeps_vision_tower(config: TetherConfig) -> bool:
    """Whether the run keeps a policy's vision tower as the SFT model has it (frozen, no adapters):
    a policy that sees, unless ``learner.train_vision_tower``. The actor's and the critic's alike."""
    from common.processors import sees_images

    return sees_images(config.models.policy) and not config.learner.train_vision_tower


def policy_with_lora(model: nn.Module, config: TetherConfig) -> nn.Module:
    """The policy ``model`` with the run's LoRA (``with_lora`` on ``learner``), its vision tower kept
    where ``keeps_vision_tower``. The learner's actor and the rollout's zero adapter alike."""
    from training.vision_tower import freeze_vision_tower

    return with_lora(model, config.learner, freeze_vision_tower(model) if keeps_vision_tower(config) else None)


def critic_with_lora(critic: nn.Module, cfg: LearnerConfig, exclude: list[str] | None = None) -> nn.Module:
    """A ``ValueModel`` with LoRA on its body save the modules named in ``exclude`` (a vision tower
    left as it is); its value head trains whole (it is new or the RM's)."""
    if cfg.lora_rank:
        critic.body = with_lora(critic.body, cfg, exclude)
    return critic


def is_lora(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


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
