"""The engine's shifts on shared devices (``placement.mode: colocate``): the rollout, the scorer
and the learner work on the same devices in shifts that the buffer grants (``buffer.shifts``).
A grant of credits is the engine's shift to generate; once everything granted is generated and
sent it ends the shift (``shift_end``), on a GPU asleep first. Split, none of this happens."""

from __future__ import annotations

from protocol.message import Message


class GenerateShift:
    """Colocated: the engine shares its devices with the scorer and the learner, and a grant of
    credits is its shift to generate. Once everything granted is generated and sent it gives the
    devices back (``shift_end``); on a GPU the engine sleeps first, freeing its weights' and KV
    cache's memory, and wakes at its next grant. Split, it does nothing."""

    def __init__(self, client, engine, colocated: bool) -> None:
        self.client, self.engine, self.colocated = client, engine, colocated
        # vLLM's sleep mode is on only colocated with CUDA (rollout.engine.engine_settings)
        self.sleeps = colocated and bool(engine.llm_engine.vllm_config.model_config.enable_sleep_mode)
        self.held = False
        self.asleep = False

    def granted(self, grant: Message) -> None:
        """A grant came: colocated, every grant but "stop" is this engine's shift (credits, or newer
        weights alone when the staleness bound is full), woken before the new weights load."""
        if not self.colocated or grant.fields["stop"]:
            return
        if self.asleep:  # unmeasured: no GPU was lent with vLLM on it (docs/benchmarks.md, "Not measured")
            self.engine.wake_up()
            self.asleep = False
        self.held = True

    def end(self, version: int | None) -> None:
        """The engine ran dry: the devices go to the next shift. Past the shift's deadline the buffer
        refuses (``RemoteError``, which stops this engine: its work went back to the pool)."""
        if not self.held:
            return
        if self.sleeps and not self.asleep:  # unmeasured, as in granted
            self.engine.sleep(level=1)
            self.asleep = True
        reply = self.client.request("shift_end", {"policy_version": -1 if version is None else version})
        # 0: a grant crossed the end; the engine generates it and ends its shift again when dry
        self.held = reply.fields["accepted"] == 0
