"""The rollout's conversation with the buffer: credits asked for and granted (``Credits``), and
samples sent and acknowledged (``Outbox``). Admission is the buffer's: a rollout generates only
what it was granted, so what it sends is never more than the staleness rule allows."""

from __future__ import annotations

import time
import uuid

from protocol.message import Message
from protocol.samples import Sample, pack_samples
from protocol.transport import BufferLost

ACK_GRACE_S = 5.0  # at the end: how long what was sent may take to be acknowledged


class Credits:
    """One credit request held at the buffer while the engine has room; the buffer answers when it
    can grant, or at once with newer weights for an engine that holds none. Its answer is looked
    for between engine steps, or waited for when there is nothing to generate."""

    def __init__(self, client, samples_per_prompt: int) -> None:
        self.client, self.samples_per_prompt = client, samples_per_prompt
        self.request: int | None = None  # the id of the credit request held at the buffer, if any

    def ask(self, version: int | None, room: int) -> None:
        """Ask for ``room`` prompts' worth, unless a request is held already; an engine that holds
        no weights (``version`` None after a failed load) asks for none, only for newer weights."""
        if self.request is None and (room > 0 or version is None):
            self.request = self.client.send("credit_request", {
                "policy_version": -1 if version is None else version,
                "wanted": 0 if version is None else room * self.samples_per_prompt})

    def poll(self) -> Message | None:
        """The grant, if it came (never waits)."""
        return self._granted(self.client.poll(self.request) if self.request is not None else None)

    def wait(self) -> Message | None:
        """The grant, waited for (the client's deadline applies)."""
        if self.request is None:
            return None
        return self._granted(self.client.wait(self.request, waiting_for="generation credits"))

    def _granted(self, grant: Message | None) -> Message | None:
        if grant is not None:
            self.request = None
        return grant


class Outbox:
    """Samples and dropped prompts sent as they finish, each samples message named by this engine
    (a prefix of its own, then a count), and their acknowledgements read as they come."""

    def __init__(self, client) -> None:
        self.client, self.prefix = client, uuid.uuid4().hex[:8]
        self.sent = 0  # samples
        self.unacknowledged: list[int] = []

    def send(self, samples: list[Sample], dropped: list[tuple[int, str]]) -> None:
        if samples:
            for i, sample in enumerate(samples):
                sample.sample_id = f"{self.prefix}-{self.sent + i}"
            self.unacknowledged.append(self.client.send("samples", *pack_samples(samples)))
            self.sent += len(samples)
        if dropped:  # prompts that gave no sample: their credits come back
            self.unacknowledged.append(self.client.send("episodes_dropped", {
                "prompt_indices": [index for index, _ in dropped], "reasons": [reason for _, reason in dropped]}))
        self.unacknowledged = [request for request in self.unacknowledged if self.client.poll(request) is None]

    def settle(self, grace_s: float = ACK_GRACE_S) -> int:
        """Wait up to ``grace_s`` for what was sent to be acknowledged (the buffer counts samples
        that came after the learner finished); returns how many messages stayed unanswered."""
        deadline = time.monotonic() + grace_s
        try:
            while self.unacknowledged and time.monotonic() < deadline:
                self.unacknowledged = [request for request in self.unacknowledged if self.client.poll(request) is None]
                if self.unacknowledged:
                    time.sleep(0.01)
        except BufferLost:  # the buffer is gone already: what is left stays unanswered
            pass
        return len(self.unacknowledged)

