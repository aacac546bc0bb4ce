"""The DeepSpeed engine of actor or critic, or of a stage's model: its config from ``learner.*`` (a
stage's section, under the same names), the gradient guard that lets a step with NaN or inf
gradients be skipped, and what the learner does with an engine's weights besides training them
(a CPU snapshot, a swap for one forward, the whole parameters under ZeRO-3)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from common.config import TetherConfig
from common.models import ValueModel


def make_deepspeed_engine(model: nn.Module, lr: float, config: TetherConfig):
    """The actor's or the critic's engine, under ``learner.*`` and ``models.dtype``."""
    return deepspeed_engine(model, lr, config.learner, config.models.dtype, config.learner.minibatch_size)


def deepspeed_engine(model: nn.Module, lr: float, learner, dtype: str, rows_per_step: int):
    """``model`` in a DeepSpeed engine with AdamW at ``lr`` over its trainable parameters.
    ``learner``: a ``LearnerConfig`` or a ``StageConfig`` (``zero_stage``, ``grad_clip``,
    ``weight_decay``, ``gradient_checkpointing``, under the same names); ``rows_per_step``: the rows
    of one optimizer step over all ranks (DeepSpeed wants a micro-batch size; the callers split
    and accumulate themselves)."""
    import deepspeed

    world = int(os.environ.get("WORLD_SIZE", 1))
    if learner.gradient_checkpointing:
        body = model.body if isinstance(model, ValueModel) else model
        body.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # HF checkpoints only in training mode (dropout is off in every tether model)
    ds_config = {
        # a minibatch is dealt between the ranks (data parallel; as evenly as its rows allow: a batch of
        # episodes in parts may leave one rank a row fewer), each rank's share into micro-batches
        # whose count varies (training.micro_batches): ppo_step marks the last of them as the accumulation
        # boundary itself, and scales each one's loss by its share; DeepSpeed averages the ranks' gradients
        "train_micro_batch_size_per_gpu": max(1, rows_per_step // world),
        "gradient_accumulation_steps": 1,
        "gradient_clipping": learner.grad_clip,
        "zero_optimization": {"stage": learner.zero_stage},
        # DeepSpeed keeps fp32 master weights and optimizer state for a bf16 / fp16 model
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]  # LoRA: the adapters
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=learner.weight_decay, eps=1e-8)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    if world == 1 and learner.zero_stage == 0:  # an all-reduce over one rank copies every gradient for nothing
        engine.enable_backward_allreduce = False
    engine.gradient_guard = GradientGuard(model, enabled=dtype != "float16")
    return engine

class GradientGuard:
    """Sees each gradient as the backward pass computes it, before DeepSpeed reduces, partitions or
    accumulates it: notes whether any is NaN or inf, and passes it on with those entries 0, so that a
    step found bad (``take``) can be skipped without NaN reaching the optimizer's state. Off under
    fp16, where inf gradients are DeepSpeed's loss scaler's business: it skips those steps itself."""

    def __init__(self, model: nn.Module, enabled: bool = True) -> None:
        self.bad: torch.Tensor | None = None  # on the gradients' device: no sync per gradient
        if enabled:
            for parameter in model.parameters():
                if parameter.requires_grad:
                    parameter.register_hook(self._see)

    def _see(self, grad: torch.Tensor) -> torch.Tensor:
        # NaN and inf survive a sum: one reduction, where isfinite(grad).all() made a mask as large as
        # the gradient and nan_to_num a copy of every gradient (8% of a learner step, bench/learner_overhead.py)
        nonfinite = ~torch.isfinite(grad.sum())
        self.bad = nonfinite if self.bad is None else self.bad | nonfinite
        # on a GPU every gradient is cleaned, for no host sync per gradient (unmeasured)
        if grad.is_cuda or bool(nonfinite):
            return torch.nan_to_num(grad, nan=0.0, posinf=0.0, neginf=0.0)
        return grad

    def take(self) -> bool:
        """Whether a gradient since the last ``take`` was NaN or inf; starts over."""
        bad, self.bad = self.bad, None
        return bool(bad) if bad is not None else False

def skip_step(engine) -> None:
    """End the minibatch without an update: DeepSpeed's step at learning rate 0 clears the gradients
    and keeps its counters in line (on every ZeRO stage alike), and the optimizer's moments and step
    count are put back as they were, so the weights and the state are those before the minibatch.
    The guard made the gradients finite, so 0 x gradient changes no weight."""
    optimizer = engine.basic_optimizer  # the AdamW of make_deepspeed_engine; under ZeRO it holds the fp32 partitions
    saved = {parameter: {key: value.clone() if torch.is_tensor(value) else value for key, value in state.items()}
             for parameter, state in optimizer.state.items()}
    rates = [group["lr"] for group in engine.optimizer.param_groups]
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0
    engine.step()
    for group, rate in zip(engine.optimizer.param_groups, rates):
        group["lr"] = rate
    for parameter in list(optimizer.state):
        if parameter not in saved:  # its first step: it had no state
            del optimizer.state[parameter]
            continue
        for key, value in saved[parameter].items():
            if torch.is_tensor(value):
                optimizer.state[parameter][key].copy_(value)
            else:
                optimizer.state[parameter][key] = value

def _local_tensors(parameter) -> list[torch.Tensor]:
    """What a rank holds of a parameter: its data, and under ZeRO-3 its partition (a parameter
    kept whole on every rank has both; one gathered only for the forward pass has the partition)."""
    return [t for t in (parameter.data, getattr(parameter, "ds_tensor", None)) if t is not None and t.numel()]

def _trainable_local_tensors(engine) -> list[torch.Tensor]:
    """What this rank holds of the trainable weights (frozen ones never change)."""
    return [t for p in engine.module.parameters() if p.requires_grad for t in _local_tensors(p)]

def snapshot_weights(engine) -> list[torch.Tensor]:
    """A CPU copy of what this rank holds of the trainable weights: the weights of this version,
    for ``weights_swapped`` a step later."""
    return [t.detach().to("cpu", copy=True) for t in _trainable_local_tensors(engine)]

@contextmanager
def weights_swapped(engine, snapshot: list[torch.Tensor]) -> Iterator[None]:
    """Inside the block the engine's module computes with ``snapshot``'s weights; after it, with its
    own again, bit for bit (the optimizer's state is never touched)."""
    tensors, own = _trainable_local_tensors(engine), snapshot_weights(engine)
    with torch.no_grad():
        for tensor, saved in zip(tensors, snapshot):
            tensor.copy_(saved)
        try:
            yield
        finally:
            for tensor, saved in zip(tensors, own):
                tensor.copy_(saved)

@contextmanager
def full_parameters(engine) -> Iterator[nn.Module]:
    """The engine's module with whole parameters, also under ZeRO-3 (where they are partitioned:
    every rank must enter, as gathering is a collective)."""
    import deepspeed

    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
            yield engine.module
    else:
        yield engine.module


def offload_optimizer(engine) -> None:
    """Colocated on a GPU (``placement.mode: colocate``): while the engine generates, what only the
    optimizer step needs goes to host memory. Under ZeRO that is DeepSpeed's own offload of the
    fp32 master weights, Adam's moments and the gradients' buffers; without ZeRO, Adam's moments
    (the fp32 weights DeepSpeed keeps for a bf16 model stay). The weights themselves stay: they are
    published and read as they are. On the CPU there is nothing to free."""
    if engine.zero_optimization_stage() > 0:
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as State

        engine.offload_states(include={State.optim_states, State.hp_params, State.lp_grads,
                                       State.contiguous_grad_buffer})
    else:
        # into pinned host buffers made at the first offload and kept: a copy from pageable memory
        # took 0.85 s for 1.2 GiB on an H100 (bench/colocate_gpu.py)
        buffers = engine.__dict__.setdefault("optimizer_host_buffers", {})
        moved = []
        for parameter, state in engine.basic_optimizer.state.items():
            for key, value in state.items():
                if torch.is_tensor(value) and value.is_cuda:
                    host = buffers.get((parameter, key))
                    if host is None:
                        host = buffers[(parameter, key)] = torch.empty_like(value, device="cpu", pin_memory=True)
                    host.copy_(value, non_blocking=True)
                    state[key] = host
                    moved.append((state, key, value.device))
        torch.cuda.synchronize()  # the copies are done before the memory is given up
        engine.offloaded_optimizer_state = moved
    torch.cuda.empty_cache()


def reload_optimizer(engine) -> None:
    """What ``offload_optimizer`` moved, back where it was, before the next step."""
    if engine.zero_optimization_stage() > 0:
        if getattr(engine.optimizer, "offloaded_states", None):
            engine.reload_states()
        return
    for state, key, device in getattr(engine, "offloaded_optimizer_state", []):
        state[key] = state[key].to(device, non_blocking=True)  # the host buffer stays, for the next offload
    engine.offloaded_optimizer_state = []
