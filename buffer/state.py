"""The buffer's bookkeeping, free of sockets: admission by credits, dispatch, the staleness rule,
accounting. ``buffer.main`` feeds it requests; tests feed it directly.

The staleness rule (DESIGN.md). The learner at policy version ``v`` trains on batch number ``v``
(one batch per step) and may only use samples with ``v - behavior_version <= max_staleness``.
The bound is enforced by admission: a rollout holding weights of version ``u`` may have been
granted at most ``(u + k + 1) * batch_size`` samples in total, so every sample it generates
lands in a batch numbered at most ``u + k`` and is at most ``k`` versions old when trained.
With ``k = 0`` the rollout generates exactly one batch per version: synchronous on-policy PPO.
Batches are still checked as they are served; a stale sample is dropped with a reason and
counted (at steady state there are none).
"""

from __future__ import annotations

import os
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from protocol.samples import Sample


@dataclass
class Accounting:
    generated: int = 0
    scored: int = 0
    trained: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason -> count
    staleness_violations: int = 0
    unexpected_scored: int = 0  # scores for samples not out for scoring: late duplicates, ignored
    redispatched: int = 0  # samples sent to another scorer after a deadline or a scorer restart
    staleness_histogram: Counter = field(default_factory=Counter)  # v - behavior_version -> count


class BufferState:
    def __init__(self, batch_size: int, max_staleness: int, dedupe_window: int | None = None) -> None:
        self.batch_size, self.max_staleness = batch_size, max_staleness
        self.granted = 0  # samples the rollout has been allowed to generate, in total
        self.outstanding: Counter = Counter()  # rollout -> credits granted, samples not yet received
        self.weights_version = 0  # newest published policy version (0: the SFT weights on disk)
        self.weights_manifest: dict | None = None  # None: the rollout's own SFT weights
        self.learner_version = 0
        self.data_position = 0  # prompts the rollout has taken, as it last said
        self.unscored: OrderedDict[str, Sample] = OrderedDict()  # FIFO; re-dispatched samples go first
        self.in_scoring: dict[str, tuple[Sample, str, float]] = {}  # id -> (sample, scorer, deadline)
        self.scorer_load: Counter = Counter()  # scorer -> samples it holds
        self.scored: dict[str, Sample] = {}  # insertion order = arrival order
        # ids seen, to drop a sample that arrives twice; the oldest are forgotten past the window,
        # so memory stays bounded. A sample of version v came after v*B grants, and W grants later
        # the learner is at least at v + W/B - k - 1: past W = (2k+1)*B a late duplicate is stale
        # and never trained. Twice that, with a floor, is the window (~130 bytes an id).
        self.seen_ids: set[str] = set()
        self.seen_order: deque[str] = deque()
        self.dedupe_window = dedupe_window or max(20_000, 4 * (max_staleness + 1) * batch_size)
        self.accounting = Accounting()
        self.finished = False

    # ------------------------------------------------------------------ rollout side

    def credits_for(self, rollout_version: int, wanted: int, rollout: str = "rollout") -> int:
        """Samples a rollout holding ``rollout_version`` weights may generate now (granted at once)."""
        if self.finished:
            return 0
        version = min(rollout_version, self.weights_version)
        allowed_total = (version + self.max_staleness + 1) * self.batch_size
        credits = max(0, min(wanted, allowed_total - self.granted))
        self.granted += credits
        self.outstanding[rollout] += credits
        return credits

    def rollout_gone(self, rollout: str) -> int:
        """A rollout died or restarted: credits it was granted and never used go back to the pool,
        or the bound would count samples that will never come. Returns how many."""
        unused = max(0, self.outstanding.pop(rollout, 0))
        self.granted -= unused
        return unused

    def add_samples(self, samples: list[Sample], rollout: str = "rollout") -> int:
        """Unscored samples from the rollout; a sample id seen before is dropped as a duplicate."""
        self.outstanding[rollout] -= len(samples)
        accepted = 0
        for sample in samples:
            self.accounting.generated += 1
            if sample.sample_id in self.seen_ids:
                self.accounting.dropped["duplicate_id"] += 1
                continue
            self.seen_ids.add(sample.sample_id)
            self.seen_order.append(sample.sample_id)
            if len(self.seen_order) > self.dedupe_window:
                self.seen_ids.discard(self.seen_order.popleft())
            self.unscored[sample.sample_id] = sample
            accepted += 1
        return accepted

    # ------------------------------------------------------------------ scorer side

    def take_for_scoring(self, max_samples: int, scorer: str = "scorer", now: float = 0.0,
                         deadline_s: float = float("inf")) -> list[Sample]:
        """Up to ``max_samples`` unscored samples, oldest first, for ``scorer`` to return by
        ``now + deadline_s``."""
        work = []
        while self.unscored and len(work) < max_samples:
            _, sample = self.unscored.popitem(last=False)
            self.in_scoring[sample.sample_id] = (sample, scorer, now + deadline_s)
            work.append(sample)
        self.scorer_load[scorer] += len(work)
        return work

    def in_scoring_samples(self):
        return (sample for sample, _, _ in self.in_scoring.values())

    def fair_share(self, waiting_scorers: int) -> int:
        """How many samples one of ``waiting_scorers`` idle scorers gets now, so that the pool
        shares the work rather than the first to ask taking it all."""
        return -(-len(self.unscored) // max(1, waiting_scorers))

    def add_scored(self, samples: list[Sample]) -> int:
        """Scored samples back from a scorer. A sample is taken once: while it is out for scoring,
        or waiting to be sent again after its deadline passed; any later score for it is ignored,
        so a sample is scored (and trained) at most once."""
        accepted = 0
        for sample in samples:
            dispatched = self.in_scoring.pop(sample.sample_id, None)
            if dispatched is not None:
                self.scorer_load[dispatched[1]] -= 1
            elif self.unscored.pop(sample.sample_id, None) is None:
                self.accounting.unexpected_scored += 1
                continue
            self.scored[sample.sample_id] = sample
            self.accounting.scored += 1
            accepted += 1
        return accepted

    def redispatch(self, now: float | None = None, scorer: str | None = None) -> int:
        """Put back, at the front of the queue, the samples whose deadline passed (``now``) or that
        a scorer held when it restarted or died (``scorer``). Returns how many."""
        expired = [sample_id for sample_id, (_, holder, deadline) in self.in_scoring.items()
                   if (now is not None and deadline <= now) or holder == scorer]
        for sample_id in reversed(expired):
            sample, holder, _ = self.in_scoring.pop(sample_id)
            self.scorer_load[holder] -= 1
            self.unscored[sample_id] = sample
            self.unscored.move_to_end(sample_id, last=False)
        self.accounting.redispatched += len(expired)
        return len(expired)

    # ------------------------------------------------------------------ learner side

    def take_batch(self, policy_version: int, batch_size: int) -> list[Sample] | None:
        """A batch for the learner at ``policy_version``, oldest samples first, or None while fewer
        than ``batch_size`` fresh scored samples are here. Stale samples are dropped and counted."""
        self.learner_version = policy_version
        for sample_id, sample in list(self.scored.items()):
            if policy_version - sample.behavior_version > self.max_staleness:
                del self.scored[sample_id]
                self.accounting.dropped["stale"] += 1
                self.accounting.staleness_violations += 1
        if len(self.scored) < batch_size:
            return None
        ordered = sorted(self.scored.values(), key=lambda s: s.behavior_version)[:batch_size]
        for sample in ordered:
            del self.scored[sample.sample_id]
            self.accounting.trained += 1
            self.accounting.staleness_histogram[policy_version - sample.behavior_version] += 1
        return ordered

    def publish_weights(self, version: int, manifest: dict | None) -> None:
        # the same version again is a resumed learner giving the weights of its checkpoint
        republish = version == self.weights_version and self.weights_manifest is None and version > 0
        if version <= self.weights_version and not republish:
            raise ValueError(f"weights version {version} is not newer than {self.weights_version}")
        self.weights_version, self.weights_manifest = version, manifest

    # ------------------------------------------------------------------ accounting

    @property
    def in_flight(self) -> int:
        return len(self.unscored) + len(self.in_scoring) + len(self.scored)

    def report(self) -> dict:
        a = self.accounting
        dropped_total = sum(a.dropped.values())
        return {
            "generated": a.generated,
            "scored": a.scored,
            "trained": a.trained,
            "dropped": dict(a.dropped),
            "in_flight": self.in_flight,
            "identity_holds": a.generated == a.trained + dropped_total + self.in_flight,
            "staleness_violations": a.staleness_violations,
            "unexpected_scored": a.unexpected_scored,
            "redispatched": a.redispatched,
            "staleness_histogram": {str(k): v for k, v in sorted(a.staleness_histogram.items())},
            "granted": self.granted,
            "weights_version": self.weights_version,
        }


# --------------------------------------------------------------------------- checkpoints


def save_snapshot(state: BufferState, path: str) -> None:
    """Everything the buffer holds, for a checkpoint: samples not yet trained (those out for
    scoring go back to unscored: their scorer will not answer a resumed run), the accounting, the
    credits granted minus those no rollout used (rollouts start afresh on resume) and the ids seen."""
    import msgpack

    from protocol.codec import encode
    from protocol.samples import pack_samples

    unscored = list(state.in_scoring_samples()) + list(state.unscored.values())
    scored = list(state.scored.values())
    a = state.accounting
    header = {
        "granted": state.granted - sum(max(0, n) for n in state.outstanding.values()),
        "weights_version": state.weights_version, "learner_version": state.learner_version,
        "data_position": state.data_position,
        "accounting": {"generated": a.generated, "scored": a.scored, "trained": a.trained,
                       "dropped": dict(a.dropped), "staleness_violations": a.staleness_violations,
                       "unexpected_scored": a.unexpected_scored, "redispatched": a.redispatched,
                       "staleness_histogram": {str(k): v for k, v in a.staleness_histogram.items()}},
        "seen": list(state.seen_order),
    }
    messages = [encode("samples", *pack_samples(unscored)), encode("scored", *pack_samples(scored, scored=True))]
    temporary = path + ".tmp"
    with open(temporary, "wb") as file:
        msgpack.pack({"header": header, "messages": [[bytes(frame) for frame in frames] for frames in messages]}, file)
    os.replace(temporary, path)


def load_snapshot(path: str, batch_size: int, max_staleness: int) -> BufferState:
    import msgpack

    from protocol.codec import decode
    from protocol.samples import unpack_samples

    with open(path, "rb") as file:
        data = msgpack.unpack(file, raw=False)
    header = data["header"]
    state = BufferState(batch_size, max_staleness)
    unscored, scored = (unpack_samples(decode(frames)) for frames in data["messages"])
    for sample in unscored:
        state.unscored[sample.sample_id] = sample
    for sample in scored:
        state.scored[sample.sample_id] = sample
    state.granted, state.weights_version = header["granted"], header["weights_version"]
    state.learner_version, state.data_position = header["learner_version"], header["data_position"]
    saved = header["accounting"]
    a = state.accounting
    a.generated, a.scored, a.trained = saved["generated"], saved["scored"], saved["trained"]
    a.dropped.update(saved["dropped"])
    a.staleness_violations, a.unexpected_scored = saved["staleness_violations"], saved["unexpected_scored"]
    a.redispatched = saved["redispatched"]
    a.staleness_histogram.update({int(k): v for k, v in saved["staleness_histogram"].items()})
    for sample_id in header["seen"]:
        state.seen_ids.add(sample_id)
        state.seen_order.append(sample_id)
    return state
