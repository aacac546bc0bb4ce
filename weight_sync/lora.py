"""What a LoRA run moves on the wire, shared by the learner (which publishes the adapters) and the
rollout (which applies them in vLLM): the adapter's name and config, the tensors a version is made
of (the adapters alone, or the merged weights under the base model's own names:
``training.lora.merged_named_tensors``) and which of the two a run moves (``learner.lora_sync``).
How a model gets its adapters, which the stages share, is ``training.lora``'s.

``adapters``: with ``learner.lora_rank`` set, a policy version is its LoRA adapters alone. The
learner publishes peft's adapter tensors (``base_model.model.<module>.lora_A.weight``, ...)
through the same checked buckets as whole weights; the rollout writes them as a peft adapter
directory and vLLM applies it on top of the base weights it loaded at start, which are the
reference's (``rollout/adapters.py``). Version 0 is a zero adapter (peft starts B at 0), built from
the same ``policy_with_lora`` as the learner's on a model without memory (``meta``), so its names
and shapes are the learner's. ``merged`` (the whole model, merged on the learner) stays for the
families vLLM's LoRA does not serve (GPT-2, Bloom) and is what ``auto`` picks for them, saying why.
The HF export is merged; the reference stays the frozen base.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from common.config import ConfigError, TetherConfig
from training.lora import ADAPTER, policy_with_lora

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices
POLICY_ADAPTER = "policy"  # the name every rollout request's LoRARequest carries


@torch.no_grad()
def adapter_named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The adapter's tensors alone, named as peft saves them (``base_model.model.<module>.lora_A
    .weight``): what vLLM's LoRA loads (``learner.lora_sync: adapters``, ``rollout.adapters``)."""
    from peft import get_peft_model_state_dict

    return [(name, tensor.detach()) for name, tensor in get_peft_model_state_dict(model, adapter_name=ADAPTER).items()]


def lora_not_served(policy: str) -> str | None:
    """Why vLLM cannot apply LoRA adapters to the model in directory ``policy``; None when it can. A
    policy that sees has adapters on its connector too (``policy_with_lora``), which vLLM applies only
    for the families that take them there (``supports_tower_connector_lora``): for the others it would
    leave them out, silently, and generate off the learner's policy."""
    from vllm.model_executor.models.interfaces import supports_lora
    from vllm.model_executor.models.registry import ModelRegistry

    from common.processors import sees_images

    with open(os.path.join(policy, "config.json")) as file:
        architectures = json.load(file).get("architectures") or []
    for architecture in architectures:
        model_class = ModelRegistry._try_load_model_cls(architecture)
        if model_class is None:
            continue
        if not supports_lora(model_class):
            return f"vLLM's {architecture} takes no LoRA adapters"
        if sees_images(policy) and not getattr(model_class, "supports_tower_connector_lora", False):
            return f"vLLM's {architecture} takes no LoRA adapters on its connector"
        return None
    return f"vLLM has no model for {architectures or 'the architecture (config.json names none)'}"


def lora_sync(config: TetherConfig) -> tuple[str, str]:
    """(``adapters`` or ``merged``, why) for a LoRA run (``learner.lora_rank`` > 0), the same in the
    learner and the rollout; an explicit ``adapters`` vLLM cannot serve is an error naming the key."""
    cfg = config.learner
    if cfg.lora_sync == "merged":
        return "merged", "learner.lora_sync: merged"
    try:
        reason = lora_not_served(config.models.policy)
    except ImportError as error:  # a learner's host without vLLM: the rollouts', which have it, check
        if cfg.lora_sync == "adapters":
            return "adapters", "learner.lora_sync: adapters (vLLM is not importable here; the rollouts check it)"
        raise ConfigError(f"learner.lora_sync: auto asks vLLM which to publish, and it is not importable here "
                          f"({error}); set adapters or merged") from None
    if reason is None and cfg.lora_rank > LORA_RANKS[-1]:
        reason = f"vLLM serves LoRA ranks up to {LORA_RANKS[-1]}, learner.lora_rank is {cfg.lora_rank}"
    if reason is None:
        return "adapters", f"learner.lora_sync: {cfg.lora_sync}; vLLM applies the adapters"
    if cfg.lora_sync == "adapters":
        raise ConfigError(f"learner.lora_sync: adapters, but {reason}; use merged (or auto)")
    return "merged", f"learner.lora_sync: auto, and {reason}: whole merged weights are published"


def lora_sync_logged(config: TetherConfig, log) -> str:
    """``lora_sync``'s choice, logged with its reason (the learner and each rollout say the same)."""
    mode, reason = lora_sync(config)
    log.info("LoRA rank %d: a policy version moves %s (%s)", config.learner.lora_rank,
             "its adapters alone" if mode == "adapters" else "the whole merged model", reason)
    return mode


def zero_adapter(config: TetherConfig) -> tuple[dict, dict]:
    """(peft's adapter_config, {name: zero tensor}) of the policy's adapters before any training:
    ``policy_with_lora`` on the policy built on the meta device (no memory, no weights read)."""
    import torch
    from peft import get_peft_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from common.processors import sees_images

    family = AutoModelForImageTextToText if sees_images(config.models.policy) else AutoModelForCausalLM
    with torch.device("meta"):
        model = policy_with_lora(family.from_config(AutoConfig.from_pretrained(config.models.policy)), config)
    tensors = {name: torch.zeros(tensor.shape, dtype=torch.float32)
               for name, tensor in get_peft_model_state_dict(model, adapter_name=ADAPTER).items()}
    return adapter_config(model), tensors


def adapter_config(model) -> dict:
    """What adapter_config.json holds for the peft ``model``'s adapter, as JSON."""
    settings = model.peft_config[ADAPTER].to_dict()
    return json.loads(json.dumps(settings, default=lambda value: sorted(value) if isinstance(value, set) else str(value)))
