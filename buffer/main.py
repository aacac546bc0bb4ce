"""The buffer's loop: receive a request, update ``BufferState``, answer every request that can now
be answered. Requests that cannot be served yet (credits, scoring work, a batch) are held and
answered later; that is how the rollout is throttled and how the learner waits."""

from __future__ import annotations

import gc
import json
import os
import time
from collections import deque
from dataclasses import dataclass

from buffer.state import BufferState, load_snapshot, save_snapshot
from protocol.codec import ProtocolError
from protocol.config import TetherConfig
from protocol.runlog import MetricsWriter, setup_logging
from protocol.samples import pack_samples, unpack_samples
from protocol.transport import BufferServer
from protocol.weights import WeightManifest

STOP_GRACE_S = 30.0  # after the learner finishes, how long to wait for the other roles to ask and hear "stop"
METRICS_EVERY_S = 2.0


def _percentiles_ms(durations: deque[float]) -> dict[str, float]:
    if not durations:
        return {}
    ordered = sorted(durations)
    pick = lambda q: 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]
    return {"handling_ms_p50": pick(0.50), "handling_ms_p99": pick(0.99), "handling_ms_max": 1000 * ordered[-1],
            "messages_handled": len(ordered)}


@dataclass
class Pending:
    identity: bytes
    request_id: int
    version: int = 0  # rollout_version or policy_version
    amount: int = 0  # wanted credits, max samples, batch size


def run(config: TetherConfig) -> dict:
    log = setup_logging("buffer", config.log_level)
    # The buffer holds many small objects for long; the default collector thresholds scan them
    # all every few thousand allocations, which showed up as 100 ms stalls. Samples form no cycles.
    gc.set_threshold(100_000, 50, 1000)
    if config.resume_from:
        state = load_snapshot(os.path.join(config.resume_from, "buffer.snapshot"), config.learner.batch_size,
                              config.buffer.max_staleness)
        log.info("resumed from %s: policy version %d, %d samples held", config.resume_from, state.weights_version,
                 state.in_flight)
    else:
        state = BufferState(config.learner.batch_size, config.buffer.max_staleness)
    server = BufferServer(config.buffer_address, config.transport.max_frame_bytes, config.transport.curve)
    metrics = MetricsWriter(config.run_dir, "buffer")
    run_id = os.path.basename(os.path.abspath(config.run_dir))
    log.info("listening on %s (batch_size %d, max_staleness %d)",
             config.buffer_address, state.batch_size, state.max_staleness)

    credit_waits: list[Pending] = []
    score_waits: list[Pending] = []
    batch_waits: list[Pending] = []
    clients: dict[bytes, str] = {}  # identity -> role, to know who still has to hear "stop"
    workers: dict[bytes, str] = {}  # identity -> "role:worker_id", stable across a worker's restarts
    last_seen: dict[bytes, tuple[float, str]] = {}  # identity -> (when, what) it last sent
    stopped: set[bytes] = set()
    finished_at: float | None = None
    last_metrics = 0.0
    # time from a message's arrival to every reply it makes possible: what the buffer adds to
    # the latency of whatever flows through it
    handling_s: deque[float] = deque(maxlen=100_000)
    busy_s_total, started = 0.0, time.monotonic()

    def answer_credits(wait: Pending) -> bool:
        if state.finished:
            credits, stop = 0, True
        else:
            credits, stop = state.credits_for(wait.version, wait.amount, workers.get(wait.identity, "rollout")), False
        if credits == 0 and not stop and (state.weights_version <= wait.version or state.weights_manifest is None):
            return False  # nothing to grant and no weights to give (a resumed learner republishes them)
        server.reply(wait.identity, wait.request_id, "credits", {
            "credits": credits, "weights_version": state.weights_version,
            "weights_manifest": state.weights_manifest, "stop": stop})
        if stop:
            stopped.add(wait.identity)
        return True

    def answer_score(wait: Pending) -> bool:
        share = min(wait.amount, state.fair_share(len(score_waits)))
        work = state.take_for_scoring(share, workers.get(wait.identity, "scorer"), time.monotonic(),
                                      config.scorer.deadline_s)
        if not work and not state.finished:
            return False
        fields, tensors = pack_samples(work)
        server.reply(wait.identity, wait.request_id, "score_work", {**fields, "stop": not work}, tensors)
        if not work:
            stopped.add(wait.identity)
        return True

    def answer_batch(wait: Pending) -> bool:
        batch = state.take_batch(wait.version, wait.amount)
        if batch is None:
            return False
        fields, tensors = pack_samples(batch, scored=True)
        server.reply(wait.identity, wait.request_id, "batch", {**fields, "stop": False}, tensors)
        return True

    warned_at: dict[bytes, float] = {}

    def stalled_workers(now: float) -> list[str]:
        """Workers that owe the buffer something (no request of theirs is held, so they are meant
        to be working) and have been silent longer than buffer.stall_warn_s: named in the log, so
        a stuck role is never a silent hang."""
        held = {wait.identity for waits in (credit_waits, score_waits, batch_waits) for wait in waits}
        stalled = []
        for identity, (seen, kind) in last_seen.items():
            if identity in held or identity in stopped or identity not in workers:
                continue
            silent = now - seen
            if silent > config.buffer.stall_warn_s:
                stalled.append(workers[identity])
                if now - warned_at.get(identity, 0.0) > config.buffer.stall_warn_s:
                    warned_at[identity] = now
                    holding = state.scorer_load[workers[identity]]
                    log.warning("%s silent for %.0fs since its %s%s", workers[identity], silent, kind,
                                f", holding {holding} samples to score" if holding else "")
        return stalled

    def serve_waiting() -> None:
        # the least-loaded scorer is served first (idle ones hold nothing; a tie keeps arrival order)
        score_waits.sort(key=lambda wait: state.scorer_load[workers.get(wait.identity, "scorer")])
        for waits, answer in ((batch_waits, answer_batch), (credit_waits, answer_credits), (score_waits, answer_score)):
            waits[:] = [wait for wait in waits if not answer(wait)]

    try:
        while True:
            received = server.receive(timeout_ms=100)
            handling_started = time.perf_counter()
            if received is not None:
                identity, message = received
                last_seen[identity] = (time.monotonic(), message.type)
                try:
                    fields, kind = message.fields, message.type
                    if kind == "hello":
                        worker = f"{fields['role']}:{fields['worker_id']}"
                        clients[identity] = fields["role"]
                        if worker in workers.values() and workers.get(identity) != worker:
                            # the same worker from a new process: what the old one held is lost
                            redispatched = state.redispatch(scorer=worker)
                            reclaimed = state.rollout_gone(worker)
                            log.warning("%s reconnected from a new process; %d samples it held go to the pool "
                                        "again, %d credits it never used are reclaimed", worker, redispatched, reclaimed)
                            for old in [i for i, w in workers.items() if w == worker]:
                                del workers[old]
                                clients.pop(old, None)
                                # its held requests can never be answered: the old socket is gone
                                for waits in (credit_waits, score_waits, batch_waits):
                                    waits[:] = [wait for wait in waits if wait.identity != old]
                        workers[identity] = worker
                        log.info("%s %s connected", fields["role"], fields["worker_id"])
                        server.reply(identity, message.id, "welcome", {
                            "run_id": run_id, "max_staleness": state.max_staleness, "batch_size": state.batch_size,
                            "data_position": state.data_position})
                    elif kind == "credit_request":
                        if fields.get("data_position") is not None:
                            state.data_position = fields["data_position"]
                        credit_waits.append(Pending(identity, message.id, fields["rollout_version"], fields["wanted"]))
                    elif kind == "samples":
                        accepted = state.add_samples(unpack_samples(message), workers.get(identity, "rollout"))
                        server.reply(identity, message.id, "ack", {"accepted": accepted})
                    elif kind == "score_request":
                        score_waits.append(Pending(identity, message.id, 0, fields["max_samples"]))
                    elif kind == "scored":
                        accepted = state.add_scored(unpack_samples(message))
                        server.reply(identity, message.id, "ack", {"accepted": accepted})
                    elif kind == "batch_request":
                        batch_waits.append(Pending(identity, message.id, fields["policy_version"], fields["batch_size"]))
                    elif kind == "weights_published":
                        manifest = WeightManifest.from_dict(fields["manifest"])  # refuse a malformed one here
                        if manifest.version != fields["version"]:
                            raise ProtocolError(f"manifest of version {manifest.version} published as {fields['version']}")
                        state.publish_weights(fields["version"], fields["manifest"])
                        server.reply(identity, message.id, "ack", {"accepted": 1})
                    elif kind == "snapshot":
                        save_snapshot(state, fields["path"])
                        server.reply(identity, message.id, "ack", {"accepted": 1})
                    elif kind == "finish":
                        state.finished, finished_at = True, time.monotonic()
                        stopped.add(identity)
                        log.info("learner finished at policy version %d", fields["policy_version"])
                        server.reply(identity, message.id, "ack", {"accepted": 1})
                    else:
                        server.reply(identity, message.id, "error", {"reason": f"the buffer does not take {kind!r}"})
                except (ProtocolError, ValueError) as error:
                    # A well-formed envelope with contents the buffer cannot use: refuse, keep serving.
                    server.refused += 1
                    log.warning("refused %s from %s: %s", message.type, clients.get(identity, identity), error)
                    server.reply(identity, message.id, "error", {"reason": str(error)})
            expired = state.redispatch(now=time.monotonic())
            if expired:
                log.warning("%d samples passed their scoring deadline of %.0fs; sending them again",
                            expired, config.scorer.deadline_s)
            serve_waiting()
            if received is not None:
                handling_s.append(time.perf_counter() - handling_started)
                busy_s_total += handling_s[-1]

            now = time.monotonic()
            if now - last_metrics >= METRICS_EVERY_S:
                last_metrics = now
                stalled = stalled_workers(now)
                metrics.write({"step": state.learner_version, "unscored": len(state.unscored),
                               "in_scoring": len(state.in_scoring), "scored_waiting": len(state.scored),
                               "granted": state.granted, "generated": state.accounting.generated,
                               "trained": state.accounting.trained, "refused_messages": server.refused,
                               "busy_s_total": busy_s_total, "elapsed_s": now - started, "stalled": stalled})
            if finished_at is not None:
                everyone_told = set(clients) <= stopped
                if everyone_told or now - finished_at > STOP_GRACE_S:
                    break
    finally:
        report = {**state.report(), "refused_messages": server.refused, **_percentiles_ms(handling_s)}
        with open(os.path.join(config.run_dir, "metrics", "buffer_accounting.json"), "w") as file:
            json.dump(report, file, indent=2)
        log.info("accounting: %s", json.dumps(report))
        metrics.close()
        server.close()
    return report
