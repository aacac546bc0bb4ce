"""The learner's loop: fetch a batch, PPO step, publish weights, log, checkpoint. Top to bottom."""

from __future__ import annotations

import json
import os
import shutil
import time

import torch

from learner import parallel, ppo
from learner.health import HealthMonitor
from learner.kl_control import make_kl_controller
from learner.lora import critic_with_lora, with_lora
from learner.ptx import PtxStream, read_ptx
from learner.schedule import lr_factor, set_lr
from protocol.codec import decode, encode
from common.config import TetherConfig
from common.models import critic_source, resolve_models
from common.runlog import MetricsWriter, StartupTimeline, setup_logging
from protocol.samples import unpack_samples
from common.sequences import collate
from protocol.transport import connect_to_buffer
from weight_sync.tcp import WeightServer
from weight_sync.stream import WeightStreamPublisher
from weight_sync.buckets import ShmWeightWriter


class TrainingStopped(RuntimeError):
    """The learner stopped on purpose (a NaN loss); the message says why and where it saved."""


class Preempted(RuntimeError):
    """SIGTERM or SIGHUP (a scheduler taking the machine back): the learner saved a checkpoint to
    resume from and stopped; ``signal``: the number, for the exit code 128 + it."""

    def __init__(self, message: str, number: int) -> None:
        super().__init__(message)
        self.signal = number


class StopSignal:
    """Notes SIGTERM / SIGHUP instead of dying of it, so the learner ends at the next point where
    its state is whole (between steps, or while it waits for a batch) and checkpoints there."""

    def __init__(self) -> None:
        import signal

        self.number = 0
        for number in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(number, self._note)

    def _note(self, number: int, frame) -> None:
        self.number = number

    def requested(self) -> bool:
        """Whether any rank got the signal (every rank calls it at the same point)."""
        return parallel.any_rank(self.number != 0)


def save_state(checkpoints: str, version: int, actor, critic, kl_controller, moments, client, keep: int = 2) -> str:
    """An atomic checkpoint: the DeepSpeed engines (weights and optimizer, every rank's
    partition), the policy version, the KL controller, the reward moments and the buffer's
    samples and accounting, written into a temporary directory that becomes ``state-N`` by one
    rename once all of it is there and on disk, so a half-written checkpoint is never picked.
    Called on every rank; rank 0 (``client`` given) does the rest."""
    from learner.engines import fsync_tree

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
                   "reward_moments": moments.state_dict() if moments is not None else None}, file)
    with open(os.path.join(temporary, "COMPLETE"), "w") as file:
        file.write(str(version))
    fsync_tree(temporary)
    os.replace(temporary, final)
    fsync_tree(checkpoints, files=False)
    for old in sorted(d for d in os.listdir(checkpoints) if d.startswith("state-") and not d.endswith(".tmp"))[:-keep]:
        shutil.rmtree(os.path.join(checkpoints, old), ignore_errors=True)
    return final


def load_state(directory: str, actor, critic, kl_controller, moments) -> int:
    actor.load_checkpoint(os.path.join(directory, "actor"), tag="state")
    if critic is not None:
        critic.load_checkpoint(os.path.join(directory, "critic"), tag="state")
    with open(os.path.join(directory, "learner.json")) as file:
        state = json.load(file)
    kl_controller.load_state_dict(state["kl_controller"])
    if moments is not None and state["reward_moments"] is not None:
        moments.load_state_dict(state["reward_moments"])
    return int(state["policy_version"])


def newest_state(run_dir: str) -> str | None:
    """The newest complete checkpoint (``state-N`` with its COMPLETE marker), or None."""
    checkpoints = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(checkpoints):
        return None
    complete = [d for d in os.listdir(checkpoints) if d.startswith("state-") and not d.endswith(".tmp")
                and os.path.exists(os.path.join(checkpoints, d, "COMPLETE"))]
    return os.path.join(checkpoints, max(complete)) if complete else None


def stop_on_nonfinite(error: FloatingPointError, actor, config: TetherConfig, policy_version: int, metrics,
                      log) -> None:
    """A NaN loss or output, or non-finite gradients step after step: save the weights the actor
    holds if they are still finite (a skipped step leaves them as they were: the last good ones),
    and stop with ``TrainingStopped`` (exit 3). Weights that hold NaN themselves are not saved:
    the last good policy is then the newest checkpoint. Every rank calls it (the save is collective)."""
    from learner.engines import full_parameters, save_hf_checkpoint

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


def signal_name(number: int) -> str:
    import signal

    return signal.Signals(number).name


def receive_batch(client, policy_version: int, config: TetherConfig, log, stop: StopSignal | None = None):
    """The batch for ``policy_version`` on every rank, or None if a stop signal came while waiting:
    rank 0 asks the buffer for it; every rank hears "not yet" each second while it waits (and
    whether to stop), then gets its message frames, the same bytes decoded by the same codec."""
    fields = {"policy_version": policy_version, "batch_size": config.learner.batch_size}
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


def run(config: TetherConfig) -> str:
    """One rank of the learner. Rank 0 talks to the buffer, publishes weights, writes metrics and
    checkpoints; every rank trains its share of each batch (``learner.parallel``)."""
    rank = int(os.environ.get("RANK", 0))
    log = setup_logging("learner" if rank == 0 else f"learner{rank}", config.log_level)
    timeline = StartupTimeline(config.run_dir, "learner" if rank == 0 else f"learner{rank}")
    config = resolve_models(config, "learner")
    torch.manual_seed(config.seed)
    from learner.engines import (device, init_distributed, load_actor, load_critic, make_engine, publish_weights,
                                 save_hf_checkpoint, snapshot_weights)
    from learner.step import SkippedSteps, behavior_gap, ppo_step

    cfg = config.learner
    timeline.phase("import")
    init_distributed(config)
    timeline.phase("distributed init")
    main = parallel.rank() == 0
    actor_model = with_lora(load_actor(config.models.policy, cfg.dtype), cfg)
    pad_token_id = actor_model.config.pad_token_id if actor_model.config.pad_token_id is not None else 0
    # only GAE needs values; the critic-free estimators take their baseline from the rewards
    critic_model = (critic_with_lora(load_critic(critic_source(config), cfg.dtype), cfg)
                    if cfg.advantage_estimator == "gae" else None)
    timeline.phase("model load")
    actor = make_engine(actor_model, cfg.actor_lr, config)
    critic = make_engine(critic_model, cfg.critic_lr, config) if critic_model is not None else None
    timeline.phase("DeepSpeed init")
    ptx = None
    if config.data.ptx:
        from transformers import AutoTokenizer

        ptx = PtxStream(read_ptx(config.data.ptx, AutoTokenizer.from_pretrained(config.models.policy),
                                 config.rollout.max_model_len), cfg.ptx_batch_size or cfg.minibatch_size, config.seed)
    kl_controller = make_kl_controller(cfg.kl_controller, cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
    moments = ppo.RunningMoments() if cfg.normalize_rewards else None
    checkpoints = os.path.join(config.run_dir, "checkpoints")
    bucket_bytes = config.transport.weight_bucket_mb << 20
    client = weight_writer = weight_server = weight_stream = None
    if main:
        monitor = HealthMonitor(config.health)
        metrics = MetricsWriter(config.run_dir, "learner")
        weight_writer = ShmWeightWriter(config.weights_dir, bucket_bytes, config.transport.weight_slots)
        if config.transport.weight_transport == "tcp":  # rollouts on other hosts fetch the buckets from here
            weight_server = WeightServer(weight_writer, config.transport.weights_address,
                                         config.transport.max_frame_bytes, config.transport.curve)
        else:  # rollouts on this host check each bucket as soon as it is written
            weight_stream = WeightStreamPublisher(config.weights_stream_address)
        client = connect_to_buffer(config, "learner", "0")
        timeline.phase("buffer connect")
        log.info("training %s for %d steps (%s, batch %d, minibatch %d, %d epochs, ZeRO-%d, %d rank(s), "
                 "max_staleness %d)", config.models.policy, cfg.total_steps, cfg.advantage_estimator, cfg.batch_size,
                 cfg.minibatch_size, cfg.ppo_epochs,
                 cfg.zero_stage, parallel.world_size(), config.buffer.max_staleness)

    def publish(version: int) -> None:
        announcer = weight_stream.announcer(version) if weight_stream is not None else None
        manifest = publish_weights(actor, version, weight_writer, announcer, bucket_bytes)
        if main:
            client.request("weights_published", {"policy_version": version, "weights_manifest": manifest.to_dict()})

    policy_version = 0
    if config.resume_from:
        policy_version = load_state(config.resume_from, actor, critic, kl_controller, moments)
        if ptx is not None:  # where the stream would be: one ptx batch per optimizer step
            ptx.position = policy_version * cfg.ppo_epochs * (cfg.batch_size // cfg.minibatch_size) * ptx.batch_size
        publish(policy_version)  # the rollouts start from the SFT weights
        log.info("resumed from %s at policy version %d", config.resume_from, policy_version)
    run_started, first_version = time.monotonic(), policy_version
    skipped = SkippedSteps(cfg.max_skipped_steps)
    stop = StopSignal()
    snapshot = None  # (version, its weights) for behavior_gap, at max_staleness >= 1
    while policy_version < cfg.total_steps:
        wait_started = time.monotonic()
        reply = None if stop.requested() else receive_batch(client, policy_version, config, log, stop)
        if reply is None:
            saved = save_state(checkpoints, policy_version, actor, critic, kl_controller, moments, client)
            message = (f"got {signal_name(stop.number)} at policy version {policy_version}: saved {saved}; "
                       "`tether run --resume` continues from there")
            log.warning("%s", message)
            raise Preempted(message, stop.number)
        samples = unpack_samples(reply)
        if policy_version == first_version:
            timeline.phase("first batch")  # waiting for the rollout, scorers and buffer to deliver it
        train_started = time.monotonic()
        batch = collate(samples, pad_token_id).to(device())
        factor = lr_factor(policy_version, cfg.total_steps, cfg.lr_warmup_steps, cfg.lr_schedule, cfg.lr_min_ratio)
        set_lr(actor, cfg.actor_lr * factor)
        if critic is not None:
            set_lr(critic, cfg.critic_lr * factor)
        gap = None  # the rollout's logprobs against the learner's, on samples of the version snapshotted
        if snapshot is not None:
            gap = behavior_gap(actor, snapshot[1], snapshot[0], samples, batch, config.rollout.temperature,
                               config.rollout.top_p, config.rollout.top_k)
            snapshot = None
        if (config.buffer.max_staleness and cfg.behavior_gap_every
                and (policy_version + 1) % cfg.behavior_gap_every == 0):  # its samples come in the next batches
            snapshot = (policy_version, snapshot_weights(actor))
        try:
            stats = ppo_step(actor, critic, samples, batch, cfg, config.rollout.temperature, kl_controller.value,
                             policy_version, moments, config.seed, config.rollout.samples_per_prompt, ptx, skipped,
                             config.rollout.top_p, config.rollout.top_k)
        except FloatingPointError as error:
            stop_on_nonfinite(error, actor, config, policy_version, metrics if main else None, log)
        stats["skipped_steps_total"] = skipped.total
        if stats["behavior_logprob_gap"] is None:
            stats["behavior_logprob_gap"] = gap
        stats["actor_lr"] = cfg.actor_lr * factor
        kl_controller.update(stats["kl"], n_steps=len(samples))
        policy_version += 1
        sync_started = time.monotonic()
        publish(policy_version)
        if main:
            stats.update(client.counters)  # heartbeats missed, buffer restarts: 0 on a healthy run
            write_step_record(metrics, monitor, log, stats, cfg.total_steps, policy_version, len(samples),
                              int(batch.response_mask.sum()), wait_started, train_started, sync_started, run_started)
        if policy_version == first_version + 1:
            timeline.phase("first step")
        if config.eval.every and policy_version % config.eval.every == 0 and policy_version < cfg.total_steps:
            # for `tether run` to evaluate beside training (evaluator/); the final policy is evaluated too
            save_hf_checkpoint(actor, config.models.policy,
                               os.path.join(checkpoints, f"eval-step-{policy_version:06d}"))
        if cfg.checkpoint_every and policy_version % cfg.checkpoint_every == 0 and policy_version < cfg.total_steps:
            save_hf_checkpoint(actor, config.models.policy, os.path.join(checkpoints, f"step-{policy_version:06d}"))
            save_state(checkpoints, policy_version, actor, critic, kl_controller, moments, client)

    final = save_hf_checkpoint(actor, config.models.policy, os.path.join(checkpoints, "final"))
    if main:
        log.info("saved the final policy to %s", final)
        client.request("finish", {"policy_version": policy_version})
        metrics.close()
        client.close()
        for channel in (weight_server, weight_stream):
            if channel is not None:
                channel.close()
        weight_writer.close(remove=True)  # the run is over: nobody will load these versions
    parallel.barrier()
    return final
