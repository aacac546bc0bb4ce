"""Checkpoints, each written whole or not at all: the actor as an HF model directory (``step-N``,
``final``, ``eval-step-N``, ``nan-step-N``) and the run's whole state (``state-N``: both DeepSpeed
engines with their optimizers, the policy version, the KL controller, the reward moments and the
buffer's samples), each written beside its name, fsynced and renamed into place."""

from __future__ import annotations

import functools
import json
import os
import shutil

from training import parallel
from training.deepspeed_engine import full_parameters
from training.lora import is_lora, merged_named_tensors




@functools.lru_cache(maxsize=4)
def _tokenizer_of(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)

def save_tokenizer(source: str, directory: str) -> None:
    """The tokenizer of the model at ``source`` into ``directory``, every file of it, as the
    tokenizer itself writes them: a fixed list of file names lost the chat template, which
    transformers 5 keeps in ``chat_template.jinja``. The model's ``generation_config.json`` (its
    sampling defaults) comes along where the model's own save did not write one."""
    _tokenizer_of(source).save_pretrained(directory)
    from common.processors import load_processor

    # a policy that sees: its image processor too, or no role could read it (its layout was checked at start)
    processor = load_processor(source, check_layout=False)
    if processor is not None:
        processor.save_pretrained(directory)
    generation = os.path.join(source, "generation_config.json")
    if os.path.exists(generation) and not os.path.exists(os.path.join(directory, "generation_config.json")):
        shutil.copy(generation, directory)

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
    save_tokenizer(policy_path, temporary)
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


def save_state(checkpoints: str, version: int, actor, critic, kl_controller, moments, client, keep: int = 2,
               staleness=None) -> str:
    """An atomic checkpoint: the DeepSpeed engines (weights and optimizer, every rank's
    partition), the policy version, the KL controller, the reward moments and the buffer's
    samples and accounting, written into a temporary directory that becomes ``state-N`` by one
    rename once all of it is there and on disk, so a half-written checkpoint is never picked.
    Called on every rank; rank 0 (``client`` given) does the rest."""
    final = os.path.join(checkpoints, f"state-{version:06d}")
    temporary = final + ".tmp"
    if os.path.exists(os.path.join(final, "COMPLETE")):  # this version is saved (a stop right after a checkpoint)
        return final
    if client is not None:
        shutil.rmtree(temporary, ignore_errors=True)
    parallel.barrier()  # nobody writes into the directory before it is emptied
    actor.save_checkpoint(os.path.join(temporary, "actor"), tag="state")
    if critic is not None:  # a critic-free estimator has none
        critic.save_checkpoint(os.path.join(temporary, "critic"), tag="state")
    parallel.barrier()  # every rank's partition is written
    if client is None:
        return final
    client.request("snapshot", {"path": os.path.abspath(os.path.join(temporary, "buffer.snapshot")),
                                "policy_version": version})
    with open(os.path.join(temporary, "learner.json"), "w") as file:
        json.dump({"policy_version": version, "kl_controller": kl_controller.state_dict(),
                   "reward_moments": moments.state_dict() if moments is not None else None,
                   "staleness": staleness.state_dict() if staleness is not None else None}, file)
    with open(os.path.join(temporary, "COMPLETE"), "w") as file:
        file.write(str(version))
    fsync_tree(temporary)
    os.replace(temporary, final)
    fsync_tree(checkpoints, files=False)
    for old in sorted(d for d in os.listdir(checkpoints) if d.startswith("state-") and not d.endswith(".tmp"))[:-keep]:
        shutil.rmtree(os.path.join(checkpoints, old), ignore_errors=True)
    return final

def load_state(directory: str, actor, critic, kl_controller, moments, staleness=None) -> int:
    actor.load_checkpoint(os.path.join(directory, "actor"), tag="state")
    if critic is not None:
        critic.load_checkpoint(os.path.join(directory, "critic"), tag="state")
    with open(os.path.join(directory, "learner.json")) as file:
        state = json.load(file)
    kl_controller.load_state_dict(state["kl_controller"])
    if moments is not None and state["reward_moments"] is not None:
        moments.load_state_dict(state["reward_moments"])
    if staleness is not None and staleness.auto and state.get("staleness") is not None:
        staleness.load_state_dict(state["staleness"])  # auto's k where the run left it
    return int(state["policy_version"])

def newest_state(run_dir: str) -> str | None:
    """The newest complete checkpoint (``state-N`` with its COMPLETE marker), or None."""
    checkpoints = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(checkpoints):
        return None
    complete = [d for d in os.listdir(checkpoints) if d.startswith("state-") and not d.endswith(".tmp")
                and os.path.exists(os.path.join(checkpoints, d, "COMPLETE"))]
    return os.path.join(checkpoints, max(complete)) if complete else None
