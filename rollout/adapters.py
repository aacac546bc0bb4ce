"""``learner.lora_sync: adapters``: with ``learner.lora_rank`` set, a policy version is its LoRA
adapters alone. The learner publishes peft's adapter tensors (``base_model.model.<module>.lora_A
.weight``, ...) through the same checked buckets as whole weights; the rollout writes them as a
peft adapter directory and vLLM applies it (``enable_lora``) on top of the base weights it loaded
at start, which are the reference's: nothing else moves, and no merged copy of the model is made.

Every request carries the one adapter (``LoRARequest("policy", 1, ...)``); a version reloads it in
place (``add_lora(load_inplace=True)``), so, as with whole weights, requests in flight go on with
the new version once the rollout has reset them (``rollout.engine.apply_weights``). Version 0 is
a zero adapter (peft starts B at 0), built from the same ``with_lora`` as the learner's on a model
without memory (``meta``), so its names and shapes are the learner's.

``merged`` (the whole model, merged on the learner) stays for the families vLLM's LoRA does not
serve (GPT-2, Bloom) and is what ``auto`` picks for them, saying why.
"""

from __future__ import annotations

import json
import os
import shutil

from common.config import ConfigError, TetherConfig

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices
POLICY_ADAPTER = "policy"


def lora_not_served(policy: str) -> str | None:
    """Why vLLM cannot apply LoRA adapters to the model in directory ``policy``; None when it can."""
    from vllm.model_executor.models.interfaces import supports_lora
    from vllm.model_executor.models.registry import ModelRegistry

    with open(os.path.join(policy, "config.json")) as file:
        architectures = json.load(file).get("architectures") or []
    for architecture in architectures:
        model_class = ModelRegistry._try_load_model_cls(architecture)
        if model_class is not None:
            return None if supports_lora(model_class) else f"vLLM's {architecture} takes no LoRA adapters"
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


def lora_arguments(config: TetherConfig) -> dict:
    """``vllm.LLM``'s arguments for the policy's one adapter: the smallest ``max_lora_rank`` that
    holds the rank (vLLM pads to it, and its CPU kernels copy that width a token), one adapter
    active and cached."""
    rank = next(value for value in LORA_RANKS if value >= config.learner.lora_rank)
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1, "max_cpu_loras": 1}


def zero_adapter(config: TetherConfig) -> tuple[dict, dict]:
    """(peft's adapter_config, {name: zero tensor}) of the policy's adapters before any training:
    ``with_lora`` on the policy built on the meta device (no memory, no weights read)."""
    import torch
    from peft import get_peft_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    from learner.lora import ADAPTER, with_lora

    with torch.device("meta"):
        model = with_lora(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config.models.policy)),
                          config.learner)
    tensors = {name: torch.zeros(tensor.shape, dtype=torch.float32)
               for name, tensor in get_peft_model_state_dict(model, adapter_name=ADAPTER).items()}
    return adapter_config(model), tensors


def adapter_config(model) -> dict:
    """What adapter_config.json holds for the peft ``model``'s adapter, as JSON."""
    from learner.lora import ADAPTER

    settings = model.peft_config[ADAPTER].to_dict()
    return json.loads(json.dumps(settings, default=lambda value: sorted(value) if isinstance(value, set) else str(value)))


class PolicyAdapter:
    """The rollout's side: the adapter directories it writes (one per version, the previous kept
    until the next loads: vLLM reads the path again if it ever evicts the adapter) and the
    ``LoRARequest`` every request carries."""

    def __init__(self, config: TetherConfig, directory: str) -> None:
        from vllm.lora.request import LoRARequest

        self.LoRARequest, self.directory = LoRARequest, directory
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory, mode=0o700)
        self.settings, zeros = zero_adapter(config)
        self.names = set(zeros)
        self.paths: list[str] = []
        self.request = self._write(0, zeros)

    def _write(self, version: int, tensors: dict) -> object:
        from safetensors.torch import save_file

        path = os.path.join(self.directory, f"v{version:06d}")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "adapter_config.json"), "w") as file:
            json.dump(self.settings, file)
        save_file({name: tensor.contiguous() for name, tensor in tensors.items()},
                  os.path.join(path, "adapter_model.safetensors"))
        self.paths.append(path)
        return self.LoRARequest(POLICY_ADAPTER, 1, path)

    def load(self, engine, version: int, tensors: dict) -> None:
        """Version ``version``'s adapter tensors into ``engine``, in place of the one it holds.
        Tensors other than the policy's adapters are refused before anything is written."""
        if set(tensors) != self.names:
            unknown, missing = sorted(set(tensors) - self.names), sorted(self.names - set(tensors))
            raise ValueError(f"policy version {version} is not the policy's LoRA adapter "
                             f"(unknown {unknown[:3]}, missing {missing[:3]})")
        request = self._write(version, tensors)
        engine.llm_engine.add_lora(self.LoRARequest(POLICY_ADAPTER, 1, request.lora_path, load_inplace=True))
        self.request = request
        for old in self.paths[:-2]:
            shutil.rmtree(old, ignore_errors=True)
        self.paths = self.paths[-2:]

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
