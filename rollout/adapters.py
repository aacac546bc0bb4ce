"""The rollout's side of ``learner.lora_sync: adapters`` (``weight_sync/lora.py`` says what a
version is): vLLM's LoRA arguments and the adapter directories it loads.

Every request carries the one adapter (``LoRARequest("policy", 1, ...)``); a version reloads it in
place (``add_lora(load_inplace=True)``), so, as with whole weights, requests in flight go on with
the new version once the rollout has reset them (``rollout.engine.apply_weights``).
"""

from __future__ import annotations

import os
import json
import shutil

from common.config import TetherConfig
from weight_sync.lora import LORA_RANKS, POLICY_ADAPTER, zero_adapter


def lora_arguments(config: TetherConfig) -> dict:
    """``vllm.LLM``'s arguments for the policy's one adapter: the smallest ``max_lora_rank`` that
    holds the rank (vLLM pads to it, and its CPU kernels copy that width a token), one adapter
    active and cached; a policy that sees has adapters on its connector (and its tower, where it
    trains), which vLLM applies with ``enable_tower_connector_lora``."""
    from common.processors import sees_images

    rank = next(value for value in LORA_RANKS if value >= config.learner.lora_rank)
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1, "max_cpu_loras": 1,
            **({"enable_tower_connector_lora": True} if sees_images(config.models.policy) else {})}


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
