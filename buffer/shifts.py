"""Colocated mode (``placement.mode: colocate``): the rollout, the scorer and the learner share the
same devices, so they work in shifts, and the buffer says whose shift it is. (A shift is the
devices' time given to one kind of work; a conversation's turns are another thing, the episode's.)
Free of sockets: ``buffer.main`` asks it before answering a held request, and tells it when work
comes back.

A shift has a purpose and the workers computing in it. The buffer's own answers are the grants,
so no role asks for a shift: the credits that start a batch's generation start the ``generate``
shift, the first scoring work the ``score`` shift, the batch the ``train`` shift. Each ends when its
work is back: an engine that has sent everything it was granted says ``shift_end`` (after freeing
its memory, on a GPU); a scorer's shift ends when it holds no sample to score; the learner's when
it publishes the weights it trained (or checkpoints, or finishes). A free shift goes to scoring
while samples wait for it, else to training if a batch can be served, else to generation:
generation, scoring and training of one batch follow each other, and the staleness rule decides,
as ever, how much one generate shift may grant (up to ``k + 1`` batches).

A shift held past ``placement.shift_deadline_s`` is named in an error; its holders' work goes back
to the pool (an engine's credits, a scorer's samples). An engine's late ``shift_end`` and a learner's late
weights are refused, and such an engine gets no other grant, so a role that does not give the
devices back stops with that error instead of hanging the run; a scorer's late scores are ignored,
as after ``scorer.deadline_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PURPOSES = ("generate", "score", "train")


@dataclass
class Shift:
    purpose: str
    granted_at: float
    holders: set[str] = field(default_factory=set)  # workers ("rollout:0") computing in it


class Shifts:
    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self.shift: Shift | None = None
        self.late: dict[str, str] = {}  # worker -> why the end of its shift is refused
        self.granted = {purpose: 0 for purpose in PURPOSES}  # shifts granted, per purpose (metrics)

    def may(self, purpose: str) -> bool:
        """Whether work of ``purpose`` may be handed out now: its shift is on, or none is."""
        return self.shift is None or self.shift.purpose == purpose

    def grant(self, purpose: str, worker: str, now: float) -> None:
        """``worker`` computes for ``purpose`` from now: the shift starts if none is on."""
        if not self.may(purpose):
            raise RuntimeError(f"{worker} granted a {purpose} shift while {self.shift.purpose} holds it")
        if self.shift is None:
            self.shift = Shift(purpose, now)
            self.granted[purpose] += 1
        self.shift.holders.add(worker)

    def release(self, worker: str) -> None:
        """``worker``'s work of the shift is done (or it is gone): the shift ends with its last holder."""
        if self.shift is not None:
            self.shift.holders.discard(worker)
            if not self.shift.holders:
                self.shift = None

    def refusal(self, worker: str) -> str | None:
        """Why ``worker``'s end of its shift (or the result it brings) is refused: it came past the deadline."""
        return self.late.get(worker)

    def forget(self, worker: str) -> None:
        """A new process of ``worker`` (a restart): it holds nothing and owes nothing."""
        self.release(worker)
        self.late.pop(worker, None)

    def overdue(self, now: float) -> tuple[str, list[str], float] | None:
        """(purpose, holders, seconds held) of a shift past the deadline, which ends it: its holders'
        late ends are refused from now on. None while the shift is within it."""
        shift = self.shift
        if shift is None or now - shift.granted_at <= self.deadline_s:
            return None
        held = now - shift.granted_at
        holders = sorted(shift.holders)
        for worker in holders:
            self.late[worker] = (f"{worker} held the {shift.purpose} shift for {held:.0f}s, past "
                                 f"placement.shift_deadline_s ({self.deadline_s:g}s): its work went back to the "
                                 "pool and the devices to the next role")
        self.shift = None
        return shift.purpose, holders, held

    def record(self, now: float) -> dict:
        shift = self.shift
        return {"shift": shift.purpose if shift else "none", "shift_held_s": now - shift.granted_at if shift else 0.0,
                **{f"shifts_{purpose}": count for purpose, count in self.granted.items()}}
