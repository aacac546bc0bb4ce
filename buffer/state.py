"""The buffer's bookkeeping, free of sockets: admission by credits, dispatch, the staleness rule,
accounting. ``buffer.main`` feeds it requests; tests feed it directly.

The staleness rule (docs/design.md). The learner at policy version ``v`` trains on batch number ``v``
(one batch per step) and may only use samples with ``v - behavior_version <= max_staleness``.
The bound is enforced by admission: a rollout holding weights of version ``u`` may have been
granted at most ``(u + k + 1) * batch_size`` samples in total, so every sample it generates
lands in a batch numbered at most ``u + k`` and is at most ``k`` versions old when trained.
With ``k = 0`` the rollout generates exactly one batch per version: synchronous on-policy PPO.
Batches are still checked as they are served; a stale sample is dropped with a reason and
counted (at steady state there are none).

A bound that changes (``buffer.max_staleness: auto``, ``set_max_staleness``) keeps the rule at
every moment: the batch served for version ``v`` holds no sample older than the bound in force
when it is served. Raising k only lets more be granted. Lowering it leaves samples granted under
the higher bound that may land too late: each is dropped as stale when its batch is taken (its
credit returned), and none is waited for once it can no longer be trained.

Dynamic sampling (DAPO, ``buffer.filter_groups``): a group whose outcome rewards are all equal
carries no advantage for a group estimator, so once it is whole and scored it is dropped
(``group_filtered``) and its credits come back: the rollout is granted more prompts in its place,
within the same bound. At most ``GroupFilter.max_ratio`` x batch_size episodes are filtered between
two batches; past that, groups are kept as they are (``groups_unfiltered``) and the batch goes out.

An episode may come in parts (an agent program that rewrote its context: ``Sample.part_index``).
A credit is one episode, not one sample: only an episode's last part uses and gives back a credit
and counts toward a batch, and its parts are admitted, dropped and trained together. A batch is
``batch_size / samples_per_prompt`` whole groups: ``batch_size`` episodes in ``batch_size`` rows or
more. Each part is at least as new as its episode's first token, so the rule above holds for every
row. The accounting identity counts samples (rows).
"""

from __future__ import annotations

import os
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from common.runlog import new_file
from protocol.samples import Sample, group_is_whole


@dataclass
class Lease:
    """A prompt index an engine holds: samples of it still to come, and the policy version the
    credits were granted at (the version its samples are at least)."""
    left: int
    version: int


@dataclass(frozen=True)
class GroupFilter:
    """Dynamic sampling (``buffer.filter_groups``): the most it may filter between two batches, as a
    share of the batch (``buffer.max_filter_ratio``), and the learner's reading of a score
    (``learner.score_clip``, ``learner.truncation_penalty``), so that the outcomes it compares
    within a group are those the learner's group estimator would."""
    max_ratio: float = 1.0
    score_clip: float | None = None
    truncation_penalty: float = 0.0

    def outcome(self, sample: Sample) -> float:
        """A sample's outcome reward as the learner trains on it: its score, clipped, with the
        truncation penalty of a response cut at the length limit, plus an episode's turn rewards
        (not the KL penalty, which differs between any two responses)."""
        score = float(sample.reward)
        if self.score_clip is not None:
            score = min(max(score, -self.score_clip), self.score_clip)
        if sample.finish_reason == "length":
            score += self.truncation_penalty
        return score + _turn_reward(sample)

    def outcomes(self, group: list[Sample]) -> list[float]:
        """One outcome per episode of ``group``: its last part's, plus the turn rewards of its parts
        before (the score is the last part's: the conversation as it ended)."""
        totals: dict = {}
        for sample in group:
            totals[sample.episode] = totals.get(sample.episode, 0.0) + (
                self.outcome(sample) if sample.final else _turn_reward(sample))
        return list(totals.values())


def _turn_reward(sample: Sample) -> float:
    return float(sample.turn_rewards.sum()) if sample.turn_rewards is not None else 0.0


def _by_episode(samples) -> list[list[Sample]]:
    """``samples`` as their episodes' parts, episodes in the order they first appear."""
    episodes: dict = {}
    for sample in samples:
        episodes.setdefault(sample.episode, []).append(sample)
    return list(episodes.values())


def _oldest_versions(samples) -> Counter:
    """Episodes of ``samples`` per version, each at its oldest part's: the one that goes stale first."""
    return Counter(min(part.behavior_version for part in parts) for parts in _by_episode(samples))


@dataclass
class Accounting:
    generated: int = 0
    scored: int = 0
    trained: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason -> count
    staleness_violations: int = 0
    unexpected_scored: int = 0  # scores for samples not out for scoring: late duplicates, ignored
    redispatched: int = 0  # samples sent to another scorer after a deadline or a scorer restart
    credits_returned: int = 0  # credits given back: a dead engine's unused ones, dropped samples' ones
    staleness_histogram: Counter = field(default_factory=Counter)  # v - behavior_version -> count
    groups_filtered: int = 0  # groups of equal outcome rewards dropped (buffer.filter_groups)
    groups_unfiltered: int = 0  # such groups kept: the batch's filtering bound was reached


class BufferState:
    def __init__(self, batch_size: int, max_staleness: int, samples_per_prompt: int = 1,
                 dedupe_window: int | None = None, staleness_ceiling: int | None = None,
                 group_filter: GroupFilter | None = None) -> None:
        if batch_size % samples_per_prompt:
            raise ValueError(f"batch_size {batch_size} is not a multiple of samples_per_prompt {samples_per_prompt}")
        self.batch_size, self.max_staleness, self.samples_per_prompt = batch_size, max_staleness, samples_per_prompt
        # samples the rollout pool may generate within the bound, in total: every grant adds, every
        # credit that comes back (a dead engine's unused ones, a dropped sample's) subtracts
        self.granted = 0
        # engine -> {prompt_index: Lease}: what each engine holds
        self.leases: dict[str, dict[int, Lease]] = {}
        # version -> samples granted at it (or, once here, generated with it) and not yet scored: a
        # batch waits for those that could not wait for the next one (see take_batch)
        self.owed: Counter = Counter()
        # an episode in parts -> its oldest part's version, while its last part is unscored: what it owes
        self.owed_at: dict = {}
        self.next_prompt_index = 0  # the prompt stream's next fresh position
        self.returned_prompts: list[int] = []  # positions a dead engine never generated; handed out first
        self.policy_version = 0  # newest published policy version (0: the SFT weights on disk)
        self.weights_manifest: dict | None = None  # None: the rollout's own SFT weights
        self.learner_version = 0
        self.unscored: OrderedDict[str, Sample] = OrderedDict()  # FIFO; re-dispatched samples go first
        self.in_scoring: dict[str, tuple[Sample, str, float]] = {}  # id -> (sample, scorer, deadline)
        self.scorer_load: Counter = Counter()  # scorer -> samples it holds
        self.scored: dict[str, Sample] = {}  # insertion order = arrival order
        self.last_batch: tuple[int, list[Sample]] | None = None  # (learner version, samples) last served
        # ids seen, to drop a sample that arrives twice; the oldest are forgotten past the window,
        # so memory stays bounded. A sample of version v came after v*B grants, and W grants later
        # the learner is at least at v + W/B - k - 1: past W = (2k+1)*B a late duplicate is stale
        # and never trained. Twice that, with a floor, is the window (~130 bytes an id).
        self.seen_ids: set[str] = set()
        self.seen_order: deque[str] = deque()
        ceiling = max(max_staleness, staleness_ceiling or 0)  # the highest bound the run may set
        self.dedupe_window = dedupe_window or max(20_000, 4 * (ceiling + 1) * batch_size)
        self.accounting = Accounting()
        self.finished = False
        # dynamic sampling (None: off): the scored samples of groups not yet whole, and the samples
        # filtered since the last batch (at most group_filter.max_ratio x batch_size)
        self.group_filter = group_filter
        self.partial_groups: dict[int, list[Sample]] = {}
        # groups a scorer said not to train (drop_reason): prompt -> the reason, while any of it may come
        self.dropped_groups: dict[int, str] = {}
        self.filtered_since_batch = 0
        self.batches_served = 0  # the filtering bound's window is the time between two of them

    # ------------------------------------------------------------------ rollout side

    def credits_for(self, engine: str, policy_version: int, wanted: int, engines: int = 1) -> list[int]:
        """Prompt indices ``engine``, holding weights of ``policy_version``, may generate now
        (``samples_per_prompt`` samples each), granted at once. The bound counts the grants of
        the whole pool: a sample of version u lands in a batch numbered at most u + k. With
        ``engines`` in the pool an engine holds at most its share of the k + 1 batches the pool may
        hold ungenerated (what it holds unsent counts), and never less than one group: an engine
        that asks again and again (the fast one, or the first to ask) does not take them all while
        the others idle (tests/test_buffer_state.py measures it)."""
        if self.finished:
            return []
        version = min(policy_version, self.policy_version)
        allowed = (version + self.max_staleness + 1) * self.batch_size - self.granted
        # an engine's share of what the pool may hold ungenerated at once, (k + 1) batches, less what it holds
        share = (max(self.samples_per_prompt, -(-(self.max_staleness + 1) * self.batch_size // engines))
                 - self.outstanding(engine)) if engines > 1 else allowed
        prompts = max(0, min(wanted, allowed, share) // self.samples_per_prompt)
        self.returned_prompts.sort()
        returned, self.returned_prompts = self.returned_prompts[:prompts], self.returned_prompts[prompts:]
        fresh = list(range(self.next_prompt_index, self.next_prompt_index + prompts - len(returned)))
        self.next_prompt_index += len(fresh)
        indices = returned + fresh
        lease = self.leases.setdefault(engine, {})
        for index in indices:
            lease[index] = Lease(self.samples_per_prompt, version)
        self.granted += len(indices) * self.samples_per_prompt
        if indices:
            self._owe(version, len(indices) * self.samples_per_prompt)
        return indices

    def set_max_staleness(self, max_staleness: int) -> int:
        """k from now on (the learner's, under ``auto``); returns the one it replaces."""
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        previous, self.max_staleness = self.max_staleness, max_staleness
        return previous

    def outstanding(self, engine: str) -> int:
        """Samples ``engine`` was granted and has not sent."""
        return sum(lease.left for lease in self.leases.get(engine, {}).values())

    def rollout_gone(self, engine: str) -> int:
        """An engine died or restarted: the credits it never used come back, and the prompts it
        generated nothing of go to the next grant (of any engine). Returns the credits."""
        lease = self.leases.pop(engine, {})
        unused = sum(held.left for held in lease.values())
        self.granted -= unused
        for held in lease.values():
            self._owe(held.version, -held.left)
        self.returned_prompts += self._untouched(lease)
        self.accounting.credits_returned += unused
        return unused

    def _untouched(self, lease: dict[int, Lease]) -> list[int]:
        """Prompt indices of ``lease`` none of whose samples came: they can be handed out again (a
        prompt with some of its samples here is not generated again; its missing ones are lost)."""
        return [index for index, held in lease.items() if held.left == self.samples_per_prompt]

    def _owe(self, version: int, count: int) -> None:
        self.owed[version] += count
        if self.owed[version] <= 0:
            del self.owed[version]

    def _drop(self, reason: str, returns_credit: bool) -> None:
        """Count a dropped sample. One that was granted a credit gives it back: otherwise the pool
        would wait forever for samples that will never come (k + 1 batches of drops wedge a run)."""
        self.accounting.dropped[reason] += 1
        if returns_credit:
            self.granted -= 1
            self.accounting.credits_returned += 1

    def add_samples(self, samples: list[Sample], engine: str = "rollout:0") -> int:
        """Unscored samples from ``engine``, judged an episode at a time (its parts come in one
        message). Dropped and counted: a sample id seen before (a resent message: its credit was
        used once), a prompt index the engine does not hold (a stranger, or a restarted engine's old
        process), an episode without its last part, a version never published (from the future) or
        older than the grant's (both give their credit back), or one that came after the learner
        finished. Returns the samples accepted."""
        lease = self.leases.get(engine, {})
        accepted = 0
        for parts in _by_episode(samples):
            self.accounting.generated += len(parts)
            reason, returns_credit = self._refusal(parts, lease)
            if reason is not None:
                for part in parts:
                    self._drop(reason, returns_credit=returns_credit and part is parts[-1])  # once an episode
                continue
            oldest = min(part.behavior_version for part in parts)  # the version it must be trained by + k
            self._owe(oldest, 1)
            if len(parts) > 1:
                self.owed_at[parts[-1].episode] = oldest
            for part in parts:
                self.seen_ids.add(part.sample_id)
                self.seen_order.append(part.sample_id)
                if len(self.seen_order) > self.dedupe_window:
                    self.seen_ids.discard(self.seen_order.popleft())
                self.unscored[part.sample_id] = part
            accepted += len(parts)
        return accepted

    def _refusal(self, parts: list[Sample], lease: dict[int, Lease]) -> tuple[str | None, bool]:
        """Why an episode's ``parts`` (the last one last) are not admitted, and whether its credit
        comes back; (None, False) when they are. An admitted episode uses its credit."""
        if self.finished:  # sent before its engine heard "stop": counted, never trained
            return "after_finish", False
        if any(part.sample_id in self.seen_ids for part in parts):
            return "duplicate_id", False
        held = lease.get(parts[0].prompt_index)
        if held is None:
            return "not_granted", False
        held.left -= 1
        if not held.left:
            del lease[parts[0].prompt_index]
        self._owe(held.version, -1)
        if not parts[-1].final:  # its last part missing (not sent in one message): the credit comes back
            return "episode_incomplete", True
        if max(part.last_behavior_version for part in parts) > self.policy_version:
            return "unpublished_version", True  # from the future
        if min(part.behavior_version for part in parts) < held.version:
            return "older_than_granted", True  # older than the weights the engine said it held
        return None, False

    def drop_episodes(self, prompt_indices: list[int], reasons: list[str], engine: str = "rollout:0") -> int:
        """Episodes ``engine`` generated and could not send, one per entry, with why: each counts as a
        sample generated and dropped for that reason, and a granted one gives its credit back.
        Returns the credits given back."""
        lease = self.leases.get(engine, {})
        returned = 0
        for prompt_index, reason in zip(prompt_indices, reasons):
            self.accounting.generated += 1
            held = lease.get(prompt_index)
            if held is None:
                self._drop("not_granted", returns_credit=False)
                continue
            held.left -= 1
            if not held.left:
                del lease[prompt_index]
            self._owe(held.version, -1)
            self._drop(f"episode_{reason}", returns_credit=True)
            returned += 1
        return returned

    # ------------------------------------------------------------------ scorer side

    def take_for_scoring(self, max_samples: int, scorer: str = "scorer", now: float = 0.0,
                         deadline_s: float = float("inf"), whole_groups: bool = False) -> list[Sample]:
        """Up to ``max_samples`` unscored samples, oldest first, for ``scorer`` to return by
        ``now + deadline_s``. ``whole_groups`` (a pairwise judge compares a group's responses): only
        groups all of whose episodes are here (or all that will come: an engine dropped one), each
        whole, the first even past ``max_samples``."""
        if whole_groups:
            groups: dict[int, list[Sample]] = {}
            for sample in self.unscored.values():
                groups.setdefault(sample.prompt_index, []).append(sample)
            coming = self._leased_prompts()
            chosen: list[Sample] = []
            for index, members in groups.items():
                if index in coming and not group_is_whole(members, self.samples_per_prompt):
                    continue
                if chosen and len(chosen) + len(members) > max_samples:
                    break
                chosen += members
            work = [self.unscored.pop(sample.sample_id) for sample in chosen]
        else:
            work = [self.unscored.popitem(last=False)[1] for _ in range(min(max_samples, len(self.unscored)))]
        for sample in work:
            self.in_scoring[sample.sample_id] = (sample, scorer, now + deadline_s)
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
            if sample.final:
                self._owe(self.owed_at.pop(sample.episode, sample.behavior_version), -1)
            self.accounting.scored += 1
            accepted += 1
            if sample.drop_reason:
                self.dropped_groups.setdefault(sample.prompt_index, sample.drop_reason)
            if sample.prompt_index in self.dropped_groups:
                self._drop_group_of(sample)
            elif self.group_filter is not None:
                self._filter_group_of(sample)
        return accepted

    def _drop_group_of(self, sample: Sample) -> None:
        """A scorer said ``sample``'s group is not to be trained (a reward call failed or a judge's
        answer did not parse, under drop_group): every scored sample of its prompt goes, now and as
        the rest of its group comes, each giving its credit back."""
        prompt_index = sample.prompt_index
        reason = f"scorer_{self.dropped_groups[prompt_index]}"
        self.partial_groups.pop(prompt_index, None)
        for member in [s for s in self.scored.values() if s.prompt_index == prompt_index]:
            del self.scored[member.sample_id]
            self._drop(reason, returns_credit=member.final)
        self._forget_dropped_groups([prompt_index])

    def _leased_prompts(self) -> set[int]:
        """The prompts some engine still owes episodes of."""
        return {index for lease in self.leases.values() for index in lease}

    def _forget_dropped_groups(self, prompt_indices) -> None:
        """Dropped groups of which nothing is still to come (no engine holds their prompt, no sample
        of it waits for a scorer or is out with one: an episode's earlier part may come after its
        last) are forgotten."""
        coming = (self._leased_prompts() | {s.prompt_index for s in self.unscored.values()}
                  | {s.prompt_index for s in self.in_scoring_samples()})
        for index in [i for i in prompt_indices if i in self.dropped_groups and i not in coming]:
            del self.dropped_groups[index]

    def _filter_group_of(self, sample: Sample) -> None:
        """Dynamic sampling: once ``sample``'s group is whole, drop it if its outcome rewards are all
        equal (its credits come back), unless this batch's filtering bound is spent."""
        group = self.partial_groups.setdefault(sample.prompt_index, [])
        group.append(sample)
        if not group_is_whole(group, self.samples_per_prompt):
            return
        del self.partial_groups[sample.prompt_index]
        outcomes = self.group_filter.outcomes(group)
        if max(outcomes) - min(outcomes) > 1e-6:  # the learner's scores are float32
            return
        if self.filtered_since_batch + self.samples_per_prompt > self.group_filter.max_ratio * self.batch_size:
            self.accounting.groups_unfiltered += 1
            return
        for member in group:
            del self.scored[member.sample_id]
            self._drop("group_filtered", returns_credit=member.final)
        self.filtered_since_batch += self.samples_per_prompt
        self.accounting.groups_filtered += 1

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
        """A batch for the learner at ``policy_version``, oldest samples first and whole groups of
        ``samples_per_prompt`` episodes (each with all its parts), or None while fewer than
        ``batch_size`` fresh scored episodes in whole groups are here. Stale samples are dropped
        and counted.

        It also waits while taking the oldest samples here now would leave samples on their way
        (granted, generating, scoring) too late for the batches that remain to them: a sample of
        version g must be trained by batch g + k. With a pool, a slow engine's samples would
        otherwise be overtaken by a fast engine's newer ones and go stale."""
        self.learner_version = policy_version
        if self.dropped_groups:  # one whose last episode an engine dropped: nothing brought it back here
            self._forget_dropped_groups(list(self.dropped_groups))
        stale = {sample.prompt_index for sample in self.scored.values()
                 if policy_version - sample.behavior_version > self.max_staleness}
        for sample_id, sample in list(self.scored.items()):
            if sample.prompt_index in stale:  # its group can no longer be whole: all of it goes
                del self.scored[sample_id]
                self.partial_groups.pop(sample.prompt_index, None)
                if policy_version - sample.behavior_version > self.max_staleness:
                    self._drop("stale", returns_credit=sample.final)
                    self.accounting.staleness_violations += 1
                else:
                    self._drop("group_stale", returns_credit=sample.final)
        if len(self.scored) < batch_size:
            return None
        ordered = self._oldest_whole_groups(batch_size)
        if ordered is None or self._owed_would_be_late(policy_version, batch_size, ordered):
            return None
        for sample in ordered:
            del self.scored[sample.sample_id]
            self.accounting.trained += 1
            self.accounting.staleness_histogram[policy_version - sample.behavior_version] += 1
        self.last_batch = (policy_version, ordered)
        self.filtered_since_batch = 0
        self.batches_served += 1
        return ordered

    def return_untrained(self, learner_version: int) -> int:
        """The learner says it is at ``learner_version`` (a checkpoint): a batch served for that
        version or a later one was not trained (it stopped while the batch was on its way), so its
        samples are scored and waiting again. Returns how many."""
        if self.last_batch is None or self.last_batch[0] < learner_version:
            return 0
        version, batch = self.last_batch
        self.last_batch = None
        for sample in batch:
            self.scored[sample.sample_id] = sample
            self.accounting.trained -= 1
            self.accounting.staleness_histogram[version - sample.behavior_version] -= 1
        self.accounting.staleness_histogram += Counter()  # drops the ages counted 0 now
        return len(batch)

    def _oldest_whole_groups(self, batch_size: int) -> list[Sample] | None:
        """``batch_size`` scored episodes made of whole groups (the ``samples_per_prompt`` episodes
        of one prompt, which group estimators compare with each other, each with all its parts),
        oldest version first, each group's samples next to each other; None while fewer whole groups
        are here. The responses to a prompt are generated together, but scorers may return them apart."""
        groups: dict[int, list[Sample]] = {}
        for sample in self.scored.values():  # arrival order
            groups.setdefault(sample.prompt_index, []).append(sample)
        whole = [group for group in groups.values() if group_is_whole(group, self.samples_per_prompt)]
        if len(whole) * self.samples_per_prompt < batch_size:
            return None
        # stable: arrival order within a version
        whole.sort(key=lambda group: min(sample.behavior_version for sample in group))
        return [sample for group in whole[:batch_size // self.samples_per_prompt] for sample in group]

    def _owed_would_be_late(self, policy_version: int, batch_size: int, batch: list[Sample]) -> bool:
        """Whether, after ``batch``, the samples left (here or on their way) could no longer all
        be trained within the bound, when waiting for one on its way could help (it is older than
        the batch's newest). Earliest deadline first: for every version g, the samples of versions
        <= g must fit in the batches v + 1 .. g + k."""
        if not self.owed or min(self.owed) >= max(sample.behavior_version for sample in batch):
            return False
        # in episodes, as batches count them, each at its oldest part's version
        left = Counter(self.owed) + _oldest_versions(self.scored.values())
        left.subtract(_oldest_versions(batch))
        count = 0
        for version in sorted(left):
            if version + self.max_staleness < policy_version:
                continue  # too old even for this batch (a lowered bound): dropped when it comes, not waited for
            count += left[version]
            if count > max(0, version + self.max_staleness - policy_version) * batch_size:
                return True
        return False

    def publish_weights(self, version: int, manifest: dict | None) -> None:
        # the same version again is a resumed learner giving the weights of its checkpoint
        republish = version == self.policy_version and self.weights_manifest is None and version > 0
        if version <= self.policy_version and not republish:
            raise ValueError(f"policy version {version} is not newer than {self.policy_version}")
        self.policy_version, self.weights_manifest = version, manifest

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
            "credits_returned": a.credits_returned,
            "prompts_handed_out": self.next_prompt_index,
            "owed": sum(self.owed.values()),
            "policy_version": self.policy_version,
            "max_staleness": self.max_staleness,
            "groups_filtered": a.groups_filtered,
            "groups_unfiltered": a.groups_unfiltered,
        }


# --------------------------------------------------------------------------- checkpoints


def save_snapshot(state: BufferState, path: str) -> None:
    """Everything the buffer holds, for a checkpoint: samples not yet trained (those out for
    scoring go back to unscored: their scorer will not answer a resumed run), the accounting, the
    ids seen, and the prompt stream as if every engine had just died (rollouts start afresh on
    resume): credits they held are not counted, prompts they held go to the first grants."""
    import msgpack

    from protocol.codec import encode
    from protocol.samples import pack_samples

    unscored = list(state.in_scoring_samples()) + list(state.unscored.values())
    scored = list(state.scored.values())
    held = [index for lease in state.leases.values() for index in state._untouched(lease)]
    a = state.accounting
    header = {
        "granted": state.granted - sum(state.outstanding(engine) for engine in state.leases),
        "next_prompt_index": state.next_prompt_index,
        "returned_prompts": sorted(state.returned_prompts + held),
        "policy_version": state.policy_version, "learner_version": state.learner_version,
        "accounting": {**{name: getattr(a, name) for name in _COUNTS},
                       "dropped": dict(a.dropped),
                       "staleness_histogram": {str(k): v for k, v in a.staleness_histogram.items()}},
        "seen": list(state.seen_order),
        "filtered_since_batch": state.filtered_since_batch,
        # msgpack keys are text: the prompt indices of groups a scorer dropped
        "dropped_groups": {str(index): reason for index, reason in state.dropped_groups.items()},
    }
    messages = [encode("samples", *pack_samples(unscored)), encode("scored", *pack_samples(scored, scored=True))]
    temporary = path + ".tmp"
    with new_file(temporary) as file:  # a link at .tmp (to a file outside the run) is replaced, never followed
        msgpack.pack({"header": header, "messages": [[bytes(frame) for frame in frames] for frames in messages]}, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


_COUNTS = ("generated", "scored", "trained", "staleness_violations", "unexpected_scored", "redispatched",
           "credits_returned", "groups_filtered", "groups_unfiltered")


def load_snapshot(path: str, batch_size: int, max_staleness: int, samples_per_prompt: int = 1,
                  staleness_ceiling: int | None = None, group_filter: GroupFilter | None = None) -> BufferState:
    import msgpack

    from protocol.codec import ProtocolError, decode
    from protocol.samples import unpack_samples

    with open(path, "rb") as file:
        data = msgpack.unpack(file, raw=False)
    header = data["header"]
    if "next_prompt_index" not in header:
        raise ValueError(f"{path} was written by an earlier tether (its buffer does not own the prompt stream); "
                         "this version cannot resume it: start the run again")
    state = BufferState(batch_size, max_staleness, samples_per_prompt, staleness_ceiling=staleness_ceiling,
                        group_filter=group_filter)
    try:
        unscored, scored = (unpack_samples(decode(frames)) for frames in data["messages"])
    except ProtocolError as error:
        raise ValueError(f"{path} holds samples this tether cannot read ({error}); start the run again") from None
    oldest = {parts[0].episode: min(part.behavior_version for part in parts)
              for parts in _by_episode(unscored + scored)}
    for sample in unscored:
        state.unscored[sample.sample_id] = sample
        if sample.final:
            state._owe(oldest[sample.episode], 1)
            if sample.episode_parts and sample.episode_parts > 1:
                state.owed_at[sample.episode] = oldest[sample.episode]
    for sample in scored:
        state.scored[sample.sample_id] = sample
    if group_filter is not None:  # whole groups were judged before the snapshot; the rest wait for theirs
        groups: dict[int, list[Sample]] = {}
        for sample in scored:
            groups.setdefault(sample.prompt_index, []).append(sample)
        state.partial_groups = {index: group for index, group in groups.items()
                                if not group_is_whole(group, samples_per_prompt)}
    state.granted, state.policy_version = header["granted"], header["policy_version"]
    state.next_prompt_index, state.returned_prompts = header["next_prompt_index"], list(header["returned_prompts"])
    state.learner_version = header["learner_version"]
    state.filtered_since_batch = header.get("filtered_since_batch", 0)
    state.dropped_groups = {int(index): reason for index, reason in header.get("dropped_groups", {}).items()}
    saved = header["accounting"]
    a = state.accounting
    for name in _COUNTS:
        setattr(a, name, saved.get(name, 0))
    a.dropped.update(saved["dropped"])
    a.staleness_histogram.update({int(k): v for k, v in saved["staleness_histogram"].items()})
    for sample_id in header["seen"]:
        state.seen_ids.add(sample_id)
        state.seen_order.append(sample_id)
    return state
