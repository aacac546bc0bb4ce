"""The buffer's loop: receive a request, hand it to the handler of its type, answer every held
request that can now be answered. Requests that cannot be served yet (credits, scoring work, a
batch) are held and answered later; that is how the rollout pool is throttled and how the
learner waits. ``BufferState`` does the bookkeeping; this file only talks."""

from __future__ import annotations

import gc
import json
import os
import signal
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass

from buffer.state import BufferState, GroupFilter, load_snapshot, save_snapshot
from buffer.shifts import Shifts
from common.config import TetherConfig
from common.runlog import StartupTimeline, metrics_writer, new_file, setup_logging
from protocol.codec import Message, ProtocolError, cut
from protocol.samples import pack_samples, unpack_samples
from protocol.schema import SENDER_ROLES, SENDERS
from protocol.security import role_of_key, worker_of_key
from protocol.transport import ALIVE_ELSEWHERE, BufferServer
from weight_sync.buckets import WeightManifest

STOP_GRACE_S = 30.0  # after the learner finishes, how long to wait for the other roles to ask and hear "stop"
METRICS_EVERY_S = 2.0
LOGGED_CHARS = 1000  # of what a refused message's error says, in the log
# what `tether run` sends a role it stops (SIGTERM), a scheduler or a closed terminal (SIGHUP), Ctrl-C
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class BufferStopped(RuntimeError):
    """A stop signal ended the buffer before the learner finished (`tether run` stopping the run
    because another role failed, a scheduler); its accounting is written. ``signal``: the number,
    for the exit code 128 + it."""

    def __init__(self, number: int) -> None:
        super().__init__(f"got {signal.Signals(number).name}; accounting written to metrics/buffer_accounting.json")
        self.signal = number


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
    policy_version: int = 0  # the engine's (credits) or the learner's (batch)
    amount: int = 0  # wanted credits, max samples, batch size


class Buffer:
    """The buffer role: one handler per message type (``on_<type>``), each a few lines over
    ``BufferState``. A connection is a ZeroMQ identity; a worker (``role:index``) keeps its name
    across restarts, so a new process of the same worker is told from a new member of a pool."""

    def __init__(self, config: TetherConfig) -> None:
        self.config = config
        self.log = setup_logging("buffer", config.log_level, libraries=False)  # it loads no model
        batch_size, n = config.learner.batch_size, config.rollout.samples_per_prompt
        k, ceiling = config.buffer.initial_staleness, config.buffer.staleness_ceiling
        learner = config.learner
        group_filter = (GroupFilter(config.buffer.max_filter_ratio, learner.score_clip, learner.truncation_penalty)
                        if config.buffer.filter_groups else None)
        if config.resume_from:  # under auto the learner's first request brings its bound
            self.state = load_snapshot(os.path.join(config.resume_from, "buffer.snapshot"), batch_size, k, n, ceiling,
                                       group_filter)
            self.log.info("resumed from %s: policy version %d, %d samples held, prompt stream at %d",
                          config.resume_from, self.state.policy_version, self.state.in_flight,
                          self.state.next_prompt_index)
        else:
            self.state = BufferState(batch_size, k, n, staleness_ceiling=ceiling, group_filter=group_filter)
        self.unfiltered_warned = -1  # the batches served when the filtering bound was last said to be reached
        # a pairwise judge compares the responses of a group: a scorer is given whole groups
        self.whole_groups = any(judge.mode == "pairwise" for judge in config.scorer.judges)
        self.server = BufferServer(config.buffer_address, config.transport.max_frame_bytes, config.transport.curve,
                                   config.transport.heartbeat_s, config.transport.peer_deadline_s)
        self.metrics = metrics_writer(config, "buffer")
        self.run_id = os.path.basename(os.path.abspath(config.run_dir))
        self.incarnation = uuid.uuid4().hex[:12]  # a restarted buffer is told from this one by its clients
        self.weight_failures: dict[str, tuple[int, int, str]] = {}  # rollout -> (failures, version, reason)
        self.checkpoints = os.path.realpath(os.path.join(config.run_dir, "checkpoints"))
        # placement.mode colocate: the roles share the devices and work in shifts, granted here
        self.shifts = Shifts(config.placement.shift_deadline_s) if config.colocated else None
        self.credit_waits: list[Pending] = []
        self.score_waits: list[Pending] = []
        self.batch_waits: list[Pending] = []
        self.workers: dict[bytes, str] = {}  # identity -> "role:worker_id"
        self.last_seen: dict[bytes, tuple[float, str]] = {}  # identity -> (when, what) it last sent
        self.warned_at: dict[bytes, float] = {}
        self.stopped: set[bytes] = set()  # identities told to stop
        # colocated: workers that said goodbye holding a shift; its devices are free once their process is
        # gone, which its restart's hello says (or the shift's deadline ends the wait)
        self.departed: set[str] = set()
        self.key_workers: dict[str, str] = {}  # a CURVE key's name -> the one worker it speaks for
        self.finished_at: float | None = None
        # a stop signal is noted and ends the loop between two messages, never inside a handler, so
        # the accounting written after it sees whole state
        self.stop_signal = 0
        # time from a message's arrival to every reply it makes possible: what the buffer adds to
        # the latency of whatever flows through it
        self.handling_s: deque[float] = deque(maxlen=100_000)
        self.busy_s_total, self.started = 0.0, time.monotonic()

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict:
        StartupTimeline(self.config.run_dir, "buffer").phase("listening")
        self.log.info("listening on %s (batch_size %d, max_staleness %d)", self.config.buffer_address,
                      self.state.batch_size, self.state.max_staleness)
        last_metrics = 0.0
        try:
            while not self._done():
                received = self.server.receive(timeout_ms=100)
                handling_started = time.perf_counter()
                if received is not None:
                    self.handle(*received)
                expired = self.state.redispatch(now=time.monotonic())
                if expired:
                    self.log.warning("%d samples passed their scoring deadline of %.0fs; sending them again",
                                     expired, self.config.scorer.deadline_s)
                if self.shifts is not None:
                    if expired:  # a scorer whose samples went to another holds nothing now
                        self.release_idle_scorers()
                    self.end_overdue_shift(time.monotonic())
                self.serve_waiting()
                if received is not None:
                    self.handling_s.append(time.perf_counter() - handling_started)
                    self.busy_s_total += self.handling_s[-1]
                if time.monotonic() - last_metrics >= METRICS_EVERY_S:
                    last_metrics = time.monotonic()
                    self.reclaim_silent_engines(last_metrics)
                    self.write_metrics(last_metrics)
            ended_by = signal.Signals(self.stop_signal).name if self.stop_signal else "finish"
        except BaseException as error:
            ended_by = f"{type(error).__name__}: {error}"
            raise
        finally:
            report = self.close(ended_by)
        return report

    def handle(self, identity: bytes, message: Message) -> None:
        """Check who is speaking, then call the handler of the message's type. A message the buffer
        cannot use is refused with the reason; the buffer keeps serving."""
        self.last_seen[identity] = (time.monotonic(), message.type)
        try:
            role = message.fields["role"] if message.type == "hello" else self.workers.get(identity, ":").split(":")[0]
            if role not in SENDERS.get(message.type, ()):
                who = self.workers.get(identity, "a client that has not said hello")
                raise PermissionError(f"the buffer does not take {message.type!r} from {who}")
            if self.config.transport.curve.enabled and role and role_of_key(message.key, SENDER_ROLES) != role:
                raise PermissionError(f"the client key {message.key!r} may not speak as {role} (a key is bound to "
                                      "the role its name starts with: learner, rollout-0, scorer-1...)")
            getattr(self, f"on_{message.type}")(identity, message)
        except (ProtocolError, ValueError, OSError) as error:  # PermissionError is an OSError
            self.server.refused += 1
            self.log.warning("refused %s from %s: %s", message.type, self.workers.get(identity, identity),
                             cut(str(error), LOGGED_CHARS))
            self.server.reply(identity, message.id, "error", {"reason": cut(str(error))})
        except Exception as error:  # a handler's own bug: the message is refused, the loop never dies of one
            self.server.refused += 1
            self.log.exception("the buffer could not handle %s from %s", message.type, self.workers.get(identity, identity))
            self.server.reply(identity, message.id, "error", {"reason": cut(f"the buffer could not handle this "
                                                                             f"{message.type} ({type(error).__name__})")})

    def _done(self) -> bool:
        if self.stop_signal:
            return True
        if self.finished_at is None:
            return False
        everyone_told = set(self.workers) <= self.stopped
        return everyone_told or time.monotonic() - self.finished_at > STOP_GRACE_S

    # ------------------------------------------------------------------ handlers, one per type

    def on_hello(self, identity: bytes, message: Message) -> None:
        role, worker_id = message.fields["role"], message.fields["worker_id"]
        worker = f"{role}:{worker_id}"
        if role == "learner" and worker_id != "0":
            raise ValueError("a learner of several ranks talks to the buffer through rank 0 alone")
        if self.config.transport.curve.enabled:
            self._bind_key(message.key, worker)
        others = [other for other, name in self.workers.items() if name == worker and other != identity]
        if any(self.server.connected(other) for other in others):  # not a restart: the worker is alive
            raise PermissionError(f"{worker} {ALIVE_ELSEWHERE}: a second process of one worker is refused (a "
                                  "restart is taken once the old process's connection is gone)")
        if others:
            self._forget_old_process(worker)
        if worker in self.departed:
            self.departed.discard(worker)
            self.shifts.forget(worker)
        self.workers[identity] = worker
        self.log.info("%s connected", worker)
        self.server.reply(identity, message.id, "welcome", {
            "run_id": self.run_id, "incarnation": self.incarnation, "max_staleness": self.state.max_staleness, "batch_size": self.state.batch_size})

    def _bind_key(self, key: str, worker: str) -> None:
        """A CURVE key speaks for one worker: the one its name numbers (``scorer-0``: scorer:0), else
        the first it said hello as; a hello as another is refused, naming both."""
        bound = worker_of_key(key, SENDER_ROLES) or self.key_workers.setdefault(key, worker)
        if bound != worker:
            raise PermissionError(f"the client key {key!r} speaks for {bound}, not {worker}: a key is one worker's "
                                  "(`tether keys DIR ROLE-N` makes worker N's)")

    def _forget_old_process(self, worker: str) -> None:
        """The same worker from a new process: what the old one held goes back to the pool."""
        redispatched, reclaimed = self._return_held(worker)
        self.log.warning("%s reconnected from a new process; %d samples it held go to the pool again, %d credits "
                         "it never used come back", worker, redispatched, reclaimed)
        if self.shifts is not None:
            self.shifts.forget(worker)
        for old in [identity for identity, name in self.workers.items() if name == worker]:
            self._forget_identity(old)

    def _forget_identity(self, identity: bytes) -> str:
        """The process behind ``identity`` is gone: its worker name (returned) and its held requests,
        which can never be answered, go."""
        for waits in (self.credit_waits, self.score_waits, self.batch_waits):
            waits[:] = [wait for wait in waits if wait.identity != identity]
        return self.workers.pop(identity)

    def _return_held(self, worker: str) -> tuple[int, int]:
        """What ``worker`` held goes back to the pool: a scorer's samples to score again, an engine's
        unused credits and the prompts it generated nothing of. Returns (samples, credits)."""
        return self.state.redispatch(scorer=worker), self.state.rollout_gone(worker)

    def on_goodbye(self, identity: bytes, message: Message) -> None:
        """A rollout or scorer stopping on an error: what it held goes back to the pool now (not after
        its deadline), and the run's end does not wait for it to hear "stop". Not answered: it is gone."""
        worker = self._forget_identity(identity)
        self.weight_failures.pop(worker, None)  # no longer stalled: gone
        redispatched, reclaimed = self._return_held(worker)
        if self.shifts is not None:  # an engine still awake on the devices: the next shift waits for its exit
            self.departed.add(worker)
        self.log.warning("%s stopped: %s; %d samples it held go to the pool again, %d credits it never used come "
                         "back", worker, message.fields["reason"], redispatched, reclaimed)

    def on_ping(self, identity: bytes, message: Message) -> None:
        self.server.reply(identity, message.id, "pong", {"run_id": self.run_id, "incarnation": self.incarnation})

    def on_weights_refused(self, identity: bytes, message: Message) -> None:
        worker, fields = self.workers[identity], message.fields
        if self.state.finished:  # the learner is gone and its weights with it: expected, and said as such (0)
            self.server.reply(identity, message.id, "ack", {"accepted": 0})
            return
        self.weight_failures[worker] = (fields["failures"], fields["policy_version"], fields["reason"])
        self.log.warning("%s could not load policy version %d (%d time(s) in a row): %s", worker,
                         fields["policy_version"], fields["failures"], fields["reason"])
        self.server.reply(identity, message.id, "ack", {"accepted": 1})

    def on_credit_request(self, identity: bytes, message: Message) -> None:
        if message.fields["wanted"] > 0:  # an engine that asks for work again has loaded its weights
            self.weight_failures.pop(self.workers[identity], None)
        self.credit_waits.append(Pending(identity, message.id, message.fields["policy_version"],
                                         message.fields["wanted"]))

    def on_samples(self, identity: bytes, message: Message) -> None:
        accepted = self.state.add_samples(unpack_samples(message), self.workers[identity])
        self.server.reply(identity, message.id, "ack", {"accepted": accepted})

    def on_episodes_dropped(self, identity: bytes, message: Message) -> None:
        fields = message.fields
        if len(fields["prompt_indices"]) != len(fields["reasons"]):
            raise ProtocolError(f"episodes_dropped: {len(fields['prompt_indices'])} prompt indices, "
                                f"{len(fields['reasons'])} reasons")
        returned = self.state.drop_episodes(fields["prompt_indices"], fields["reasons"], self.workers[identity])
        self.server.reply(identity, message.id, "ack", {"accepted": returned})

    def on_score_request(self, identity: bytes, message: Message) -> None:
        self.score_waits.append(Pending(identity, message.id, 0, message.fields["max_samples"]))

    def on_scored(self, identity: bytes, message: Message) -> None:
        state, unfiltered = self.state, self.state.accounting.groups_unfiltered
        accepted = state.add_scored(unpack_samples(message))
        self.server.reply(identity, message.id, "ack", {"accepted": accepted})
        if self.shifts is not None:
            self.release_idle_scorers()  # its share is scored: the score shift may end
        if state.accounting.groups_unfiltered > unfiltered and self.unfiltered_warned != state.batches_served:
            self.unfiltered_warned = state.batches_served
            self.log.warning("buffer.filter_groups dropped %d episodes since the last batch, buffer.max_filter_ratio "
                             "(%g) x the batch: groups of equal rewards go into the next batch as they are",
                             state.filtered_since_batch, self.config.buffer.max_filter_ratio)

    def on_batch_request(self, identity: bytes, message: Message) -> None:
        max_staleness = message.fields["max_staleness"]  # the learner's: fixed, or its controller's under auto
        if max_staleness != self.state.max_staleness:
            previous = self.state.set_max_staleness(max_staleness)
            self.log.info("max_staleness %d -> %d from policy version %d (the learner's)", previous, max_staleness,
                          message.fields["policy_version"])
        self.batch_waits.append(Pending(identity, message.id, message.fields["policy_version"],
                                        message.fields["batch_size"]))

    def on_weights_published(self, identity: bytes, message: Message) -> None:
        manifest = WeightManifest.from_dict(message.fields["weights_manifest"])  # refuse a malformed one here
        if manifest.policy_version != message.fields["policy_version"]:
            raise ProtocolError(f"manifest of version {manifest.policy_version} published as {message.fields['policy_version']}")
        self._end_shift_of(identity)  # a learner past its train shift's deadline publishes nothing
        self.state.publish_weights(message.fields["policy_version"], message.fields["weights_manifest"])
        self.server.reply(identity, message.id, "ack", {"accepted": 1})

    def on_shift_end(self, identity: bytes, message: Message) -> None:
        """An engine ran dry (colocated): everything it was granted is sent, and on a GPU its memory
        freed. An end that crossed a new grant is not one: the engine ends its shift again later."""
        worker = self.workers[identity]
        if self.shifts is None:
            raise ValueError("shift_end: placement.mode is split here, and shifts are for colocate")
        if self.state.outstanding(worker):
            self.server.reply(identity, message.id, "ack", {"accepted": 0})
            return
        self._end_shift_of(identity)
        self.server.reply(identity, message.id, "ack", {"accepted": 1})

    def _end_shift_of(self, identity: bytes) -> None:
        """The worker's part of the shift is done; refused (an error it stops on) past the deadline."""
        if self.shifts is None:
            return
        worker = self.workers[identity]
        refusal = self.shifts.refusal(worker)
        if refusal is not None:
            raise ValueError(refusal)
        self.shifts.release(worker)

    def on_snapshot(self, identity: bytes, message: Message) -> None:
        path = os.path.realpath(message.fields["path"])
        if os.path.commonpath([path, self.checkpoints]) != self.checkpoints:
            raise PermissionError(f"a snapshot goes inside this run's checkpoint directory {self.checkpoints}, "
                                  f"not {message.fields['path']}")
        # a learner that checkpoints waits for no batch: one it asked for is not sent, one on its way goes back
        self.batch_waits[:] = [wait for wait in self.batch_waits if wait.identity != identity]
        returned = self.state.return_untrained(message.fields["policy_version"])
        if returned:
            self.log.info("the learner stopped at policy version %d before training the batch it was sent: "
                          "its %d samples wait again", message.fields["policy_version"], returned)
        save_snapshot(self.state, path)
        if self.shifts is not None:  # a checkpoint trains nothing: the learner's shift, if any, is over
            self.shifts.release(self.workers[identity])
        self.server.reply(identity, message.id, "ack", {"accepted": 1})

    def on_finish(self, identity: bytes, message: Message) -> None:
        self.state.finished, self.finished_at = True, time.monotonic()
        # the final records are at the learner's last version (the trackers' step axis for the buffer)
        self.state.learner_version = message.fields["policy_version"]
        self.stopped.add(identity)
        self.log.info("learner finished at policy version %d", message.fields["policy_version"])
        self.server.reply(identity, message.id, "ack", {"accepted": 1})

    # ------------------------------------------------------------------ held requests

    def serve_waiting(self) -> None:
        # the least-loaded scorer is served first (idle ones hold nothing; a tie keeps arrival order)
        self.score_waits.sort(key=lambda wait: self.state.scorer_load[self.workers.get(wait.identity, "scorer")])
        order = ((self.batch_waits, self.answer_batch), (self.credit_waits, self.answer_credits),
                 (self.score_waits, self.answer_score))
        if self.shifts is not None:  # a free shift: scoring what waits, else training, else generating
            order = (order[2], order[0], order[1])
        for waits, answer in order:
            waits[:] = [wait for wait in waits if not answer(wait)]

    def _shift_allows(self, purpose: str) -> bool:
        """Whether work of ``purpose`` may be handed out (always, split). Colocated, generation waits
        for every sample generated to be scored: its shift would take the devices from the scorer."""
        shifts, state = self.shifts, self.state
        if shifts is None or state.finished:
            return True
        if purpose == "generate" and shifts.shift is None and (state.unscored or state.in_scoring):
            return False
        return shifts.may(purpose)

    def _grant(self, purpose: str, wait: Pending) -> None:
        """Colocated, work handed out is its worker's shift; after the last step shifts are over
        (what is still scored or sent then is counted, never trained)."""
        if self.shifts is not None and not self.state.finished:
            self.shifts.grant(purpose, self.workers[wait.identity], time.monotonic())

    def answer_credits(self, wait: Pending) -> bool:
        state = self.state
        if not self._shift_allows("generate"):
            return False
        refusal = self.shifts.refusal(self.workers[wait.identity]) if self.shifts is not None else None
        if refusal is not None:  # an engine past its shift's deadline gets no other: it stops, a new process starts
            self.server.reply(wait.identity, wait.request_id, "error", {"reason": cut(refusal)})
            return True
        engines = self.engines_present(time.monotonic())
        indices = [] if state.finished else state.credits_for(self.workers[wait.identity], wait.policy_version,
                                                              wait.amount, engines)
        newer_weights = state.policy_version > wait.policy_version and state.weights_manifest is not None
        if not indices and not state.finished and not newer_weights:
            return False  # nothing to grant and no weights to give (a resumed learner republishes them)
        self._grant("generate", wait)  # credits, or newer weights alone: loading them is the engine's work too
        self.server.reply(wait.identity, wait.request_id, "credits", {
            "credits": len(indices) * state.samples_per_prompt, "prompt_indices": indices,
            "policy_version": state.policy_version, "weights_manifest": state.weights_manifest,
            "stop": state.finished})
        if state.finished:
            self.stopped.add(wait.identity)
        return True

    def engines_present(self, now: float) -> int:
        """The engines a share of the credits is kept for: each that holds credits, waits for some,
        or was heard within rollout.deadline_s (one that died, idle or taken for dead, keeps none)."""
        waiting = {wait.identity for wait in self.credit_waits}
        return sum(worker.startswith("rollout:") and (identity in waiting or self.state.outstanding(worker) > 0 or
                                                      now - self.last_seen.get(identity, (now, ""))[0]
                                                      <= self.config.rollout.deadline_s)
                   for identity, worker in self.workers.items())

    def answer_score(self, wait: Pending) -> bool:
        if not self._shift_allows("score"):
            return False
        share = min(wait.amount, self.state.fair_share(len(self.score_waits)))
        work = self.state.take_for_scoring(share, self.workers[wait.identity], time.monotonic(),
                                           self.config.scorer.deadline_s, whole_groups=self.whole_groups)
        if not work and not self.state.finished:
            return False
        if work:
            self._grant("score", wait)
        fields, tensors = pack_samples(work)
        self.server.reply(wait.identity, wait.request_id, "score_work", {**fields, "stop": not work}, tensors)
        if not work:
            self.stopped.add(wait.identity)
        return True

    def answer_batch(self, wait: Pending) -> bool:
        if not self._shift_allows("train"):
            return False
        batch = self.state.take_batch(wait.policy_version, wait.amount)
        if batch is None:
            return False
        self._grant("train", wait)
        fields, tensors = pack_samples(batch, scored=True)
        self.server.reply(wait.identity, wait.request_id, "batch", {**fields, "stop": False}, tensors)
        return True

    # ------------------------------------------------------------------ watching

    def stalled_workers(self, now: float) -> list[str]:
        """Workers that owe the buffer something (no request of theirs is held, so they are meant
        to be working) and have been silent longer than buffer.stall_warn_s: named in the log, so
        a stuck role is never a silent hang."""
        held = {wait.identity for waits in (self.credit_waits, self.score_waits, self.batch_waits) for wait in waits}
        stalled = []
        for identity, (seen, kind) in self.last_seen.items():
            if identity in held or identity in self.stopped or identity not in self.workers:
                continue
            silent = now - seen
            if silent > self.config.buffer.stall_warn_s:
                worker = self.workers[identity]
                stalled.append(worker)
                if now - self.warned_at.get(identity, 0.0) > self.config.buffer.stall_warn_s:
                    self.warned_at[identity] = now
                    holding = self.state.scorer_load[worker]
                    self.log.warning("%s silent for %.0fs since its %s%s", worker, silent, kind,
                                     f", holding {holding} samples to score" if holding else "")
        # it holds a request, yet generates nothing until a load succeeds (on_weights_refused says why)
        return stalled + list(self.weight_failures)

    def reclaim_silent_engines(self, now: float) -> None:
        """An engine that holds credits and has sent nothing for rollout.deadline_s is taken for
        dead (a restarted one says hello and is caught at once; one started by hand may never come
        back): its credits and prompts go to the rest of the pool, its late samples are refused."""
        held = {wait.identity for wait in self.credit_waits}
        for identity, worker in self.workers.items():
            if not worker.startswith("rollout:") or identity in held or not self.state.outstanding(worker):
                continue
            silent = now - self.last_seen.get(identity, (now, ""))[0]
            if silent > self.config.rollout.deadline_s:
                reclaimed = self.state.rollout_gone(worker)
                if self.shifts is not None:
                    self.shifts.release(worker)
                self.log.warning("%s holds credits and has been silent for %.0fs (rollout.deadline_s %.0f): "
                                 "taken for dead, %d credits and their prompts go to the pool", worker, silent,
                                 self.config.rollout.deadline_s, reclaimed)

    def release_idle_scorers(self) -> None:
        """Scorers of the score shift that hold no sample leave it: theirs is scored, or was sent to
        another after scorer.deadline_s."""
        shift = self.shifts.shift
        if shift is not None and shift.purpose == "score":
            for worker in [worker for worker in shift.holders if not self.state.scorer_load[worker]]:
                self.shifts.release(worker)

    def end_overdue_shift(self, now: float) -> None:
        """A shift held past placement.shift_deadline_s: named in an error; what its holders held goes
        back to the pool (an engine's credits and prompts, a scorer's samples), and the devices to
        the next shift. An engine's late shift_end and a learner's late weights are refused
        (``Shifts.refusal``), which stops them."""
        overdue = None if self.state.finished else self.shifts.overdue(now)  # after the last step no shift matters
        if overdue is None:
            return
        purpose, holders, held = overdue
        for worker in holders:
            self._return_held(worker)
        last = {self.workers[identity]: kind for identity, (_, kind) in self.last_seen.items()
                if identity in self.workers}
        self.log.error("the %s shift was held for %.0fs by %s, past placement.shift_deadline_s (%gs); last heard: %s. "
                       "What they held goes back to the pool and the devices to the next shift; an engine's late "
                       "shift_end and a learner's late weights are refused", purpose, held,
                       ", ".join(holders) or "nobody", self.config.placement.shift_deadline_s,
                       ", ".join(f"{worker} {last.get(worker, 'nothing')}" for worker in holders) or "-")

    def write_metrics(self, now: float) -> None:
        state = self.state
        self.metrics.write({"step": state.learner_version, "unscored": len(state.unscored),
                            "in_scoring": len(state.in_scoring), "scored_waiting": len(state.scored),
                            "granted": state.granted, "generated": state.accounting.generated,
                            "trained": state.accounting.trained, "credits_returned": state.accounting.credits_returned,
                            "refused_messages": self.server.refused, "busy_s_total": self.busy_s_total,
                            "max_staleness": state.max_staleness,
                            **({"groups_filtered": state.accounting.groups_filtered,
                                "groups_unfiltered": state.accounting.groups_unfiltered}
                               if state.group_filter is not None else {}),
                            **(self.shifts.record(now) if self.shifts is not None else {}),
                            "elapsed_s": now - self.started, "stalled": self.stalled_workers(now)})

    def drain(self, quiet_s: float = 0.3, deadline_s: float = 3.0) -> None:
        """After the run: what is already on its way (a rollout's samples sent before it heard
        "stop") is taken in and counted, until nothing came for ``quiet_s``."""
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            received = self.server.receive(timeout_ms=int(quiet_s * 1000))
            if received is None:
                return
            self.handle(*received)

    def close(self, ended_by: str) -> dict:
        """The end of the buffer, however it came (the learner's finish, a stop signal, an error in
        the loop): the accounting is written even if taking in the last messages fails, so every
        run, a failed one most of all, can be checked against the identity."""
        try:
            if self.state.finished:
                self.drain()
            self.write_metrics(time.monotonic())  # the final state, which the accounting below reports too
        finally:
            report = self.write_accounting(ended_by)
            self.metrics.close()
            self.server.close()
        return report

    def write_accounting(self, ended_by: str) -> dict:
        report = {**self.state.report(), "refused_messages": self.server.refused, **_percentiles_ms(self.handling_s),
                  "ended_by": ended_by}
        path = os.path.join(self.config.run_dir, "metrics", "buffer_accounting.json")
        with new_file(path + ".tmp", "w") as file:  # whole or absent: `tether status` ends when it appears
            json.dump(report, file, indent=2)
        os.replace(path + ".tmp", path)
        self.log.info("accounting: %s", json.dumps(report))
        return report

    def note_stop(self, number: int, frame) -> None:
        self.stop_signal = number


def run(config: TetherConfig) -> dict:
    # The buffer holds many small objects for long; the default collector thresholds scan them
    # all every few thousand allocations, which showed up as 100 ms stalls. Samples form no cycles.
    gc.set_threshold(100_000, 50, 1000)
    buffer = Buffer(config)
    if threading.current_thread() is threading.main_thread():  # a signal handler can only be set there
        for number in STOP_SIGNALS:
            signal.signal(number, buffer.note_stop)
    report = buffer.run()
    if buffer.stop_signal:
        raise BufferStopped(buffer.stop_signal)
    return report
