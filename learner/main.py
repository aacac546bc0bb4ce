"""The learner's loop: fetch a batch, PPO step, publish weights, log, checkpoint. ``run`` reads
top to bottom; each phase is a function below it (``start``, ``resume``, ``next_batch``,
``train``, ``save_due_checkpoints``, ``finish``). ``replay``: the same loop on a run's recorded
batches (``learner/replay.py``)."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass

import torch

from common import models
from common.config import ConfigError, TetherConfig
from common.model_dirs import resolve_models
from common.models import critic_source
from common.packing import checked, segments_on
from common.processors import banning_placeholder, load_processor, sees_images
from common.runlog import MetricsWriter, StartupTimeline, metrics_writer, setup_logging
from common.sequences import SequenceBatch, collate
from learner import ppo
from learner.health import HealthMonitor
from learner.kl_control import make_kl_controller
from learner.ptx import PtxStream, read_ptx
from learner.publish import WeightPublisher
from learner.replay import BatchRecorder, RecordedBuffer
from learner.staleness import StalenessController
from learner.step import StepCarry, behavior_gap, ppo_step
from protocol.codec import decode, encode
from protocol.samples import Sample, unpack_samples
from protocol.transport import connect_to_buffer
from training import parallel
from training.blank_image import blank_image
from training.checkpoints import load_state, save_hf_checkpoint, save_state
from training.deepspeed_engine import (full_parameters, make_deepspeed_engine, offload_optimizer, reload_optimizer,
                                       snapshot_weights)
from training.lora import critic_with_lora, keeps_vision_tower, policy_with_lora
from training.optimizer_step import SkippedSteps
from training.schedule import lr_factor, set_lr
from training.signals import Preempted, StopSignal, signal_name
from training.vision_tower import freeze_vision_tower


class TrainingStopped(RuntimeError):
    """The learner stopped on purpose (a NaN loss); the message says why and where it saved."""


def stop_on_nonfinite(error: FloatingPointError, actor, config: TetherConfig, policy_version: int, metrics,
                      log) -> None:
    """A NaN loss or output, or non-finite gradients step after step: save the weights the actor
    holds if they are still finite (a skipped step leaves them as they were: the last good ones),
    and stop with ``TrainingStopped`` (exit 3). Weights that hold NaN themselves are not saved:
    the last good policy is then the newest checkpoint. Every rank calls it (the save is collective)."""
    with full_parameters(actor) as module:
        finite = all(bool(torch.isfinite(p).all()) for p in module.parameters())
    finite = not parallel.any_rank(not finite)
    checkpoints = os.path.join(config.run_dir, "checkpoints")
    if finite:
        saved = save_hf_checkpoint(actor, config.models.policy,
                                   os.path.join(checkpoints, f"nan-step-{policy_version:06d}"))
        where = f"the last good policy is saved in {saved}"
    else:
        where = (f"the weights themselves hold NaN and are not saved; the last good policy is the newest checkpoint "
                 f"in {checkpoints}")
    if metrics is not None:
        metrics.write({"step": policy_version, "alerts": ["nan_loss"], "alert_nan_loss": 1})
        log.error("ALERT nan_loss: %s; %s; stopping", error, where)
    raise TrainingStopped(f"{error} (policy version {policy_version}); {where}") from None


def receive_batch(client, policy_version: int, config: TetherConfig, log, stop: StopSignal | None = None,
                  max_staleness: int | None = None):
    """The batch for ``policy_version`` on every rank, or None if a stop signal came while waiting:
    rank 0 asks the buffer for it, under the bound ``max_staleness`` (default: the config's fixed
    one); every rank hears "not yet" each second while it waits (and whether to stop), then gets
    its message frames, the same bytes decoded by the same codec."""
    if max_staleness is None:
        max_staleness = config.buffer.initial_staleness
    fields = {"policy_version": policy_version, "batch_size": config.learner.batch_size, "max_staleness": max_staleness}
    main = client is not None
    request_id = client.send("batch_request", fields) if main else None
    started = last_log = time.monotonic()
    reply = None
    while True:
        if main:
            reply = client.reply_to(request_id, "batch_request", 1.0)
        if parallel.any_rank(reply is not None):
            break
        if stop is not None and stop.requested():
            return None  # the buffer puts the batch back if it was already on its way (on_snapshot)
        if main and time.monotonic() - last_log >= 30.0:
            last_log = time.monotonic()
            log.info("learner: waiting %.0fs for batch %d from the buffer", last_log - started, policy_version)
    if parallel.world_size() == 1:
        return reply
    frames = parallel.broadcast_frames(encode("batch", reply.fields, reply.tensors) if main else None)
    return decode(frames, config.transport.max_frame_bytes)


def write_step_record(metrics, monitor, log, stats: dict, total_steps: int, policy_version: int, samples: int,
                      response_tokens: int, wait_started: float, train_started: float, sync_started: float,
                      run_started: float) -> None:
    """One learner.jsonl record per step: the step's statistics, health alerts and where its time went."""
    now = time.monotonic()
    alerts = monitor.observe(stats)
    for alert in alerts:
        log.warning("ALERT %s at step %d: %s", alert.name, policy_version, alert.message)
    record = {"step": policy_version, **stats, "alerts": [alert.name for alert in alerts],
              **{f"alert_{alert.name}": 1 for alert in alerts},
              "waiting_s": train_started - wait_started, "train_s": sync_started - train_started,
              "weight_sync_s": now - sync_started, "iteration_s": now - wait_started,
              "response_tokens": response_tokens, "samples_per_s": samples / (now - wait_started),
              "trained_tokens_per_s": response_tokens / (now - wait_started),
              "elapsed_s": now - run_started, "ranks": parallel.world_size()}
    metrics.write(record)
    log.info("step %d/%d reward %.3f kl %.4f len %.1f entropy %.3f clipfrac %.3f staleness %.2f",
             policy_version, total_steps, stats["reward"], stats["kl"], stats["response_length"],
             stats["entropy"], stats["clipfrac"], stats["staleness"])


def load_engines(config: TetherConfig, timeline: StartupTimeline) -> tuple:
    """(actor, critic, pad_token_id): both models loaded (LoRA-wrapped with ``learner.lora_rank``),
    then each in its DeepSpeed engine. The critic is None unless the estimator is gae (and not pure distillation): the
    critic-free estimators take their baseline from the rewards."""
    cfg, dtype = config.learner, config.models.dtype
    sees = sees_images(config.models.policy)
    # pure distillation trains no critic: each token's advantage is its own reverse KL to the teacher
    source = critic_source(config) if cfg.advantage_estimator == "gae" and not cfg.distill_only else None
    if source is not None and sees and not sees_images(source):
        raise ConfigError(f"models.critic_init: the critic of a policy that sees images ({config.models.policy}) "
                          f"starts from a model that sees them too; {source} does not (critic_init: policy)")
    actor_model = models.load_causal_lm(config.models.policy, dtype)
    actor_model = policy_with_lora(actor_model, config)
    pad_token_id = models.pad_token_id(actor_model)
    critic_model = None
    if source is not None:  # the critic of a policy that sees reads the images through its own towers
        critic_model = models.load_critic(source, dtype)
        critic_model = critic_with_lora(critic_model, cfg,
                                        freeze_vision_tower(critic_model.body) if keeps_vision_tower(config) else None)
    timeline.phase("model load")
    actor = make_deepspeed_engine(actor_model, cfg.actor_lr, config)
    critic = make_deepspeed_engine(critic_model, cfg.critic_lr, config) if critic_model is not None else None
    timeline.phase("DeepSpeed init")
    return actor, critic, pad_token_id


def packing_taken(config: TetherConfig, engines: list, log) -> TetherConfig:
    """``config`` with ``learner.packing`` as both models take it: ``none`` where either cannot
    (``common.packing.checked`` says why in a line). A pass is laid out once for both (the
    critic reads the actor's): where one takes attention row by row and the other not, both
    take dense masks."""
    packing = config.learner.packing
    models = [(engine.module, what) for engine, what in zip(engines, ("the actor", "the critic")) if engine is not None]
    for segments in (True, False):
        packing = config.learner.packing
        for model, what in models:
            packing = checked(model, packing, config.rollout.max_model_len, log, what, segments)
        if packing == "none" or len({segments_on(model) for model, _ in models}) == 1:
            break
    if parallel.any_rank(packing != config.learner.packing):  # the ranks deal rows alike only with one layout
        packing = "none"
    if packing == config.learner.packing:
        return config
    return config.model_copy(update={"learner": config.learner.model_copy(update={"packing": packing})})


def ptx_stream(config: TetherConfig) -> PtxStream | None:
    """PPO-ptx's text, a batch per optimizer step, or None without ``data.ptx``."""
    if not config.data.ptx:
        return None
    from transformers import AutoTokenizer

    cfg = config.learner
    return PtxStream(read_ptx(config.data.ptx, AutoTokenizer.from_pretrained(config.models.policy),
                              config.rollout.max_model_len), cfg.ptx_batch_size or cfg.minibatch_size, config.seed)


@dataclass
class Learner:
    """One rank of the learner, as its loop carries it from step to step. Rank 0 (``main``) alone
    holds the batches' source (``client``: the buffer, or a replay's recorded batches), the metrics
    and the health monitor; every rank trains its share of each batch."""
    config: TetherConfig
    log: logging.Logger
    timeline: StartupTimeline
    actor: object  # its DeepSpeed engine, as the critic's
    critic: object | None  # None unless learner.advantage_estimator is gae (and not distill_only)
    pad_token_id: int
    processor: object | None  # a policy that sees: its samples' images become its inputs
    kl_controller: object
    carry: StepCarry
    publisher: WeightPublisher
    main: bool
    client: object = None
    metrics: MetricsWriter | None = None
    monitor: HealthMonitor | None = None
    recorder: BatchRecorder | None = None
    staleness: StalenessController | None = None
    policy_version: int = 0
    snapshot: tuple | None = None  # (version, its weights) for behavior_gap, at max_staleness >= 1
    offloads: bool = False  # colocated on a GPU: the optimizer's state off the GPU outside the learner's shift

    @property
    def engines(self) -> list:
        return [engine for engine in (self.actor, self.critic) if engine is not None]

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.config.run_dir, "checkpoints")


def run(config: TetherConfig, recorded: str | None = None) -> str:
    """One rank of the learner. Rank 0 talks to the buffer, publishes weights, writes metrics and
    checkpoints; every rank trains its share of each batch (``training.parallel``). ``recorded``: a
    run's recorded batches (``learner.replay``), trained on instead of the buffer's, no weights
    published."""
    learner = start(config, recorded)
    resume(learner)
    total_steps = learner.config.learner.total_steps
    run_started, first_version = time.monotonic(), learner.policy_version
    stop = StopSignal()
    # colocated on a GPU the engine generates in the memory the optimizer's state leaves between
    # steps: from the start (a resumed state, ZeRO's master weights), and a checkpoint saves the
    # state where it lies, so that no reload happens outside the learner's shift
    for engine in learner.engines if learner.offloads else ():
        offload_optimizer(engine)
    while learner.policy_version < total_steps:
        wait_started = time.monotonic()
        max_staleness = learner.staleness.k  # the batch's k: the buffer serves no sample older
        samples = unpack_samples(next_batch(learner, stop, max_staleness))
        if learner.policy_version == first_version:
            learner.timeline.phase("first batch")  # waiting for the rollout, scorers and buffer to deliver it
        train_started = time.monotonic()
        batch = collate(samples, learner.pad_token_id, learner.processor,
                        blank_image(learner.processor)).to(parallel.device())  # ZeRO ranks' blank image
        stats = train(learner, samples, batch, max_staleness)
        learner.policy_version += 1
        sync_started = time.monotonic()
        learner.publisher.publish(learner.actor, learner.policy_version, learner.client)
        if learner.main:
            stats.update(learner.client.counters)  # heartbeats missed, buffer restarts: 0 on a healthy run
            write_step_record(learner.metrics, learner.monitor, learner.log, stats, total_steps, learner.policy_version,
                              len(samples), int(batch.response_mask.sum()), wait_started, train_started, sync_started,
                              run_started)
        if learner.policy_version == first_version + 1:
            learner.timeline.phase("first step")
        save_due_checkpoints(learner)
    return finish(learner)


def start(config: TetherConfig, recorded: str | None) -> Learner:
    """Logging, the seed, the ranks, both engines, the KL controller and what a step carries to
    the next; on rank 0 the batches' source, the metrics and the health monitor."""
    rank = int(os.environ.get("RANK", 0))
    name = "learner" if rank == 0 else f"learner{rank}"
    log = setup_logging(name, config.log_level)
    timeline = StartupTimeline(config.run_dir, name)
    config = resolve_models(config, "learner")
    torch.manual_seed(config.seed)
    cfg = config.learner
    timeline.phase("import")
    parallel.init_distributed(config)
    timeline.phase("distributed init")
    main = parallel.rank() == 0
    actor, critic, pad_token_id = load_engines(config, timeline)
    config = packing_taken(config, [actor, critic], log)
    processor = load_processor(config.models.policy)  # a policy that sees: its samples' images become its inputs
    config = banning_placeholder(config, processor)  # as the rollout samples
    kl_controller = make_kl_controller(cfg.kl_controller, cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
    carry = StepCarry(SkippedSteps(cfg.max_skipped_steps), ppo.RunningMoments() if cfg.normalize_rewards else None,
                      ptx_stream(config))
    learner = Learner(config, log, timeline, actor, critic, pad_token_id, processor, kl_controller, carry,
                      WeightPublisher(config, main and recorded is None), main)
    if main:
        learner.monitor = HealthMonitor(config.health)
        learner.metrics = metrics_writer(config, "learner")
        if recorded is not None:
            learner.client = RecordedBuffer(recorded, config.transport.max_frame_bytes)
        else:
            learner.client = connect_to_buffer(config, "learner", "0")
            timeline.phase("buffer connect")
        if cfg.record_batches:
            learner.recorder = BatchRecorder(config.run_dir)
        log.info("training %s for %d steps (%s, batch %d, minibatch %d, %d epochs, ZeRO-%d, %d rank(s), "
                 "max_staleness %s)", config.models.policy, cfg.total_steps,
                 "distillation alone" if cfg.distill_only else cfg.advantage_estimator, cfg.batch_size,
                 cfg.minibatch_size, cfg.ppo_epochs,
                 cfg.zero_stage, parallel.world_size(), config.buffer.max_staleness)
    learner.staleness = StalenessController(config.buffer)
    learner.offloads = config.colocated and parallel.device().type == "cuda"
    return learner


def resume(learner: Learner) -> None:
    """With ``resume_from``: the saved state loaded (engines, KL controller, reward moments,
    staleness, where the ptx stream was) and its policy published."""
    config, cfg, carry = learner.config, learner.config.learner, learner.carry
    if not config.resume_from:
        return
    learner.policy_version = load_state(config.resume_from, learner.actor, learner.critic, learner.kl_controller,
                                        carry.moments, learner.staleness)
    if carry.ptx is not None:  # where the stream would be: one ptx batch per optimizer step
        carry.ptx.position = (learner.policy_version * cfg.ppo_epochs * (cfg.batch_size // cfg.minibatch_size)
                              * carry.ptx.batch_size)
    # the rollouts start from the SFT weights
    learner.publisher.publish(learner.actor, learner.policy_version, learner.client)
    learner.log.info("resumed from %s at policy version %d", config.resume_from, learner.policy_version)


def next_batch(learner: Learner, stop: StopSignal, max_staleness: int):
    """The next batch's message (recorded where ``learner.record_batches``), or, when a stop signal
    came before or while waiting for it, the whole state saved and ``Preempted`` raised."""
    reply = None if stop.requested() else receive_batch(learner.client, learner.policy_version, learner.config,
                                                        learner.log, stop, max_staleness)
    if reply is None:
        saved = save_state(learner.checkpoint_dir, learner.policy_version, learner.actor, learner.critic,
                           learner.kl_controller, learner.carry.moments, learner.client, staleness=learner.staleness)
        message = (f"got {signal_name(stop.number)} at policy version {learner.policy_version}: saved {saved}; "
                   "`tether run --resume` continues from there")
        learner.log.warning("%s", message)
        raise Preempted(message, stop.number)
    if learner.recorder is not None:
        learner.recorder.write(learner.policy_version, reply)
    return reply


def train(learner: Learner, samples: list[Sample], batch: SequenceBatch, max_staleness: int) -> dict:
    """One learner step on ``batch``: the learning rates of its version, the behavior gap of the
    version snapshotted before, the PPO step between the optimizer's reload and offload, then the
    KL controller and ``max_staleness`` updated. Returns the step's statistics."""
    config, cfg = learner.config, learner.config.learner
    version, actor, critic = learner.policy_version, learner.actor, learner.critic
    factor = lr_factor(version, cfg.total_steps, cfg.lr_warmup_steps, cfg.lr_schedule, cfg.lr_min_ratio)
    set_lr(actor, cfg.actor_lr * factor)
    if critic is not None:
        set_lr(critic, cfg.critic_lr * factor)
    gap = None  # the rollout's logprobs against the learner's, on samples of the version snapshotted
    if learner.snapshot is not None:
        gap = behavior_gap(actor, learner.snapshot[1], learner.snapshot[0], samples, batch, config.sampling)
        learner.snapshot = None
    if (learner.staleness.k and cfg.behavior_gap_every
            and (version + 1) % cfg.behavior_gap_every == 0):  # its samples come in the next batches
        learner.snapshot = (version, snapshot_weights(actor))
    if learner.offloads:  # unmeasured with vLLM beside it (docs/benchmarks.md, "Not measured")
        for engine in learner.engines:
            reload_optimizer(engine)
    try:
        stats = ppo_step(actor, critic, samples, batch, config, version, learner.kl_controller.value, learner.carry)
    except FloatingPointError as error:
        stop_on_nonfinite(error, actor, config, version, learner.metrics, learner.log)
    if learner.offloads:  # before the weights are published: that ends the learner's shift
        for engine in learner.engines:
            offload_optimizer(engine)
    stats["skipped_steps_total"] = learner.carry.skipped.total
    if stats["behavior_logprob_gap"] is None:
        stats["behavior_logprob_gap"] = gap
    stats["actor_lr"] = cfg.actor_lr * factor
    learner.kl_controller.update(stats["kl"], n_steps=cfg.batch_size)  # episodes: a batch may hold parts of them
    stats["max_staleness"] = max_staleness
    change = learner.staleness.update(stats)
    if change is not None:
        stats["staleness_change"] = change
        learner.log.info("max_staleness %s after step %d", change, version + 1)
    return stats


def save_due_checkpoints(learner: Learner) -> None:
    """After a step (the version is the new one's): the policy for ``tether run`` to evaluate beside
    training every ``eval.every`` versions (the final policy is evaluated too), and the policy with
    the whole state every ``learner.checkpoint_every``."""
    config, cfg, version = learner.config, learner.config.learner, learner.policy_version
    if config.eval.every and version % config.eval.every == 0 and version < cfg.total_steps:
        save_hf_checkpoint(learner.actor, config.models.policy,
                           os.path.join(learner.checkpoint_dir, f"eval-step-{version:06d}"))
    if cfg.checkpoint_every and version % cfg.checkpoint_every == 0 and version < cfg.total_steps:
        save_hf_checkpoint(learner.actor, config.models.policy,
                           os.path.join(learner.checkpoint_dir, f"step-{version:06d}"))
        save_state(learner.checkpoint_dir, version, learner.actor, learner.critic, learner.kl_controller,
                   learner.carry.moments, learner.client, staleness=learner.staleness)


def finish(learner: Learner) -> str:
    """The final policy saved, the buffer told training is over, everything closed; returns where
    the final policy is."""
    final = save_hf_checkpoint(learner.actor, learner.config.models.policy, os.path.join(learner.checkpoint_dir, "final"))
    if learner.main:
        learner.log.info("saved the final policy to %s", final)
        learner.client.request("finish", {"policy_version": learner.policy_version})
        learner.metrics.close()
        learner.client.close()
    learner.publisher.close()
    parallel.barrier()
    return final


def replay(run_dir: str, out: str, until: int | None = None, checkpoint: str | None = None) -> dict:
    """The learner alone on ``run_dir``'s recorded batches, in ``out``; returns ``compare``'s report."""
    from learner.replay import RECORDING, compare, replay_config

    directory = os.path.join(run_dir, "batches")
    if not os.path.exists(os.path.join(directory, RECORDING)):
        raise ConfigError(f"{run_dir} has no recorded batches: run it with learner.record_batches: true")
    config = replay_config(run_dir, out, until, checkpoint)
    with open(os.path.join(directory, RECORDING)) as file:
        torch.set_num_threads(json.load(file)["torch_threads"])  # another count sums in another order
    os.makedirs(out, exist_ok=True)
    run(config, recorded=directory)
    return compare(run_dir, out)
