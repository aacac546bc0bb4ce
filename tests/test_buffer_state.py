"""The staleness rule and the accounting, read from the buffer's bookkeeping alone.

Versions: the learner at policy version v trains batch number v. Samples carry the version of
the weights that generated them. max_staleness k: batch v may only hold samples of version
>= v - k, and the buffer enforces that by how many samples it lets the rollout generate.
"""

from itertools import groupby

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from buffer.state import BufferState, GroupFilter
from protocol.samples import group_is_whole
from tests.helpers import sample_of


def sample(sample_id, version, prompt_index=0):
    """A scored sample of ``version`` for prompt ``prompt_index``: what the staleness rule reads."""
    return sample_of([1, 2], [1, 2], str(sample_id), prompt_index, version, reward=0.0)


def generate(state, count, version, start=0, engine="rollout:0"):
    """Ask for ``count`` credits as ``engine`` holding ``version`` and send a sample for each
    prompt index granted; returns how many were granted."""
    indices = state.credits_for(engine, version, count)
    state.add_samples([sample(start + i, version, index) for i, index in enumerate(indices)], engine)
    return len(indices)


def train_checked(state, learner_version, batch_size, max_staleness, trained: set, key=lambda s: s.sample_id) -> int:
    """The learner takes a batch if one is ready and publishes the next version; every sample in
    it is within the bound and trained for the first time (by ``key``). Returns the version."""
    batch = state.take_batch(learner_version, batch_size)
    if batch is None:
        return learner_version
    for s in batch:
        assert learner_version - s.behavior_version <= max_staleness
        assert key(s) not in trained
        trained.add(key(s))
    state.publish_weights(learner_version + 1, None)
    return learner_version + 1


def score_all(state):
    state.add_scored(state.take_for_scoring(10**6))


def test_max_staleness_zero_is_synchronous_on_policy():
    state = BufferState(batch_size=4, max_staleness=0)
    assert len(state.credits_for("rollout:0", 0, wanted=100)) == 4  # exactly one batch for version 0
    assert state.credits_for("rollout:0", 0, wanted=100) == []  # nothing more until new weights
    state.add_samples([sample(i, 0, i) for i in range(4)], "rollout:0")
    score_all(state)
    batch = state.take_batch(policy_version=0, batch_size=4)
    assert [s.behavior_version for s in batch] == [0, 0, 0, 0]
    state.publish_weights(1, None)
    assert state.credits_for("rollout:0", 0, wanted=100) == []  # stale weights earn nothing
    assert len(state.credits_for("rollout:0", 1, wanted=100)) == 4


def test_max_staleness_one_lets_the_rollout_run_one_batch_ahead():
    state = BufferState(batch_size=4, max_staleness=1)
    assert len(state.credits_for("rollout:0", 0, wanted=3)) == 3
    assert len(state.credits_for("rollout:0", 0, wanted=100)) == 5  # (0 + 1 + 1) * 4 - 3
    assert state.credits_for("rollout:0", 0, wanted=100) == []
    state.publish_weights(1, None)
    assert len(state.credits_for("rollout:0", 1, wanted=100)) == 4


def test_the_rollout_cannot_claim_weights_newer_than_published():
    state = BufferState(batch_size=4, max_staleness=0)
    assert len(state.credits_for("rollout:0", 5, wanted=100)) == 4


def test_batches_are_served_oldest_first_and_stale_samples_are_dropped_with_a_reason():
    state = BufferState(batch_size=2, max_staleness=1)
    assert state.credits_for("rollout:0", 0, 1) == [0]
    state.publish_weights(1, None)
    assert state.credits_for("rollout:0", 1, 1) == [1]
    state.publish_weights(2, None)
    assert state.credits_for("rollout:0", 2, 2) == [2, 3]
    state.add_samples([sample(0, 0, 0), sample(10, 2, 2), sample(11, 2, 3), sample(20, 1, 1)], "rollout:0")
    score_all(state)
    # learner at version 2: the version-0 sample is 2 versions old, over the bound of 1
    batch = state.take_batch(policy_version=2, batch_size=2)
    assert [s.behavior_version for s in batch] == [1, 2]
    report = state.report()
    assert report["dropped"] == {"stale": 1} and report["staleness_violations"] == 1
    assert report["staleness_histogram"] == {"0": 1, "1": 1}
    assert report["identity_holds"] and report["in_flight"] == 1
    assert state.granted == 3 and report["credits_returned"] == 1  # the dropped sample's credit came back


def test_no_batch_until_enough_scored_samples():
    state = BufferState(batch_size=3, max_staleness=1)
    generate(state, 3, version=0)
    assert state.take_batch(0, 3) is None  # generated but not scored yet
    work = state.take_for_scoring(2)
    state.add_scored(work)
    assert state.take_batch(0, 3) is None
    score_all(state)
    assert len(state.take_batch(0, 3)) == 3


def test_a_sample_is_accepted_once_scored_once_and_trained_once():
    state = BufferState(batch_size=1, max_staleness=0)
    (index,) = state.credits_for("rollout:0", 0, 1)
    state.add_samples([sample(7, 0, index)], "rollout:0")
    state.add_samples([sample(7, 0, index)], "rollout:0")  # the same message again
    work = state.take_for_scoring(10)
    assert len(work) == 1
    assert state.add_scored(work) == 1
    assert state.add_scored(work) == 0  # a second answer for the same sample is ignored
    assert len(state.take_batch(0, 1)) == 1
    report = state.report()
    assert report["generated"] == 2 and report["trained"] == 1 and report["dropped"] == {"duplicate_id": 1}
    assert report["unexpected_scored"] == 1 and report["identity_holds"]
    assert state.granted == 1  # a duplicate used no credit of its own: nothing to give back


def test_samples_nobody_was_granted_or_from_an_unpublished_version_are_refused():
    state = BufferState(batch_size=4, max_staleness=1)
    indices = state.credits_for("rollout:0", 0, 2)
    assert state.add_samples([sample("x", 0, 999)], "rollout:0") == 0  # a prompt index it was not given
    assert state.add_samples([sample("y", 0, indices[0])], "rollout:1") == 0  # another engine's index
    assert state.add_samples([sample("z", 3, indices[0])], "rollout:0") == 0  # version 3 was never published
    assert state.report()["dropped"] == {"not_granted": 2, "unpublished_version": 1}
    assert state.granted == 1  # the sample from the future used its credit: it comes back
    assert state.add_samples([sample("w", 0, indices[1])], "rollout:0") == 1
    assert state.report()["identity_holds"]


@settings(max_examples=200, deadline=None)
@given(
    batch_size=st.integers(1, 6),
    max_staleness=st.integers(0, 3),
    actions=st.lists(st.sampled_from(["generate", "score", "train", "sync"]), min_size=1, max_size=120),
    chunk=st.integers(1, 8),
)
def test_staleness_bound_and_accounting_hold_under_any_interleaving(batch_size, max_staleness, actions, chunk):
    """A rollout that asks for credits and generates, a scorer that scores in chunks, a learner that
    trains whenever a batch is ready and publishes, a rollout that loads new weights late: in any
    order, no sample is trained more than k versions old, none twice, and every sample is
    accounted for."""
    state = BufferState(batch_size, max_staleness)
    rollout_version, learner_version, next_id = 0, 0, 0
    trained_ids = set()
    for action in actions:
        if action == "generate":
            next_id += generate(state, chunk, rollout_version, start=next_id)
        elif action == "score":
            state.add_scored(state.take_for_scoring(chunk))
        elif action == "train":
            learner_version = train_checked(state, learner_version, batch_size, max_staleness, trained_ids)
        elif action == "sync":
            rollout_version = state.policy_version
        report = state.report()
        assert report["identity_holds"], report
        # admission keeps the rollout within the bound: nothing is ever dropped as stale
        assert report["staleness_violations"] == 0, report
        assert state.granted <= (state.policy_version + max_staleness + 1) * batch_size


# --------------------------------------------------------------------------- the scorer pool


def test_samples_past_their_deadline_go_to_another_scorer_and_are_scored_once():
    state = BufferState(batch_size=4, max_staleness=0)
    generate(state, 4, version=0)
    slow = state.take_for_scoring(2, scorer="scorer:0", now=0.0, deadline_s=10.0)
    fast = state.take_for_scoring(2, scorer="scorer:1", now=0.0, deadline_s=10.0)
    assert state.redispatch(now=5.0) == 0
    state.add_scored(fast)
    assert state.redispatch(now=10.0) == 2  # scorer:0 missed its deadline
    again = state.take_for_scoring(8, scorer="scorer:1", now=10.0, deadline_s=10.0)
    assert [s.sample_id for s in again] == [s.sample_id for s in slow]  # sent again, first in line
    assert state.add_scored(again) == 2
    assert state.add_scored(slow) == 0  # the slow scorer's late answer is ignored
    batch = state.take_batch(0, 4)
    assert sorted(s.sample_id for s in batch) == ["0", "1", "2", "3"]
    report = state.report()
    assert report["redispatched"] == 2 and report["unexpected_scored"] == 2 and report["identity_holds"]


def test_a_late_answer_before_the_second_dispatch_is_taken_once():
    state = BufferState(batch_size=2, max_staleness=0)
    generate(state, 2, version=0)
    work = state.take_for_scoring(2, scorer="scorer:0", now=0.0, deadline_s=1.0)
    state.redispatch(now=2.0)
    assert state.add_scored(work) == 2  # waiting to be sent again: the answer still counts
    assert state.take_for_scoring(8, scorer="scorer:1") == []
    assert len(state.take_batch(0, 2)) == 2


def test_a_restarted_scorer_loses_what_it_held_and_the_load_is_shared():
    state = BufferState(batch_size=8, max_staleness=0)
    generate(state, 6, version=0)
    assert state.fair_share(waiting_scorers=2) == 3
    held = state.take_for_scoring(state.fair_share(2), scorer="scorer:0")
    state.take_for_scoring(state.fair_share(1), scorer="scorer:1")
    assert state.scorer_load == {"scorer:0": 3, "scorer:1": 3}
    assert state.redispatch(scorer="scorer:0") == 3
    assert state.scorer_load["scorer:0"] == 0
    assert [s.sample_id for s in state.take_for_scoring(8, scorer="scorer:1")] == [s.sample_id for s in held]


@settings(max_examples=200, deadline=None)
@given(
    actions=st.lists(st.sampled_from(["generate", "dispatch", "return", "lose", "tick", "train"]), max_size=150),
    max_staleness=st.integers(0, 2),
)
def test_with_scorers_that_die_or_lag_every_sample_is_trained_at_most_once(actions, max_staleness):
    """Scorers take work, some answers come late or never; deadlines send work again. Whatever
    happens, no sample is trained twice and generated = trained + dropped + in flight."""
    batch_size = 3
    state = BufferState(batch_size, max_staleness)
    now, next_id, learner_version = 0.0, 0, 0
    out: list[list] = []  # work handed out, not yet answered (answers may come after a re-dispatch)
    trained = set()
    for action in actions:
        if action == "generate":
            next_id += generate(state, 2, state.policy_version, start=next_id)
        elif action == "dispatch":
            out.append(state.take_for_scoring(2, scorer=f"scorer:{len(out) % 2}", now=now, deadline_s=3.0))
        elif action == "return" and out:
            state.add_scored(out.pop(0))
        elif action == "lose" and out:
            out.pop()  # that scorer died: its answer never comes
        elif action == "tick":
            now += 1.0
            state.redispatch(now=now)
        elif action == "train":
            batch = state.take_batch(learner_version, batch_size)
            if batch is not None:
                ids = {s.sample_id for s in batch}
                assert not ids & trained
                trained |= ids
                learner_version += 1
                state.publish_weights(learner_version, None)
        assert state.report()["identity_holds"]


def test_a_restarted_rollout_gets_back_the_credits_its_predecessor_never_used():
    state = BufferState(batch_size=4, max_staleness=0)
    indices = state.credits_for("rollout:0", 0, wanted=4)
    assert indices == [0, 1, 2, 3]
    state.add_samples([sample(0, 0, 0)], "rollout:0")  # then it dies, 3 credits unused
    assert state.credits_for("rollout:0", 0, wanted=4) == []  # without reclaiming: stuck for good
    assert state.rollout_gone("rollout:0") == 3
    # one batch in all, still; the prompts it never generated are handed out again, first
    assert state.credits_for("rollout:1", 0, wanted=4) == [1, 2, 3]
    state.add_samples([sample(10 + i, 0, i) for i in (1, 2, 3)], "rollout:1")
    score_all(state)
    assert len(state.take_batch(0, 4)) == 4 and state.report()["identity_holds"]


# --------------------------------------------------------------------------- the rollout pool


def test_the_pool_shares_one_bound_and_one_prompt_stream():
    state = BufferState(batch_size=4, max_staleness=1)
    first = state.credits_for("rollout:0", 0, wanted=3)
    second = state.credits_for("rollout:1", 0, wanted=8)
    assert first == [0, 1, 2] and second == [3, 4, 5, 6, 7]  # (0 + 1 + 1) * 4 between them
    assert state.credits_for("rollout:1", 0, wanted=8) == []
    assert state.outstanding("rollout:0") == 3 and state.outstanding("rollout:1") == 5


def test_groups_are_granted_whole():
    state = BufferState(batch_size=8, max_staleness=0, samples_per_prompt=4)
    assert state.credits_for("rollout:0", 0, wanted=6) == [0]  # 4 samples of one prompt, not 6
    assert state.credits_for("rollout:1", 0, wanted=8) == [1]
    assert state.granted == 8 and state.outstanding("rollout:0") == 4


def test_a_dropped_sample_gives_its_credit_back_so_the_run_never_wedges():
    """At k = 0 an engine sends a whole batch tagged with a version never published, twice: each
    time the samples are refused and their credits come back, so the honest third try fills the
    batch. Without the credits back the pool would have had nothing left to grant."""
    state = BufferState(batch_size=2, max_staleness=0)
    for attempt in range(2):
        indices = state.credits_for("rollout:0", 0, 2)
        assert len(indices) == 2, f"no credits left at attempt {attempt}"
        state.add_samples([sample(f"bad{attempt}-{i}", 5, index) for i, index in enumerate(indices)], "rollout:0")
    indices = state.credits_for("rollout:0", 0, 2)
    state.add_samples([sample(f"good{i}", 0, index) for i, index in enumerate(indices)], "rollout:0")
    score_all(state)
    assert len(state.take_batch(0, 2)) == 2
    report = state.report()
    assert report["dropped"] == {"unpublished_version": 4} and report["credits_returned"] == 4
    assert report["identity_holds"]


def test_episodes_that_give_no_sample_give_their_credits_back():
    """An engine reports episodes it could not send (an environment failed before the policy's
    first turn): each counts as generated and dropped with its reason, its credit comes back, and
    a report for a prompt the engine does not hold returns nothing. The batch still fills."""
    state = BufferState(batch_size=2, max_staleness=0)
    indices = state.credits_for("rollout:0", 0, 2)
    assert state.drop_episodes([indices[0]], ["env_error"], "rollout:0") == 1
    assert state.drop_episodes([indices[0], 99], ["env_error", "env_error"], "rollout:1") == 0
    state.add_samples([sample("a", 0, indices[1])], "rollout:0")
    more = state.credits_for("rollout:0", 0, 2)
    assert len(more) == 1  # the one credit that came back
    state.add_samples([sample("b", 0, more[0])], "rollout:0")
    score_all(state)
    assert len(state.take_batch(0, 2)) == 2
    report = state.report()
    assert report["dropped"] == {"episode_env_error": 1, "not_granted": 2} and report["credits_returned"] == 1
    assert report["generated"] == 5 and report["identity_holds"]


def test_a_batch_waits_for_a_slow_engine_s_older_samples():
    """k = 1, two engines: A is granted prompts at version 0 and is slow; B runs ahead. Batch 1 is
    the last one A's version-0 samples may join, so it waits for them rather than filling up with
    B's newer ones and leaving A's to go stale."""
    state = BufferState(batch_size=4, max_staleness=1)
    slow = state.credits_for("rollout:A", 0, 2)
    fast = state.credits_for("rollout:B", 0, 6)
    assert slow == [0, 1] and fast == [2, 3, 4, 5, 6, 7]
    state.add_samples([sample(f"b{i}", 0, index) for i, index in enumerate(fast)], "rollout:B")
    score_all(state)
    assert len(state.take_batch(0, 4)) == 4
    state.publish_weights(1, None)
    more = state.credits_for("rollout:B", 1, 4)
    state.add_samples([sample(f"c{i}", 1, index) for i, index in enumerate(more)], "rollout:B")
    score_all(state)
    assert state.take_batch(1, 4) is None  # six scored samples, but A's two version-0 ones are owed
    state.add_samples([sample(f"a{i}", 0, index) for i, index in enumerate(slow)], "rollout:A")
    score_all(state)
    batch = state.take_batch(1, 4)
    assert sorted(s.prompt_index for s in batch) == [0, 1, 6, 7]  # A's and B's last version-0 ones
    report = state.report()
    assert report["staleness_violations"] == 0 and not report["dropped"] and report["identity_holds"]


@pytest.mark.parametrize("samples_per_prompt", [1, 4])
def test_an_engine_that_asks_first_and_often_does_not_starve_the_other(samples_per_prompt):
    """Two engines, k = 1, batches of 8: engine 0 asks for credits three times (its room frees
    fast) for each time engine 1 asks. Each holds at most its share of the two batches the pool may
    hold ungenerated, so engine 1 is granted as many as engine 0 at every version; before, engine 0
    took all 16 and engine 1 idled (0 granted). A group larger than the share is still granted."""
    state = BufferState(batch_size=8, max_staleness=1, samples_per_prompt=samples_per_prompt)
    granted = {"rollout:0": 0, "rollout:1": 0}
    for engine in ["rollout:0"] * 3 + ["rollout:1"]:
        granted[engine] += len(state.credits_for(engine, 0, 16, engines=2)) * samples_per_prompt
    assert granted == {"rollout:0": 8, "rollout:1": 8}
    wide = BufferState(batch_size=8, max_staleness=0, samples_per_prompt=8)  # a share of 4: one group of 8 each
    assert len(wide.credits_for("rollout:0", 0, 8, engines=2)) == 1


class TwoEngines:
    """A pool of two rollout engines driven by hand: each is granted credits at the version it
    holds, and sends its samples one at a time whenever the test says."""

    def __init__(self, state: BufferState, wanted: int) -> None:
        self.state, self.wanted, self.next_id = state, wanted, 0
        self.versions = {"rollout:0": 0, "rollout:1": 0}
        self.granted: dict[str, list[tuple[int, int]]] = {engine: [] for engine in self.versions}

    def grant(self, engine: str) -> None:
        self.granted[engine] += [(index, self.versions[engine]) for index in
                                 self.state.credits_for(engine, self.versions[engine], self.wanted, engines=2)]

    def send(self, engine: str) -> None:
        if self.granted[engine]:
            index, version = self.granted[engine].pop(0)
            self.state.add_samples([sample(self.next_id, version, index)], engine)
            self.next_id += 1

    def sync(self, engine: str) -> None:
        self.versions[engine] = self.state.policy_version

    def act(self, action: str) -> bool:
        """Do ``action`` if it is an engine's ("grant0", "send1", "sync0"...); whether it was."""
        kind, engine = action[:-1], f"rollout:{action[-1]}"
        if kind not in ("grant", "send", "sync"):
            return False
        getattr(self, kind)(engine)
        return True

    def keep_going(self) -> None:
        """Both engines send all they hold, take the newest weights and ask for more."""
        for engine in self.versions:
            while self.granted[engine]:
                self.send(engine)
            self.sync(engine)
            self.grant(engine)


@settings(max_examples=300, deadline=None)
@given(
    actions=st.lists(st.sampled_from(["grant0", "grant1", "send0", "send1", "score", "train", "sync0", "sync1",
                                      "rush0", "rush1"]), max_size=150),
    max_staleness=st.integers(0, 2),
    batch_size=st.integers(1, 5),
    wanted=st.integers(1, 4),
)
# found by hypothesis: batch 1 took a newer sample while two version-0 ones were still on their
# way, leaving them one batch (2) between them
@example(actions=["grant1", "grant1", "rush0", "rush0"], max_staleness=2, batch_size=1, wanted=1)
def test_a_pool_of_engines_never_trains_a_sample_past_the_bound(actions, max_staleness, batch_size, wanted):
    """Two engines, each granted credits and sending the samples whenever it likes (one lagging
    far behind the other), a scorer, a learner training whenever a batch is ready: no sample is
    dropped as stale, none trained past the bound, and once everyone keeps going the run goes on."""
    state = BufferState(batch_size, max_staleness)
    pool, learner_version, trained = TwoEngines(state, wanted), 0, set()
    for action in actions:
        engine = f"rollout:{action[-1]}"
        if pool.act(action):
            pass
        elif action.startswith("rush"):  # this engine runs a whole round while the other one lags
            pool.sync(engine)
            pool.grant(engine)
            while pool.granted[engine]:
                pool.send(engine)
            score_all(state)
            learner_version = train_checked(state, learner_version, batch_size, max_staleness, trained)
        elif action == "score":
            score_all(state)
        elif action == "train":
            learner_version = train_checked(state, learner_version, batch_size, max_staleness, trained)
        report = state.report()
        assert report["staleness_violations"] == 0 and report["identity_holds"], report
    target = learner_version + 3
    for _ in range(100):
        pool.keep_going()
        score_all(state)
        learner_version = train_checked(state, learner_version, batch_size, max_staleness, trained)
    assert learner_version >= target and state.report()["staleness_violations"] == 0


@settings(max_examples=300, deadline=None)
@given(
    actions=st.lists(st.sampled_from(["generate0", "generate1", "resend", "die0", "die1", "dispatch", "return",
                                      "lose", "tick", "sync0", "sync1"]), max_size=120),
    max_staleness=st.integers(0, 2),
    batch_size=st.integers(1, 4),
)
def test_credits_always_come_back_whatever_rollouts_and_scorers_do(actions, max_staleness, batch_size):
    """Two engines that generate, resend a message, die and come back; scorers that answer, lag
    or vanish: then everyone behaves, and the run must reach its last batch. No trained sample is
    older than k, no prompt index trained twice, the accounting identity holds throughout."""
    state = BufferState(batch_size, max_staleness)
    versions = {"rollout:0": 0, "rollout:1": 0}
    sent: list[tuple[str, list]] = []
    out: list[list] = []
    now, next_id, learner_version, trained_prompts = 0.0, 0, 0, set()

    def train() -> None:
        nonlocal learner_version
        learner_version = train_checked(state, learner_version, batch_size, max_staleness, trained_prompts,
                                        key=lambda s: s.prompt_index)

    def generate_as(engine: str) -> None:
        nonlocal next_id
        indices = state.credits_for(engine, versions[engine], 2)
        samples = [sample(next_id + i, versions[engine], index) for i, index in enumerate(indices)]
        next_id += len(samples)
        state.add_samples(samples, engine)
        sent.append((engine, samples))

    for action in actions:
        if action.startswith("generate"):
            generate_as(f"rollout:{action[-1]}")
        elif action == "resend" and sent:
            state.add_samples(*reversed(sent[-1]))
        elif action.startswith("die"):
            state.rollout_gone(f"rollout:{action[-1]}")
        elif action.startswith("sync"):
            versions[f"rollout:{action[-1]}"] = state.policy_version
        elif action == "dispatch":
            out.append(state.take_for_scoring(2, scorer=f"scorer:{len(out) % 2}", now=now, deadline_s=3.0))
        elif action == "return" and out:
            state.add_scored(out.pop(0))
        elif action == "lose" and out:
            out.pop()
        elif action == "tick":
            now += 1.0
            state.redispatch(now=now)
        train()
        assert state.report()["identity_holds"]
    # from here on every role behaves: the run must go on to 5 more batches
    target = learner_version + 5
    for _ in range(200):
        if learner_version >= target:
            break
        for engine in versions:
            versions[engine] = state.policy_version
            generate_as(engine)
        now += 10.0
        state.redispatch(now=now)
        state.add_scored(state.take_for_scoring(100, scorer="scorer:0", now=now, deadline_s=3.0))
        train()
    assert learner_version >= target, state.report()
    assert state.report()["identity_holds"]


def test_the_dedupe_memory_is_bounded():
    state = BufferState(batch_size=20, max_staleness=0, dedupe_window=5)
    state.credits_for("rollout:0", 0, wanted=21)
    state.add_samples([sample(i, 0, i) for i in range(19)], "rollout:0")
    assert len(state.seen_ids) == 5 and len(state.seen_order) == 5
    assert state.add_samples([sample(18, 0, 19)], "rollout:0") == 0  # a recent duplicate is still caught
    assert state.report()["dropped"] == {"duplicate_id": 1}
    # by default the window spans twice the grants after which a late duplicate would be stale
    assert BufferState(batch_size=64, max_staleness=1).dedupe_window == 20_000
    assert BufferState(batch_size=4096, max_staleness=3).dedupe_window == 4 * 4 * 4096


def test_a_snapshot_of_an_older_schema_is_refused_with_the_reason(tmp_path):
    import msgpack

    from buffer.state import load_snapshot, save_snapshot

    state = BufferState(batch_size=2, max_staleness=1)
    state.credits_for("rollout:0", 0, wanted=2)
    state.add_samples([sample(0, 0, 0)], "rollout:0")
    path = str(tmp_path / "buffer.snapshot")
    save_snapshot(state, path)
    with open(path, "rb") as file:
        data = msgpack.unpack(file, raw=False)
    for frames in data["messages"]:  # as a tether of schema 6 wrote them
        envelope = msgpack.unpackb(frames[0], raw=False)
        frames[0] = msgpack.packb({**envelope, "schema": 6}, use_bin_type=True)
    with open(path, "wb") as file:
        msgpack.pack(data, file, use_bin_type=True)
    with pytest.raises(ValueError, match="holds samples this tether cannot read .peer speaks schema version 6"):
        load_snapshot(path, batch_size=2, max_staleness=1)


def test_a_snapshot_restores_samples_credits_prompts_and_accounting(tmp_path):
    from buffer.state import load_snapshot, save_snapshot

    state = BufferState(batch_size=2, max_staleness=1)
    assert state.credits_for("rollout:0", 0, wanted=4) == [0, 1, 2, 3]
    state.add_samples([sample(i, 0, i) for i in range(3)], "rollout:0")  # prompt 3 never generated
    state.add_scored(state.take_for_scoring(1, scorer="scorer:0"))
    state.take_for_scoring(1, scorer="scorer:0")  # out for scoring when the snapshot is taken
    state.add_samples([sample(0, 0, 0)], "rollout:0")  # a duplicate, dropped
    save_snapshot(state, str(tmp_path / "buffer.snapshot"))

    restored = load_snapshot(str(tmp_path / "buffer.snapshot"), batch_size=2, max_staleness=1)
    assert list(restored.scored) == ["0"] and sorted(restored.unscored) == ["1", "2"]  # in scoring -> unscored
    assert restored.granted == 3  # the credit nobody used is given back
    # the resumed pool goes on with the prompt nobody generated, then where the stream was
    assert restored.credits_for("rollout:0", 0, wanted=2) == [3]
    restored.publish_weights(1, None)
    assert restored.credits_for("rollout:0", 1, wanted=2) == [4, 5]
    report = restored.report()
    assert report["generated"] == 4 and report["dropped"] == {"duplicate_id": 1} and report["identity_holds"]
    assert restored.add_samples([sample(2, 0, 4)], "rollout:0") == 0  # the ids seen survive


def test_a_batch_the_learner_was_sent_but_did_not_train_goes_back_with_the_checkpoint(tmp_path):
    """The learner stops (SIGTERM) while batch 1 is on its way: its checkpoint says version 1, so the
    batch served for version 1 waits again, in the live state and in the snapshot; a checkpoint after
    training it (version 2) gives nothing back."""
    from buffer.state import load_snapshot, save_snapshot

    state = BufferState(batch_size=2, max_staleness=1)
    generate(state, 4, 0)
    score_all(state)
    first = state.take_batch(0, 2)
    state.publish_weights(1, None)
    assert state.return_untrained(1) == 0  # batch 0 was trained: the learner is at version 1
    sent = state.take_batch(1, 2)
    assert state.return_untrained(1) == 2 and sorted(state.scored) == sorted(s.sample_id for s in sent)
    report = state.report()
    assert report["trained"] == 2 and report["in_flight"] == 2 and report["identity_holds"]
    assert report["staleness_histogram"] == {"0": 2}  # batch 0's, at age 0; batch 1's ages are undone
    save_snapshot(state, str(tmp_path / "buffer.snapshot"))
    restored = load_snapshot(str(tmp_path / "buffer.snapshot"), batch_size=2, max_staleness=1)
    again = restored.take_batch(1, 2)
    assert [s.sample_id for s in again] == [s.sample_id for s in sent]
    assert {s.sample_id for s in first}.isdisjoint(s.sample_id for s in again)
    assert restored.return_untrained(2) == 0 and restored.report()["trained"] == 4


# --------------------------------------------------------------------------- whole groups


def assert_whole_groups(batch, group_size):
    """Every prompt's episodes, with all their parts, are in the batch, next to each other."""
    runs = [list(run) for _, run in groupby(batch, key=lambda s: s.prompt_index)]
    assert len(runs) == len({s.prompt_index for s in batch}), [s.prompt_index for s in batch]
    assert all(group_is_whole(run, group_size) for run in runs), [s.prompt_index for s in batch]


def scored(work):
    """A scorer's answer: reference logprobs and a score on each sample (one restored from a
    snapshot arrives without the ones this file's samples are made with)."""
    for s in work:
        s.ref_logprobs, s.reward = np.zeros(len(s.response_tokens), np.float32), 0.0
    return work


def generate_groups(state, engine, version, wanted, next_id, split_every=0):
    """An engine generates every response of each prompt it is granted, in one message. With
    ``split_every``, each episode whose first id is a multiple of it comes in two parts (a program
    that rewrote its context); returns how many samples (ids) it made."""
    samples = []
    for index in state.credits_for(engine, version, wanted):
        for episode in range(state.samples_per_prompt):
            parts = 2 if split_every and (next_id + len(samples)) % split_every == 0 else 1
            for part in range(parts):
                samples.append(sample(next_id + len(samples), version, index))
                if split_every:
                    samples[-1].episode_index, samples[-1].part_index, samples[-1].episode_parts = episode, part, parts
    state.add_samples(samples, engine)
    return len(samples)


def take_whole_groups(state, learner_version, batch_size, max_staleness, trained: set) -> set | None:
    """The learner takes a batch if one is ready: whole groups, none older than the bound, no prompt
    trained before (``trained`` gets its prompts). Returns its prompts, or None."""
    batch = state.take_batch(learner_version, batch_size)
    if batch is None:
        return None
    assert_whole_groups(batch, state.samples_per_prompt)
    assert sum(s.final for s in batch) == batch_size  # a batch counts episodes, however many parts they have
    assert all(learner_version - s.behavior_version <= max_staleness for s in batch)
    prompts = {s.prompt_index for s in batch}
    assert not prompts & trained
    trained.update(prompts)
    return prompts


def everyone_behaves(state, versions, next_id, now, train, answer, take, done, rounds=100, split_every=0) -> None:
    """From here on every role behaves, until ``done()``: each engine syncs and generates whole
    groups, every sample is scored (``take`` at a time, answered by ``answer``), the learner trains;
    the accounting identity holds after each round."""
    for _ in range(rounds):
        if done():
            return
        for engine in versions:
            versions[engine] = state.policy_version
            next_id += generate_groups(state, engine, versions[engine], 2 * state.samples_per_prompt, next_id,
                                       split_every)
        now += 10.0
        state.redispatch(now=now)
        while state.unscored:
            state.add_scored(answer(state.take_for_scoring(take, scorer="scorer:0", now=now, deadline_s=3.0)))
        train()
        assert state.report()["identity_holds"], state.report()


def test_a_batch_waits_for_the_rest_of_a_group_a_scorer_still_holds():
    state = BufferState(batch_size=2, max_staleness=1, samples_per_prompt=2)
    generate_groups(state, "rollout:0", 0, 4, 0)  # prompts 0 and 1, two responses each: 0a 0b 1a 1b
    slow = state.take_for_scoring(1, scorer="scorer:1")  # 0a
    state.add_scored(state.take_for_scoring(2, scorer="scorer:0"))  # 0b and 1a are back
    assert state.take_batch(0, 2) is None  # two samples here, of two groups neither of which is whole
    state.add_scored(slow)
    batch = state.take_batch(0, 2)
    assert_whole_groups(batch, 2) and [s.prompt_index for s in batch] == [0, 0]


@settings(max_examples=300, deadline=None)
# two prompts granted at k = 1; one scorer answers its later share first: 0c 1a, then 1b 1c, arrive before 0a 0b
@example(actions=["generate0", "dispatch", "dispatch", "return_newest"], group_size=3, groups_per_batch=1,
         max_staleness=1, split_every=0)
@given(
    actions=st.lists(st.sampled_from(["generate0", "generate1", "dispatch", "return", "return_newest", "lose",
                                      "tick", "snapshot", "sync"]), max_size=100),
    group_size=st.integers(2, 3),
    groups_per_batch=st.integers(1, 3),
    max_staleness=st.integers(0, 2),
    split_every=st.sampled_from([0, 2, 3]),
)
def test_a_batch_always_holds_whole_groups(tmp_path_factory, actions, group_size, groups_per_batch, max_staleness,
                                           split_every):
    """Groups split between scorers, answers lost and sent again after a deadline, the buffer
    restored from a snapshot (a resume), episodes in several parts: every batch is whole groups of
    every part, within the bound, and each prompt is trained once; once everyone behaves the run
    reaches its batches."""
    from buffer.state import load_snapshot, save_snapshot

    batch_size = group_size * groups_per_batch
    state = BufferState(batch_size, max_staleness, samples_per_prompt=group_size)
    versions = {"rollout:0": 0, "rollout:1": 0}
    out: list[list] = []
    now, next_id, learner_version, trained = 0.0, 0, 0, set()
    snapshot = str(tmp_path_factory.mktemp("snap") / "buffer.snapshot")

    def train() -> None:
        nonlocal learner_version
        if take_whole_groups(state, learner_version, batch_size, max_staleness, trained) is not None:
            learner_version += 1
            state.publish_weights(learner_version, None)

    for action in actions:
        if action.startswith("generate"):
            engine = f"rollout:{action[-1]}"
            next_id += generate_groups(state, engine, versions[engine], 2 * group_size, next_id, split_every)
        elif action == "sync":
            versions = {engine: state.policy_version for engine in versions}
        elif action == "dispatch":  # scorers take fewer than a group: groups come back apart
            out.append(state.take_for_scoring(group_size - 1, scorer=f"scorer:{len(out) % 2}", now=now,
                                              deadline_s=3.0))
        elif action == "return" and out:
            state.add_scored(scored(out.pop(0)))
        elif action == "return_newest" and out:  # scorers answer out of order
            state.add_scored(scored(out.pop()))
        elif action == "lose" and out:
            out.pop()
        elif action == "tick":
            now += 1.0
            state.redispatch(now=now)
        elif action == "snapshot":  # the run is resumed: rollouts and scorers start afresh
            save_snapshot(state, snapshot)
            state = load_snapshot(snapshot, batch_size, max_staleness, group_size)
            out, versions = [], {engine: state.policy_version for engine in versions}
        train()
        assert state.report()["identity_holds"]
    target = learner_version + 3
    everyone_behaves(state, versions, next_id, now, train, scored, group_size - 1, lambda: learner_version >= target,
                     split_every=split_every)
    assert learner_version >= target, state.report()


@settings(max_examples=300, deadline=None)
@given(
    actions=st.lists(st.sampled_from(["grant0", "grant1", "send0", "send1", "score", "train", "sync0", "sync1",
                                      "raise", "lower"]), max_size=150),
    bound=st.integers(0, 3),
    batch_size=st.integers(1, 4),
)
def test_a_bound_that_changes_holds_at_every_batch_and_the_run_goes_on(actions, bound, batch_size):
    """buffer.max_staleness auto: the learner raises or lowers k between batches. Every batch holds
    no sample older than the bound in force when it is served; samples granted under a higher
    bound that can no longer be trained are dropped as stale (their credit returned), never
    waited for; the accounting identity holds; and once everyone keeps going, batches keep coming."""
    state = BufferState(batch_size, bound, staleness_ceiling=4)
    pool, learner_version, trained = TwoEngines(state, 2), 0, set()
    for action in actions:
        if pool.act(action):
            pass
        elif action == "raise":
            state.set_max_staleness(min(4, state.max_staleness + 1))
        elif action == "lower":
            state.set_max_staleness(state.max_staleness // 2)
        elif action == "score":
            score_all(state)
        elif action == "train":
            learner_version = train_checked(state, learner_version, batch_size, state.max_staleness, trained)
        assert state.report()["identity_holds"], state.report()
    target = learner_version + 3
    for _ in range(100):
        pool.keep_going()
        score_all(state)
        learner_version = train_checked(state, learner_version, batch_size, state.max_staleness, trained)
    assert learner_version >= target, state.report()
    assert state.report()["identity_holds"]


def test_lowering_the_bound_drops_what_it_makes_too_old_and_waits_for_none_of_it():
    state = BufferState(batch_size=2, max_staleness=2)
    assert generate(state, 6, version=0) == 6  # (0 + 2 + 1) batches of 2 granted at version 0
    score_all(state)
    assert len(state.take_batch(0, 2)) == 2
    state.publish_weights(1, None)
    state.set_max_staleness(0)  # at version 1 the other four (version 0) are now one version too old
    assert state.take_batch(1, 2) is None
    assert state.accounting.dropped["stale"] == 4 and state.granted == 2  # their credits came back
    assert state.credits_for("rollout:0", 1, 10) == [6, 7]  # (1 + 0 + 1) x 2 - 2: one batch, at version 1


# --------------------------------------------------------------------------- dynamic sampling


def scored_by(work, uniform):
    """A scorer's answer where the groups of the prompts ``uniform(prompt_index)`` names all score
    0 (no advantage) and the others score each response by its place in the group."""
    for s in work:
        s.ref_logprobs = np.zeros(len(s.response_tokens), np.float32)
        s.reward = 0.0 if uniform(s.prompt_index) else float(int(s.sample_id) % 2 + 1)
    return work


def test_a_group_of_equal_rewards_is_dropped_its_credits_come_back_and_more_prompts_take_its_place():
    state = BufferState(batch_size=4, max_staleness=0, samples_per_prompt=2, group_filter=GroupFilter())
    generate_groups(state, "rollout:0", 0, 4, 0)  # prompts 0 and 1: the bound's whole batch
    state.add_scored(scored_by(state.take_for_scoring(10), uniform=lambda p: p == 0))
    assert state.take_batch(0, 4) is None  # prompt 0's group is gone: one group is not a batch
    report = state.report()
    assert report["groups_filtered"] == 1 and report["dropped"] == {"group_filtered": 2}
    assert report["identity_holds"] and state.granted == 2  # its two credits came back ...
    assert state.credits_for("rollout:0", 0, 4) == [2]  # ... and prompt 2 is granted in its place
    state.add_samples([sample(4, 0, 2), sample(5, 0, 2)])
    state.add_scored(scored_by(state.take_for_scoring(10), uniform=lambda p: False))
    batch = state.take_batch(0, 4)
    assert sorted({s.prompt_index for s in batch}) == [1, 2] and state.report()["identity_holds"]


def test_filtering_stops_at_its_bound_and_the_batch_goes_out_as_it_is():
    state = BufferState(batch_size=4, max_staleness=1, samples_per_prompt=2, group_filter=GroupFilter(max_ratio=0.5))
    generate_groups(state, "rollout:0", 0, 8, 0)  # four prompts, every group of equal rewards
    state.add_scored(scored_by(state.take_for_scoring(10), uniform=lambda p: True))
    # half a batch may be filtered (one group); the other three are kept as they are
    assert state.report()["groups_filtered"] == 1 and state.report()["groups_unfiltered"] == 3
    assert [s.prompt_index for s in state.take_batch(0, 4)] == [1, 1, 2, 2]
    state.publish_weights(1, None)
    assert state.filtered_since_batch == 0  # a new batch may filter again
    generate_groups(state, "rollout:0", 1, 2, 10)
    state.add_scored(scored_by(state.take_for_scoring(10), uniform=lambda p: True))
    assert state.report()["groups_filtered"] == 2


@settings(max_examples=300, deadline=None)
@given(
    actions=st.lists(st.sampled_from(["generate0", "generate1", "dispatch", "return", "return_newest", "lose",
                                      "tick", "snapshot", "sync0", "sync1", "train"]), max_size=120),
    groups_per_batch=st.integers(1, 3),
    max_staleness=st.integers(0, 2),
    uniform_every=st.integers(1, 3),
    max_filter_ratio=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    split_every=st.sampled_from([0, 2, 3]),
)
def test_dynamic_sampling_never_leaks_a_credit_whatever_engines_and_scorers_do(
        tmp_path_factory, actions, groups_per_batch, max_staleness, uniform_every, max_filter_ratio, split_every):
    """Two engines lagging each other arbitrarily, groups split between scorers, answers lost and
    sent again, a resume from a snapshot, episodes in several parts, and every ``uniform_every``-th
    prompt's group scoring the same: every batch is whole groups within the bound, no prompt
    trained twice, no group of equal rewards trained while filtering had room, the identity
    generated = trained + dropped + in flight holds after every action, every credit is held,
    in flight or trained once (an episode's, not a part's), and once everyone behaves the run
    reaches its batches."""
    from buffer.state import load_snapshot, save_snapshot

    group_size, batch_size = 2, 2 * groups_per_batch
    options = {"group_filter": GroupFilter(max_ratio=max_filter_ratio)}
    state = BufferState(batch_size, max_staleness, group_size, **options)
    versions = {"rollout:0": 0, "rollout:1": 0}
    out: list[list] = []
    now, next_id, learner_version, trained = 0.0, 0, 0, set()
    snapshot = str(tmp_path_factory.mktemp("snap") / "buffer.snapshot")

    def uniform(prompt_index: int) -> bool:
        return prompt_index % uniform_every == 0

    def train() -> None:
        nonlocal learner_version
        if take_whole_groups(state, learner_version, batch_size, max_staleness, trained) is None:
            return
        # a group of equal rewards is trained only when the filter had no room left for it
        assert sum(uniform(p) for p in trained) <= state.accounting.groups_unfiltered, state.report()
        learner_version += 1
        state.publish_weights(learner_version, None)

    def conserved() -> None:
        """Every credit granted is held by an engine, in flight or trained: a filtered group's come
        back (too few and the run wedges, too many and the bound leaks), and none goes stale."""
        report = state.report()
        assert report["identity_holds"] and report["staleness_violations"] == 0, report
        held = sum(state.outstanding(engine) for engine in state.leases)
        waiting = [*state.unscored.values(), *state.in_scoring_samples(), *state.scored.values()]
        assert state.granted == len(trained) * group_size + sum(s.final for s in waiting) + held, report

    for action in actions:
        if action.startswith("generate"):
            engine = f"rollout:{action[-1]}"
            next_id += generate_groups(state, engine, versions[engine], 2 * group_size, next_id, split_every)
        elif action.startswith("sync"):
            versions[f"rollout:{action[-1]}"] = state.policy_version
        elif action == "dispatch":
            out.append(state.take_for_scoring(1, scorer=f"scorer:{len(out) % 2}", now=now, deadline_s=3.0))
        elif action == "return" and out:
            state.add_scored(scored_by(out.pop(0), uniform))
        elif action == "return_newest" and out:
            state.add_scored(scored_by(out.pop(), uniform))
        elif action == "lose" and out:
            out.pop()
        elif action == "tick":
            now += 1.0
            state.redispatch(now=now)
        elif action == "snapshot":
            save_snapshot(state, snapshot)
            state = load_snapshot(snapshot, batch_size, max_staleness, group_size, **options)
            out, versions = [], {engine: state.policy_version for engine in versions}
        elif action == "train":
            train()
        conserved()
    target = learner_version + 3
    everyone_behaves(state, versions, next_id, now, train, lambda work: scored_by(work, uniform), 1,
                     lambda: learner_version >= target, rounds=200, split_every=split_every)
    assert learner_version >= target, state.report()
    conserved()


def test_the_outcome_compared_is_the_score_the_learner_trains_on():
    """Scores the learner clips alike, or a truncation penalty that sets one response apart, decide
    as the learner's group estimator would: clipped alike is no advantage; a penalty is one."""
    rule = GroupFilter(score_clip=1.0, truncation_penalty=-0.5)
    clipped, cut = sample(0, 0), sample(1, 0)
    clipped.reward, cut.reward = 3.0, 1.0
    cut.finish_reason = "length"
    assert rule.outcome(clipped) == 1.0 and rule.outcome(cut) == 0.5
    cut.turn_rewards = np.array([0.25, 0.25], np.float32)  # an episode's turn rewards count too
    assert rule.outcome(cut) == 1.0


def split_episode(first_id, version, prompt_index, episode_index, parts=2):
    """The samples of one episode in ``parts`` parts, ids from ``first_id``."""
    samples = [sample(first_id + part, version, prompt_index) for part in range(parts)]
    for part, s in enumerate(samples):
        s.episode_index, s.part_index, s.episode_parts = episode_index, part, parts
    return samples


def test_an_episode_in_parts_uses_one_credit_and_its_parts_are_kept_dropped_and_trained_together():
    state = BufferState(batch_size=2, max_staleness=0, samples_per_prompt=2)
    assert state.credits_for("rollout:0", 0, 2) == [0]
    # episode 0 rewrote its context once: two samples, one credit
    assert state.add_samples([*split_episode(0, 0, 0, 0), *split_episode(2, 0, 0, 1, parts=1)]) == 3
    assert state.outstanding("rollout:0") == 0 and sum(state.owed.values()) == 2
    score_all(state)
    batch = state.take_batch(0, 2)
    assert [(s.sample_id, s.final) for s in batch] == [("0", False), ("1", True), ("2", True)]
    assert state.report()["trained"] == 3 and state.report()["identity_holds"]

    state.publish_weights(1, None)
    assert state.credits_for("rollout:0", 1, 2) == [1]
    late = split_episode(10, 1, 1, 0)
    late[0].behavior_version = 0  # its first part older than the grant: the whole episode is refused
    assert state.add_samples(late + split_episode(12, 1, 1, 1)) == 2
    assert state.report()["dropped"] == {"older_than_granted": 2} and state.granted == 3  # one credit back
    # a resent message: every part seen before, nothing admitted, no credit used
    assert state.add_samples(split_episode(12, 1, 1, 1)) == 0 and state.report()["dropped"]["duplicate_id"] == 2


def test_a_group_is_filtered_by_its_episodes_outcomes_and_gives_back_a_credit_per_episode():
    state = BufferState(batch_size=4, max_staleness=0, samples_per_prompt=2, group_filter=GroupFilter())
    state.credits_for("rollout:0", 0, 4)
    episodes = [split_episode(0, 0, 0, 0), split_episode(2, 0, 0, 1, parts=1),  # prompt 0
                split_episode(3, 0, 1, 0), split_episode(5, 0, 1, 1)]  # prompt 1
    state.add_samples([s for episode in episodes for s in episode])
    work = state.take_for_scoring(10)
    for s in work:
        s.ref_logprobs, s.reward = np.zeros(2, np.float32), 1.0
    # prompt 0: equal finals, but the first episode earned a turn reward before its rewrite
    work[0].turn_rewards = np.array([0.0, 0.5], np.float32)
    state.add_scored(work)
    report = state.report()
    assert report["groups_filtered"] == 1 and report["dropped"] == {"group_filtered": 4}
    assert state.granted == 2 and state.filtered_since_batch == 2  # credits of two episodes, not four parts
    assert sorted(state.scored) == ["0", "1", "2"] and report["identity_holds"]


def test_a_stale_episode_in_parts_gives_back_one_credit():
    state = BufferState(batch_size=1, max_staleness=1)
    state.credits_for("rollout:0", 0, 2)
    state.add_samples(split_episode(0, 0, 0, 0) + split_episode(2, 0, 1, 0))
    score_all(state)
    state.set_max_staleness(0)  # lowered: version 0 is too old for batch 1
    state.take_batch(0, 1)
    state.publish_weights(1, None)
    assert state.take_batch(1, 1) is None
    assert state.report()["dropped"] == {"stale": 2} and state.granted == 1 and state.report()["identity_holds"]


def test_an_episode_in_parts_is_owed_at_its_oldest_part_and_goes_stale_with_its_group():
    state = BufferState(batch_size=2, max_staleness=1, samples_per_prompt=2)
    assert state.credits_for("rollout:0", 0, 2) == [0]
    state.publish_weights(1, None)  # the weights change while the group is generated
    first, second = split_episode(0, 0, 0, 0)
    second.behavior_version = second.last_behavior_version = 1
    other = split_episode(2, 1, 0, 1, parts=1)
    assert state.add_samples([first, second, *other]) == 3
    assert state.owed == {0: 1, 1: 1}  # the split episode must be trained by its first part's version + k
    score_all(state)
    assert not state.owed and not state.owed_at
    state.publish_weights(2, None)
    assert state.take_batch(2, 2) is None  # its first part is too old now: the whole group goes
    report = state.report()
    assert report["dropped"] == {"stale": 1, "group_stale": 2} and not state.scored
    assert state.granted == 0 and report["identity_holds"]  # a credit back per episode


def test_an_episode_whose_last_part_did_not_come_gives_its_credit_back():
    state = BufferState(batch_size=1, max_staleness=0)
    state.credits_for("rollout:0", 0, 1)
    assert state.add_samples(split_episode(0, 0, 0, 0)[:1]) == 0
    assert state.report()["dropped"] == {"episode_incomplete": 1} and state.granted == 0 and not state.owed


# --------------------------------------------------------------------------- a scorer's drop_group


def test_a_group_a_scorer_drops_goes_whole_as_its_samples_come_its_credits_back_and_the_prompt_is_forgotten():
    """A reward call failed on one episode under scorer.on_reward_failure: drop_group: that episode
    and its sibling, scored earlier, later or by another scorer, are none of them trained."""
    state = BufferState(batch_size=4, max_staleness=0, samples_per_prompt=2)
    generate_groups(state, "rollout:0", 0, 4, 0)  # prompts 0 and 1, two episodes each: ids 0-3
    first = scored_by(state.take_for_scoring(1, scorer="scorer:0"), uniform=lambda p: False)  # prompt 0's id 0
    rest = scored_by(state.take_for_scoring(10, scorer="scorer:1"), uniform=lambda p: False)
    failed = next(s for s in rest if s.prompt_index == 0)
    for s in rest:
        s.drop_reason = "reward_failed" if s is failed else ""
    state.add_scored(first)  # trained as far as it knows: kept for now
    assert state.report()["dropped"] == {}
    state.add_scored(rest)
    report = state.report()
    assert report["dropped"] == {"scorer_reward_failed": 2} and report["identity_holds"]
    assert state.granted == 2 and state.dropped_groups == {}  # both credits back, the prompt forgotten
    assert state.take_batch(0, 4) is None  # prompt 1's group alone is not a batch
    assert state.credits_for("rollout:0", 0, 4) == [2]  # prompt 2 takes prompt 0's place
    state.add_samples([sample(4, 0, 2), sample(5, 0, 2)])
    state.add_scored(scored_by(state.take_for_scoring(10), uniform=lambda p: False))
    assert sorted({s.prompt_index for s in state.take_batch(0, 4)}) == [1, 2]


def test_a_dropped_group_waits_in_the_snapshot_for_the_rest_of_its_samples(tmp_path):
    from buffer.state import load_snapshot, save_snapshot

    state = BufferState(batch_size=4, max_staleness=0, samples_per_prompt=2)
    generate_groups(state, "rollout:0", 0, 4, 0)
    work = scored_by(state.take_for_scoring(1), uniform=lambda p: False)
    work[0].drop_reason = "judge_unparsed"
    state.add_scored(work)
    path = str(tmp_path / "buffer.snapshot")
    save_snapshot(state, path)
    resumed = load_snapshot(path, batch_size=4, max_staleness=0, samples_per_prompt=2)
    assert resumed.dropped_groups == {0: "judge_unparsed"}
    resumed.add_scored(scored_by(resumed.take_for_scoring(10), uniform=lambda p: False))
    assert resumed.report()["dropped"] == {"scorer_judge_unparsed": 2} and resumed.dropped_groups == {}


def test_a_pairwise_scorer_is_given_whole_groups_or_all_a_group_will_have():
    state = BufferState(batch_size=4, max_staleness=0, samples_per_prompt=2)
    indices = state.credits_for("rollout:0", 0, 4)  # prompts 0 and 1
    state.add_samples([sample(0, 0, indices[0]), sample(1, 0, indices[1])], "rollout:0")  # one episode of each
    assert state.take_for_scoring(10, whole_groups=True) == []  # both groups have an episode to come
    state.add_samples([sample(2, 0, indices[1])], "rollout:0")
    assert [s.sample_id for s in state.take_for_scoring(1, whole_groups=True)] == ["1", "2"]  # whole, past max
    state.drop_episodes([indices[0]], ["env_error"], "rollout:0")  # prompt 0's other episode will never come
    assert [s.sample_id for s in state.take_for_scoring(10, whole_groups=True)] == ["0"]


def test_an_episodes_earlier_part_scored_after_its_dropped_last_part_is_dropped_too():
    """Parts of one episode can go to two requests, and the later request can come back first."""
    state = BufferState(batch_size=2, max_staleness=0, samples_per_prompt=2)
    generate_groups(state, "rollout:0", 0, 2, 0, split_every=1)  # prompt 0: two episodes of two parts each
    early = state.take_for_scoring(1)  # episode 0's first part
    rest = scored_by(state.take_for_scoring(10), uniform=lambda p: False)
    for s in rest:
        s.drop_reason = "reward_failed" if s.final else ""
    state.add_scored(rest)
    assert state.dropped_groups == {0: "reward_failed"}  # a part is still out with a scorer
    state.add_scored(scored_by(early, uniform=lambda p: False))
    report = state.report()
    assert report["dropped"] == {"scorer_reward_failed": 4} and report["identity_holds"]
    assert state.dropped_groups == {} and state.scored == {} and report["staleness_violations"] == 0


def test_a_dropped_group_whose_other_episode_an_engine_dropped_is_forgotten_at_the_next_batch():
    state = BufferState(batch_size=2, max_staleness=0, samples_per_prompt=2)
    index = state.credits_for("rollout:0", 0, 2)[0]
    state.add_samples([sample(0, 0, index)], "rollout:0")
    work = scored_by(state.take_for_scoring(1), uniform=lambda p: False)
    work[0].drop_reason = "judge_unparsed"
    state.add_scored(work)
    assert state.dropped_groups == {index: "judge_unparsed"}  # its other episode may still come
    state.drop_episodes([index], ["env_error"], "rollout:0")
    assert state.take_batch(0, 2) is None and state.dropped_groups == {}
