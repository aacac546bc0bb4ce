"""Data parallelism between the ranks (the learner's, a stage's): who holds which rows, and the few
collectives a step needs besides DeepSpeed's own gradient all-reduce.

Every rank holds the whole batch (rank 0 receives it from the buffer and broadcasts its message
frames: the same bytes, decoded by the same codec, nothing pickled). Each rank computes the
proximal pass for its share of the rows, and the shares are gathered, so advantages are
whitened over the whole batch exactly as on one rank. Each minibatch is split the same way.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist

from common.config import ConfigError, TetherConfig
from protocol.transport import free_port

log = logging.getLogger("learner")

_cpu_group = None
_timeout = None  # learner.dist_timeout_s, for the gloo group made on GPUs


def set_timeout(timeout) -> None:
    """The deadline of every collective of the groups made here (a timedelta)."""
    global _timeout
    _timeout = timeout


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def local_rows(count: int) -> slice:
    """This rank's contiguous share of ``count`` rows: the shares differ by one row at most (a batch
    of episodes in parts has more rows than episodes, in any number)."""
    return slice(rank() * count // world_size(), (rank() + 1) * count // world_size())


def _group():
    """A gloo group for host-memory tensors: the default group is NCCL on GPUs."""
    global _cpu_group
    if _cpu_group is None:
        # unmeasured on CUDA: no GPU was lent to this project's sessions
        _cpu_group = (dist.new_group(backend="gloo", timeout=_timeout) if dist.get_backend() != "gloo"
                      else dist.group.WORLD)
    return _cpu_group


def broadcast_frames(frames: list | None) -> list[bytes]:
    """Rank 0's message frames on every rank (``frames`` is ignored elsewhere)."""
    if world_size() == 1:
        return [bytes(frame) for frame in frames]
    sizes = torch.tensor([memoryview(f).nbytes for f in frames] if rank() == 0 else [], dtype=torch.int64)
    count = torch.tensor([len(sizes)], dtype=torch.int64)
    dist.broadcast(count, 0, group=_group())
    if rank() != 0:
        sizes = torch.zeros(int(count), dtype=torch.int64)
    dist.broadcast(sizes, 0, group=_group())
    if rank() == 0:
        payload = torch.frombuffer(bytearray(b"".join(bytes(f) for f in frames)), dtype=torch.uint8)
    else:
        payload = torch.empty(int(sizes.sum()), dtype=torch.uint8)
    dist.broadcast(payload, 0, group=_group())
    data, out, start = payload.numpy().tobytes(), [], 0
    for size in sizes.tolist():
        out.append(data[start:start + size])
        start += size
    return out


def gather_rows(local: torch.Tensor, count: int) -> torch.Tensor:
    """Each rank's ``local_rows(count)`` rows [share, ...] -> [count, ...] on every rank, rows in rank
    order (shares padded to the largest for the gather, the padding left out)."""
    world = world_size()
    if world == 1:
        return local
    shares = [(r + 1) * count // world - r * count // world for r in range(world)]
    padded = local.new_zeros((max(shares), *local.shape[1:]))
    padded[:len(local)] = local
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded.contiguous())
    return torch.cat([piece[:share] for piece, share in zip(pieces, shares)])


def mean_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Each statistic averaged over the ranks (each computed on that rank's rows)."""
    if world_size() == 1 or not values:
        return values
    names = sorted(values)
    vector = torch.tensor([float(values[name]) for name in names], dtype=torch.float64)
    dist.all_reduce(vector, group=_group())
    return dict(zip(names, (vector / world_size()).tolist()))


def max_over_ranks(value: int) -> int:
    """The largest ``value`` of any rank, on every rank."""
    if world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_group())
    return int(tensor.item())


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on one (a stop must be taken together)."""
    return bool(max_over_ranks(1 if flag else 0))


def barrier() -> None:
    if world_size() > 1:
        dist.barrier(group=_group())


def is_main() -> bool:
    return int(os.environ.get("RANK", 0)) == 0


def device() -> torch.device:
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")

def init_distributed(config: TetherConfig) -> None:
    """The learner's process group (``init_process_group``), its batch sizes checked against the
    world size known only now."""
    cfg = config.learner
    init_process_group(cfg.dist_port, cfg.dist_timeout_s, cfg.cpu_shm_allreduce)
    world = int(os.environ["WORLD_SIZE"])
    for key in ("batch_size", "minibatch_size"):  # ranks x hosts: known only now
        if getattr(config.learner, key) % world:
            raise ConfigError(f"learner.{key} ({getattr(config.learner, key)}) must be a multiple of the learner's "
                              f"{world} ranks (learner.ranks x hosts)")
    ptx_batch = config.learner.ptx_batch_size
    if config.data.ptx and ptx_batch is not None and ptx_batch % world:
        raise ConfigError(f"learner.ptx_batch_size ({ptx_batch}) must be a multiple of the learner's {world} ranks")


def init_process_group(dist_port: int = 0, dist_timeout_s: float = 1800.0, cpu_shm_allreduce: bool = False) -> None:
    """One process without a launcher is rank 0 of 1; under torchrun (`learner.ranks`, a stage's
    ``ranks``) the launcher's environment is kept. gloo on CPU (docs/machine.md), NCCL on GPUs."""
    import datetime

    import deepspeed

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(dist_port or free_port()))
    if not torch.cuda.is_available():
        if os.environ["WORLD_SIZE"] == "1" or not cpu_shm_allreduce:
            _skip_shared_memory_allreduce()
        else:
            remove_stale_build_locks()
    else:  # unmeasured: no GPU was lent to this project's sessions (docs/benchmarks.md, "Not measured")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    timeout = datetime.timedelta(seconds=dist_timeout_s)
    set_timeout(timeout)
    if not dist.is_initialized():  # a new default group: subgroups cached from an earlier one are dead
        _forget_groups()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", timeout=timeout)

def _forget_groups() -> None:
    """Drop the subgroups DeepSpeed and this module keep of a default group that is gone. Only one
    process makes a second default group: a test's, after a vLLM engine in that process destroyed
    the first at its shutdown (DeepSpeed would then broadcast over a group torch no longer knows)."""
    global _cpu_group
    from deepspeed.utils import groups

    _cpu_group = None
    release = getattr(groups, "_release_process_group_references", None)  # DeepSpeed's own teardown
    if release is not None:
        release(None)


def _skip_shared_memory_allreduce() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op (~90 s on a fresh
    machine, docs/machine.md) that a single rank never calls, and that several ranks use only with
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
