"""DeepSpeed engines for actor and critic, weight publishing and HF checkpoints."""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import time
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from learner import parallel
from learner.lora import is_lora, merged_named_tensors
from common.config import ConfigError, TetherConfig
from common.sequences import classification_head, disable_dropout
from protocol.transport import free_port
from weight_sync.buckets import ShmWeightWriter, WeightManifest, plan_buckets, without_tied_duplicates

log = logging.getLogger("learner")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json")


def device() -> torch.device:
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")


def init_distributed(config: TetherConfig) -> None:
    """One process without a launcher is rank 0 of 1; under torchrun (`learner.ranks`) the
    launcher's environment is kept. gloo on CPU (MACHINE.md), NCCL on GPUs."""
    import datetime

    import deepspeed

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(config.learner.dist_port or free_port()))
    if not torch.cuda.is_available():
        if os.environ["WORLD_SIZE"] == "1" or not config.learner.cpu_shm_allreduce:
            _skip_shared_memory_allreduce()
        else:
            remove_stale_build_locks()
    else:  # unmeasured: no GPU was lent to this project's sessions (docs/benchmarks.md, "Not measured")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    world = int(os.environ["WORLD_SIZE"])
    for key in ("batch_size", "minibatch_size"):  # ranks x hosts: known only now
        if getattr(config.learner, key) % world:
            raise ConfigError(f"learner.{key} ({getattr(config.learner, key)}) must be a multiple of the learner's "
                              f"{world} ranks (learner.ranks x hosts)")
    ptx_batch = config.learner.ptx_batch_size
    if config.data.ptx and ptx_batch is not None and ptx_batch % world:
        raise ConfigError(f"learner.ptx_batch_size ({ptx_batch}) must be a multiple of the learner's {world} ranks")
    timeout = datetime.timedelta(seconds=config.learner.dist_timeout_s)
    parallel.set_timeout(timeout)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", timeout=timeout)


def _skip_shared_memory_allreduce() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op (~90 s on a fresh
    machine, MACHINE.md) that a single rank never calls, and that several ranks use only with
    ``learner.cpu_shm_allreduce``; marking it unavailable makes DeepSpeed use plain gloo, as it
    does wherever the op cannot be built."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


def remove_stale_build_locks(max_age_s: float = 900.0) -> list[str]:
    """Remove torch JIT-build lock files older than ``max_age_s``. A process killed while
    compiling an extension leaves its ``lock`` behind, and every later build of that extension
    waits on it forever without a word; a real build here takes about 90 s."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    removed = []
    for build_dir, _, files in os.walk(root):
        if "lock" not in files:
            continue
        lock = os.path.join(build_dir, "lock")
        age_s = time.time() - os.path.getmtime(lock)
        if age_s > max_age_s:
            log.warning("removing %s, left %.0f s ago by a build that never finished", lock, age_s)
            os.remove(lock)
            removed.append(lock)
    return removed


def load_actor(path: str, dtype: str = "float32") -> nn.Module:
    from transformers import AutoModelForCausalLM

    return disable_dropout(AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)))


class ValueModel(nn.Module):
    """A per-token value model: a causal LM's transformer body with a one-output head on every
    position. Built by tether for every family alike, so no family needs a token-classification
    class of its own (OPT has none) nor a head of a given attribute name. ``forward`` returns
    ``.logits`` of shape [B, L, 1], as HF's token classifiers do."""

    def __init__(self, body: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.body, self.head, self.config = body, head, body.config
        # a decoder builds a KV cache at every forward unless told not to (a concat per layer, for nothing)
        self.no_cache = {"use_cache": False} if "use_cache" in inspect.signature(body.forward).parameters else {}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        from transformers.modeling_outputs import TokenClassifierOutput

        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, **self.no_cache).last_hidden_state
        return TokenClassifierOutput(logits=self.head(hidden))


def load_critic(path: str, dtype: str = "float32") -> nn.Module:
    """The critic from ``path``: the transformer body of the model there with a one-output head on
    every position. From a reward model the head starts as the RM's score head (found by
    ``classification_head``, whatever its name); from a policy it starts fresh. A bias starts at
    zero, so an RM-initialised critic starts out predicting the RM's own score at each position."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    try:
        source = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=getattr(torch, dtype))
    except ValueError:  # a family without a sequence-classification class: its body and a new head
        body = AutoModel.from_pretrained(path, dtype=getattr(torch, dtype))
        head = nn.Linear(body.config.hidden_size, 1, dtype=getattr(torch, dtype))
        with torch.no_grad():
            head.weight.normal_(0.0, 1.0 / (body.config.hidden_size + 1))  # HF's score-head init
            head.bias.zero_()
        return disable_dropout(ValueModel(body, head))
    head = classification_head(source)
    if head.bias is not None:
        with torch.no_grad():
            head.bias.zero_()
    return disable_dropout(ValueModel(source.base_model, head))


def make_engine(model: nn.Module, lr: float, config: TetherConfig):
    import deepspeed

    learner = config.learner
    world = int(os.environ.get("WORLD_SIZE", 1))
    if learner.gradient_checkpointing:
        body = model.body if isinstance(model, ValueModel) else model
        body.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # HF checkpoints only in training mode (dropout is off in every tether model)
    ds_config = {
        # a minibatch is split evenly between the ranks (data parallel), each rank's share into micro-batches
        # whose count varies (learner.micro_batches): ppo_step marks the last of them as the accumulation
        # boundary itself, and scales each one's loss by its share; DeepSpeed averages the ranks' gradients
        "train_micro_batch_size_per_gpu": learner.minibatch_size // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": learner.grad_clip,
        "zero_optimization": {"stage": learner.zero_stage},
        # DeepSpeed keeps fp32 master weights and optimizer state for a bf16 / fp16 model
        "bf16": {"enabled": learner.dtype == "bfloat16"},
        "fp16": {"enabled": learner.dtype == "float16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]  # LoRA: the adapters
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=learner.weight_decay, eps=1e-8)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    if world == 1 and learner.zero_stage == 0:  # an all-reduce over one rank copies every gradient for nothing
        engine.enable_backward_allreduce = False
    engine.gradient_guard = GradientGuard(model, enabled=learner.dtype != "float16")
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
        # the gradient and nan_to_num a copy of every gradient (8% of a learner step, bench/learner.py)
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


def skip_step(engine) -> None:
    """End the minibatch without an update: DeepSpeed's step at learning rate 0 clears the gradients
    and keeps its counters in line (on every ZeRO stage alike), and the optimizer's moments and step
    count are put back as they were, so the weights and the state are those before the minibatch.
    The guard made the gradients finite, so 0 x gradient changes no weight."""
    optimizer = engine.basic_optimizer  # the AdamW of make_engine; under ZeRO it holds the fp32 partitions
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


def publish_weights(engine, version: int, writer: ShmWeightWriter | None, on_bucket=None,
                    bucket_bytes: int | None = None) -> WeightManifest | None:
    """Write the actor's weights for ``version`` into shared memory as checked buckets; the
    returned manifest is what the rollout needs to find and verify them. Called on every rank:
    rank 0 (``writer`` given) writes, the others only take part in the gathers (and plan the same
    buckets: ``bucket_bytes``, the writer's). Under ZeRO-3 the
    parameters of one bucket at a time are gathered, so no rank holds the whole model twice."""
    import deepspeed

    if engine.zero_optimization_stage() != 3:  # whole on rank 0; LoRA (never with ZeRO-3): merged there only
        if writer is None:
            return None
        return writer.publish(version, without_tied_duplicates(merged_named_tensors(engine.module)), on_bucket)
    named = without_tied_duplicates(engine.module.state_dict(keep_vars=True).items())
    # a partitioned parameter's full shape is ds_shape; its data is empty until gathered
    layout = plan_buckets([(name, getattr(t, "ds_shape", t.shape), t.dtype) for name, t in named],
                          writer.bucket_bytes if writer is not None else bucket_bytes)
    tensors = dict(named)

    @contextmanager
    def open_bucket(entries):
        partitioned = {id(tensors[e.name]): tensors[e.name] for e in entries if hasattr(tensors[e.name], "ds_id")}
        with deepspeed.zero.GatheredParameters(list(partitioned.values()), modifier_rank=None):
            yield {e.name: tensors[e.name].data for e in entries}

    if writer is not None:
        return writer.publish_buckets(version, layout, open_bucket, on_bucket)
    for entries in layout:  # the other ranks: the same gathers, in the same order
        with open_bucket(entries):
            pass
    return None


def save_hf_checkpoint(engine, policy_path: str, directory: str) -> str:
    """An HF model directory of the actor (weights, config, tokenizer), loadable by transformers
    and vLLM; written next to its final name and renamed, so a half-written one never exists.
    Called on every rank (the ZeRO-3 gather is collective); rank 0 writes."""
    temporary = directory + ".tmp"
    with full_parameters(engine) as module:
        if not parallel.is_main():
            return directory
        shutil.rmtree(temporary, ignore_errors=True)
        if is_lora(module):  # the merged model, as the rollout has it, and the adapters on their own
            module.get_base_model().save_pretrained(temporary, state_dict=dict(merged_named_tensors(module)),
                                                    safe_serialization=True)
            module.save_pretrained(os.path.join(temporary, "adapter"), safe_serialization=True)
        else:
            module.save_pretrained(temporary, safe_serialization=True)
    for name in TOKENIZER_FILES:
        source = os.path.join(policy_path, name)
        if os.path.exists(source):
            shutil.copy(source, temporary)
    fsync_tree(temporary)
    replace_directory(temporary, directory)
    return directory


def fsync_tree(directory: str, files: bool = True) -> None:
    """Every file (with ``files``) and directory under ``directory`` on disk before a rename makes
    it visible: a rename that reaches the disk before the data would name a torn checkpoint."""
    for root, _, names in os.walk(directory, topdown=False):
        for name in names if files else ():
            with open(os.path.join(root, name), "rb") as file:
                os.fsync(file.fileno())
        descriptor = os.open(root, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        if not files:
            return


def replace_directory(source: str, target: str) -> None:
    """Put the directory ``source`` at ``target`` in one step: at every moment ``target`` is the old
    directory or the new one, whole (Linux's renameat2 exchange; where the file system has none,
    the old one is moved aside first, so a crash leaves it as ``target.old``). Then on disk."""
    parent = os.path.dirname(os.path.abspath(target))
    if not os.path.exists(target):
        os.replace(source, target)
    elif _exchange(source, target):
        shutil.rmtree(source)  # now the old one
    else:
        aside = target + ".old"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(target, aside)
        os.replace(source, target)
        shutil.rmtree(aside)
    fsync_tree(parent, files=False)


def _exchange(first: str, second: str) -> bool:
    """Swap two paths atomically (renameat2 with RENAME_EXCHANGE); False where it is not supported."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return libc.renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange) == 0
