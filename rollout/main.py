"""The rollout's loop: ask for credits, take newer weights if there are some, generate, send."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from common.config import TetherConfig
from common.image_prompts import prompts_with_images
from common.model_dirs import resolve_models
from common.processors import banning_placeholder, load_processor
from common.prompts import dataset_row, read_rows
from common.runlog import StartupTimeline, metrics_writer, setup_logging
from environments.agents import agent_programs
from environments.native import Environments, prompt_tools
from environments.tools import load_tools
from protocol.samples import Sample
from protocol.transport import connect_to_buffer
from rollout.adapters import PolicyAdapter, lora_arguments
from rollout.credits import Credits, Outbox
from rollout.engine import WeightLoads, banned_words, image_arguments, make_vllm_engine, sampling_params
from rollout.episodes import Episodes, Renderer
from common.engines import InFlight
from rollout.generators import ENVIRONMENT_POLL_S, Generator
from rollout.responses import Responses
from rollout.shifts import GenerateShift
from weight_sync.lora import lora_sync_logged


def prompts_that_fit(config: TetherConfig, tokenizer, log, rows: list[dict] | None = None,
                     tools: list[dict] | None = None, processor=None
                     ) -> tuple[list[list[int]], list[int], int, list[list[bytes]] | None]:
    """Token ids of every prompt of ``data.prompts`` (its ``rows``, if read already) that leaves room
    for ``max_new_tokens`` in ``max_model_len``, their rows in the file, how many were skipped, and
    (a policy that sees: its ``processor``) their images' bytes. Longer ones are skipped and counted
    (vLLM would refuse them); every engine skips the same ones, so the prompt stream means the same
    to all. A chat is rendered with the ``tools`` schemas."""
    started = time.monotonic()
    if rows is None:
        rows = read_rows(config.data.prompts, environment_args=config.rollout.environment_args)
    limit = config.rollout.max_model_len - config.rollout.max_new_tokens
    token_ids, kept, images = prompts_with_images(rows, tokenizer, processor, limit, config.data.system_prompt,
                                                  "data.prompts", config.data.prompts, tools)
    skipped = len(rows) - len(kept)
    log.info("%d prompts tokenized in %.1fs%s", len(rows), time.monotonic() - started,
             f"; {skipped} skipped: longer than {limit} tokens (rollout.max_model_len - max_new_tokens)"
             if skipped else "")
    return token_ids, kept, skipped, images


def generation_source(config: TetherConfig, environments: Environments | None, tokenizer, rows: list[dict],
                      prompts: list[list[int]], data_rows: list[int], log,
                      images: list[list[bytes]] | None = None, processor=None) -> Generator:
    """What the loop drives: one request a prompt without environments, else episodes of turns.
    Only finished requests come out of the engine (the loop reads nothing of one before its end).
    A policy that sees images: its ``processor`` and each prompt's ``images``."""
    from vllm.sampling_params import RequestOutputKind

    bad_words = banned_words(config, tokenizer)
    if environments is None:
        return Responses(prompts, data_rows,
                         sampling_params(config, bad_words, output_kind=RequestOutputKind.FINAL_ONLY), images)
    return Episodes(config, environments, Renderer(tokenizer, environments.tool_schemas, processor), tokenizer, rows,
                    prompts, data_rows, lambda _, max_tokens: sampling_params(
                        config, bad_words, n=1, max_tokens=max_tokens, output_kind=RequestOutputKind.FINAL_ONLY),
                    log, images)


def run(config: TetherConfig, worker_index: int = 0, engine=None) -> None:
    """Engine ``worker_index`` of the rollout pool. ``engine``: an already built ``vllm.LLM``
    (benchmarks share one).

    Streaming: the engine is kept full. One credit request is held at the buffer while the engine
    has room; the prompts it grants join the engine between two of its steps, and each group that
    finishes is sent at once, so no response waits for the longest one of its grant. Newer weights
    come with a grant and are loaded between steps: requests in flight are recomputed with them
    and keep the version of their first token as ``behavior_version`` (the oldest, docs/design.md), the
    newest as ``last_behavior_version``. With an environment or tools (``rollout.environment``,
    ``rollout.tools``) a prompt is an episode of turns (``rollout.episodes``), else one request
    (``rollout.responses``); the loop is the same."""
    rollout = start(config, worker_index, engine)
    try:
        # credits are asked for while the engine has room, and waited for only when it has nothing to do
        while take_credits(rollout):
            start_granted(rollout)
            step_engine(rollout)  # environments answer beside it: the engine never waits on one
            send_finished(rollout)  # at once, not with its grant: no response waits for the longest one
            rollout.record_period()
    except Exception as error:  # the buffer takes back its credits now, not after rollout.deadline_s
        rollout.client.goodbye(error)
        raise
    finish(rollout)


@dataclass
class Rollout:
    """What one engine's loop carries from one pass to the next."""
    config: TetherConfig
    name: str
    log: Any
    timeline: StartupTimeline
    engine: Any
    own_engine: bool  # built here (not a benchmark's): shut down at the end
    client: Any
    source: Generator
    weights: WeightLoads
    programs: Any  # the agent programs, if any (closed at the end)
    prompts: int  # the kept prompts
    skipped: int  # the prompts that do not fit
    metrics: Any
    credits: Credits
    outbox: Outbox
    shift: GenerateShift
    in_flight: InFlight
    version: int | None = 0  # the policy version the engine holds; None after a failed load: no new prompt joins
    queued: list[int] = field(default_factory=list)  # prompt indices granted, not started (waiting for a version)
    period: RolloutPeriod = field(default_factory=lambda: RolloutPeriod(time.monotonic()))

    def record_period(self, last: bool = False) -> None:
        """A metrics record a second and whenever the engine runs dry (and the ``last``)."""
        now = time.monotonic()
        if last or now - self.period.started >= METRICS_EVERY_S or (not self.in_flight and self.period.samples):
            self.metrics.write({"step": self.version if self.version is not None else -1,
                                "generated_total": self.outbox.sent, "in_flight": len(self.in_flight),
                                "prompts_skipped": self.skipped, **self.period.record(now), **self.source.record(),
                                **self.client.counters})
            self.period = RolloutPeriod(now)


def start(config: TetherConfig, worker_index: int, engine) -> Rollout:
    """The user's code, the prompts, the engine and the buffer's connection, in that order."""
    name = f"rollout{worker_index}"
    log = setup_logging(name, config.log_level)
    timeline = StartupTimeline(config.run_dir, name)
    config = resolve_models(config, "rollout")
    from transformers import AutoTokenizer

    timeline.phase("import")
    rollout_cfg = config.rollout
    # the user's code first: a typo there should not wait for the engine
    tokenizer = AutoTokenizer.from_pretrained(config.models.policy)
    programs = agent_programs(config, tokenizer)
    environments = Environments.load(rollout_cfg.environment, load_tools(rollout_cfg.tools), programs,
                                     rollout_cfg.env_step_deadline_s)
    tools = prompt_tools(config, environments)
    if environments is not None:
        environments.read_calls_with(rollout_cfg.tool_parser, tokenizer, rollout_cfg.reasoning_parser)
    rows = read_rows(config.data.prompts, environment_args=config.rollout.environment_args)
    processor = load_processor(config.models.policy)  # a policy that sees images: its processor
    config = banning_placeholder(config, processor)
    prompts, data_rows, skipped, images = prompts_that_fit(config, tokenizer, log, rows, tools, processor)
    if processor is not None and environments is not None:
        environments.showing_images(images)
    timeline.phase("prompts")
    # the engine first: it is the longest part of anyone's start-up and needs nobody
    own_engine = engine is None
    adapters = config.learner.lora_rank > 0 and lora_sync_logged(config, log) == "adapters"
    engine = engine or make_vllm_engine(config, worker_index, **(lora_arguments(config) if adapters else {}),
                                        **image_arguments(images, rollout_cfg.max_images_per_episode
                                                          if environments is not None else None))
    timeline.phase("engine init")
    client = connect_to_buffer(config, "rollout", str(worker_index))
    timeline.phase("buffer connect")
    source = generation_source(config, environments, tokenizer, rows, prompts, data_rows, log, images, processor)
    weights = WeightLoads(engine, config, name, log,
                          PolicyAdapter(config, f"{config.weights_dir}-{name}-lora") if adapters else None)
    log.info("generating with %s, %d prompts, %d samples per prompt, up to %d prompts at once%s", config.models.policy,
             len(prompts), rollout_cfg.samples_per_prompt, rollout_cfg.prompts_per_generate,
             "" if environments is None else f"; episodes of up to {rollout_cfg.max_turns} turns with "
             f"{rollout_cfg.environment or 'no environment'} and tools {', '.join(environments.tools) or 'none'}")
    return Rollout(config, name, log, timeline, engine, own_engine, client, source, weights, programs, len(prompts),
                   skipped, metrics_writer(config, name), Credits(client, rollout_cfg.samples_per_prompt),
                   Outbox(client), GenerateShift(client, engine, config.colocated), InFlight(engine))


def take_credits(rollout: Rollout) -> bool:
    """A grant taken, if one came (and the weights it names loaded); False when the buffer says stop."""
    room = rollout.config.rollout.prompts_per_generate - rollout.source.active - len(rollout.queued)
    busy = bool(rollout.in_flight) or rollout.source.active > 0  # generating, or episodes waiting on their environment
    if not busy and not rollout.queued:
        rollout.shift.end(rollout.version)  # colocated: all it was granted is sent, the devices go to the next role
    grant = take_grant(rollout.credits, rollout.version, room, busy, rollout.weights.retry_at, rollout.period)
    if grant is None:
        return True
    if grant.fields["stop"]:
        return False
    # positions in the run's prompt stream, each handed out once; a newer version may generate them
    rollout.queued += grant.fields["prompt_indices"]
    rollout.shift.granted(grant)
    if rollout.version is None or grant.fields["policy_version"] > rollout.version:
        sync_started = time.monotonic()
        rollout.version = rollout.weights.load(grant, rollout.client)
        rollout.period.weight_sync_s += time.monotonic() - sync_started
    return True


def start_granted(rollout: Rollout) -> None:
    """The granted prompts start, and what is ready joins the engine, with the version it holds."""
    if rollout.version is None:
        return
    adding_started = time.monotonic()  # the engine takes each request in: generation work
    for index in rollout.queued:
        rollout.source.start(index, dataset_row(rollout.config.seed, rollout.prompts, index))
    rollout.queued = []
    rollout.in_flight.add(rollout.source, rollout.version, rollout.weights.lora_request)
    rollout.period.busy_s += time.monotonic() - adding_started


def step_engine(rollout: Rollout) -> None:
    """One engine step, and the environments' answers since (waited for when the engine is empty)."""
    period = rollout.period
    if rollout.in_flight:
        step_started = time.monotonic()
        period.engine_steps += 1
        period.requests_stepped += len(rollout.in_flight)
        rollout.in_flight.step(rollout.source, rollout.version)
        period.busy_s += time.monotonic() - step_started
    waited = time.monotonic()
    rollout.source.advance(waited, timeout=0.0 if rollout.in_flight else ENVIRONMENT_POLL_S)
    period.waiting_s += time.monotonic() - waited


def send_finished(rollout: Rollout) -> None:
    """The groups finished since are sent, and the prompts that end without a sample said (acks are
    read as they come)."""
    send_started = time.monotonic()
    samples, dropped = rollout.source.finished()
    if samples and not rollout.outbox.sent:
        rollout.timeline.phase("first samples")  # credits, weights and the first groups generated
    rollout.outbox.send(samples, dropped)
    rollout.period.add(samples)
    rollout.period.send_s += time.monotonic() - send_started


def finish(rollout: Rollout) -> None:
    """The run is over: what is still generating is of no use; what was sent is acknowledged, and
    the last period's record written (the totals in the metrics are the log's)."""
    rollout.in_flight.abort()
    rollout.source.close()
    unanswered = rollout.outbox.settle()
    rollout.record_period(last=True)
    rollout.log.info("stopping after %d samples at policy version %s%s", rollout.outbox.sent, rollout.version,
                     f"; {unanswered} messages of samples were not acknowledged before the buffer stopped"
                     if unanswered else "")
    rollout.weights.close()
    if rollout.programs is not None:
        rollout.programs.close()
    rollout.metrics.close()
    rollout.client.close()
    # vLLM's engine process and workers, where it has them, exit now, reaped by this process rather
    # than left to init. An engine inside this process with one worker has none: its shutdown, a
    # gc.collect over the whole heap (1.4 s here), would only delay the exit that follows.
    in_this_process = (os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
                       and rollout.config.rollout.tensor_parallel_size == 1)
    if rollout.own_engine and not in_this_process:
        rollout.engine.llm_engine.engine_core.shutdown()


def take_grant(credits: Credits, version: int | None, room: int, busy: bool, retry_at: float,
               period: "RolloutPeriod"):
    """The buffer's grant of credits, if one came: a request is held while the engine has ``room``
    (not before ``retry_at``, after a failed weight load); its answer is looked for between engine
    steps when ``busy``, else waited for (or, with no request held, the back-off slept out)."""
    messaging_started = time.monotonic()  # requests and polls to the buffer count as sending
    if time.monotonic() >= retry_at:
        credits.ask(version, room)
    grant = credits.poll() if busy else None
    period.send_s += time.monotonic() - messaging_started
    if not busy:
        waited = time.monotonic()
        if credits.request is not None:
            grant = credits.wait()
        else:  # backing off after a failed load, nothing to generate meanwhile
            time.sleep(max(0.0, retry_at - time.monotonic()))
        period.waiting_s += time.monotonic() - waited
    return grant


METRICS_EVERY_S = 1.0
# a period busier than this has a generation rate to report: a period of episodes finishing on
# their environments' answers holds a few µs of engine steps, and its tokens over them read as 10^5 tokens/s
RATE_BUSY_FLOOR_S = 0.05


@dataclass
class RolloutPeriod:
    """Where the rollout's time went since ``started``, for one metrics record: generating (engine
    steps), loading weights, sending samples, waiting for credits with nothing to generate."""
    started: float
    busy_s: float = 0.0
    weight_sync_s: float = 0.0
    send_s: float = 0.0
    waiting_s: float = 0.0
    engine_steps: int = 0
    requests_stepped: int = 0  # summed over engine steps: requests in the engine at each
    samples: int = 0
    response_tokens: int = 0
    prompt_indices: list[int] = field(default_factory=list)

    def add(self, samples: list[Sample]) -> None:
        self.samples += len(samples)
        self.response_tokens += sum(len(sample.response_tokens) for sample in samples)
        self.prompt_indices += sorted({sample.prompt_index for sample in samples})

    def record(self, now: float) -> dict:
        return {"samples": self.samples, "response_tokens": self.response_tokens,
                "tokens_per_s": self.response_tokens / self.busy_s if self.busy_s >= RATE_BUSY_FLOOR_S else None,
                "busy_s": self.busy_s,
                "weight_sync_s": self.weight_sync_s, "send_s": self.send_s, "waiting_s": self.waiting_s,
                "iteration_s": now - self.started, "engine_steps": self.engine_steps,
                "requests_per_step": self.requests_stepped / max(self.engine_steps, 1),
                "prompt_indices": self.prompt_indices}
