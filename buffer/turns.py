"""Colocated mode (``placement.mode: colocate``): the rollout, the scorer and the learner share the
same devices, so they take turns, and the buffer says whose turn it is. Free of sockets:
``buffer.main`` asks it before answering a held request, and tells it when work comes back.

A turn has a purpose and the workers computing in it. The buffer's own answers are the grants,
so no role asks for a turn: the credits that start a batch's generation start the ``generate``
turn, the first scoring work the ``score`` turn, the batch the ``train`` turn. Each ends when its
work is back: an engine that has sent everything it was granted says ``turn_release`` (after
freeing its memory, on a GPU); a scorer's turn ends when it holds no sample to score; the
learner's when it publishes the weights it trained (or checkpoints, or finishes). A free turn goes
to scoring while samples wait for it, else to training if a batch can be served, else to
generation: generation, scoring and training of one batch follow each other, and the staleness
rule decides, as ever, how much one generate turn may grant (up to ``k + 1`` batches).

A turn held past ``placement.turn_deadline_s`` is named in an error; its holders' work goes back to
the pool (an engine's credits, a scorer's samples). An engine's late release and a learner's late
weights are refused, and such an engine gets no other grant, so a role that does not give the
devices back stops with that error instead of hanging the run; a scorer's late scores are ignored,
as after ``scorer.deadline_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PURPOSES = ("generate", "score", "train")


@dataclass
class Turn:
    purpose: str
    granted_at: float
    holders: set[str] = field(default_factory=set)  # workers ("rollout:0") computing in it


class Turns:
    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self.turn: Turn | None = None
        self.late: dict[str, str] = {}  # worker -> why its release is refused
        self.granted = {purpose: 0 for purpose in PURPOSES}  # turns granted, per purpose (metrics)

    def may(self, purpose: str) -> bool:
        """Whether work of ``purpose`` may be handed out now: its turn is on, or none is."""
        return self.turn is None or self.turn.purpose == purpose

    def grant(self, purpose: str, worker: str, now: float) -> None:
        """``worker`` computes for ``purpose`` from now: the turn starts if none is on."""
        if not self.may(purpose):
            raise RuntimeError(f"{worker} granted a {purpose} turn while {self.turn.purpose} holds it")
        if self.turn is None:
            self.turn = Turn(purpose, now)
            self.granted[purpose] += 1
        self.turn.holders.add(worker)

    def release(self, worker: str) -> None:
        """``worker``'s work of the turn is done (or it is gone): the turn ends with its last holder."""
        if self.turn is not None:
            self.turn.holders.discard(worker)
            if not self.turn.holders:
                self.turn = None

    def refusal(self, worker: str) -> str | None:
        """Why ``worker``'s release (or the result it brings) is refused: it came past the deadline."""
        return self.late.get(worker)

    def forget(self, worker: str) -> None:
        """A new process of ``worker`` (a restart): it holds nothing and owes nothing."""
        self.release(worker)
        self.late.pop(worker, None)

    def overdue(self, now: float) -> tuple[str, list[str], float] | None:
        """(purpose, holders, seconds held) of a turn past the deadline, which ends it: its holders'
        late releases are refused from now on. None while the turn is within it."""
        turn = self.turn
        if turn is None or now - turn.granted_at <= self.deadline_s:
            return None
        held = now - turn.granted_at
        holders = sorted(turn.holders)
        for worker in holders:
            self.late[worker] = (f"{worker} held the {turn.purpose} turn for {held:.0f}s, past "
                                 f"placement.turn_deadline_s ({self.deadline_s:g}s): its work went back to the "
                                 "pool and the devices to the next role")
        self.turn = None
        return turn.purpose, holders, held

    def record(self, now: float) -> dict:
        turn = self.turn
        return {"turn": turn.purpose if turn else "none", "turn_held_s": now - turn.granted_at if turn else 0.0,
                **{f"turns_{purpose}": count for purpose, count in self.granted.items()}}
