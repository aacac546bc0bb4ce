"""The rollout's loop: ask for credits, take newer weights if there are some, generate, send."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field

from common.config import TetherConfig
from common.models import resolve_models
from common.prompts import dataset_row, prompts_within, read_rows
from common.runlog import StartupTimeline, metrics_writer, setup_logging
from protocol.samples import Sample, pack_samples
from protocol.transport import BufferLost, connect_to_buffer
from rollout.adapters import PolicyAdapter, lora_arguments
from rollout.engine import WeightLoads, make_vllm_engine, sampling_params
from rollout.environments import Environments
from rollout.episodes import Episodes, Renderer
from rollout.responses import Responses
from rollout.tools import load_tools
from weight_sync.lora import lora_sync_logged

def prompts_that_fit(config: TetherConfig, tokenizer, log, rows: list[dict] | None = None,
                     tools: list[dict] | None = None) -> tuple[list[list[int]], list[int], int]:
    """Token ids of every prompt of ``data.prompts`` (its ``rows``, if read already) that leaves room
    for ``max_new_tokens`` in ``max_model_len``, their rows in the file, and how many were skipped.
    Longer ones are skipped and counted (vLLM would refuse them); every engine skips the same ones,
    so the prompt stream means the same to all. A chat is rendered with the ``tools`` schemas."""
    started = time.monotonic()
    rows = rows if rows is not None else read_rows(config.data.prompts)
    limit = config.rollout.max_model_len - config.rollout.max_new_tokens
    token_ids, kept = prompts_within(rows, tokenizer, limit, config.data.system_prompt, "data.prompts",
                                     config.data.prompts, tools)
    skipped = len(rows) - len(kept)
    log.info("%d prompts tokenized in %.1fs%s", len(rows), time.monotonic() - started,
             f"; {skipped} skipped: longer than {limit} tokens (rollout.max_model_len - max_new_tokens)"
             if skipped else "")
    return token_ids, kept, skipped


def generation_source(config: TetherConfig, environments: Environments | None, tokenizer, rows: list[dict],
                      prompts: list[list[int]], data_rows: list[int], log) -> Responses | Episodes:
    """What the loop drives: one request a prompt without environments, else episodes of turns.
    Only finished requests come out of the engine (the loop reads nothing of one before its end)."""
    from vllm.sampling_params import RequestOutputKind

    if environments is None:
        return Responses(prompts, data_rows, sampling_params(config, output_kind=RequestOutputKind.FINAL_ONLY))
    return Episodes(config, environments, Renderer(tokenizer, environments.tool_schemas), tokenizer, rows, prompts,
                    data_rows, lambda _, max_tokens: sampling_params(config, n=1, max_tokens=max_tokens,
                                                                     output_kind=RequestOutputKind.FINAL_ONLY), log)


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
    name = f"rollout{worker_index}"
    log = setup_logging(name, config.log_level)
    timeline = StartupTimeline(config.run_dir, name)
    config = resolve_models(config, "rollout")
    from transformers import AutoTokenizer
    from vllm import TokensPrompt

    timeline.phase("import")
    rollout_cfg = config.rollout
    # the user's code first: a typo there should not wait for the engine
    environments = Environments.load(rollout_cfg.environment, load_tools(rollout_cfg.tools))
    tools = environments.tool_schemas if environments is not None else None
    tokenizer = AutoTokenizer.from_pretrained(config.models.policy)
    rows = read_rows(config.data.prompts)
    prompts, data_rows, skipped = prompts_that_fit(config, tokenizer, log, rows, tools)
    timeline.phase("prompts")
    # the engine first: it is the longest part of anyone's start-up and needs nobody
    own_engine = engine is None
    adapters = config.learner.lora_rank > 0 and lora_sync_logged(config, log) == "adapters"
    engine = engine or make_vllm_engine(config, worker_index, **(lora_arguments(config) if adapters else {}))
    timeline.phase("engine init")
    client = connect_to_buffer(config, "rollout", str(worker_index))
    timeline.phase("buffer connect")
    source = generation_source(config, environments, tokenizer, rows, prompts, data_rows, log)
    metrics = metrics_writer(config, name)
    weights = WeightLoads(engine, config, name, log,
                          PolicyAdapter(config, f"{config.weights_dir}-{name}-lora") if adapters else None)
    id_prefix = uuid.uuid4().hex[:8]
    log.info("generating with %s, %d prompts, %d samples per prompt, up to %d prompts at once%s", config.models.policy,
             len(prompts), rollout_cfg.samples_per_prompt, rollout_cfg.prompts_per_generate,
             "" if environments is None else f"; episodes of up to {rollout_cfg.max_turns} turns with "
             f"{rollout_cfg.environment or 'no environment'} and tools {', '.join(environments.tools) or 'none'}")

    version = 0  # the policy version the engine holds; None after a failed load: no new prompt joins then
    in_flight: dict[str, object] = {}  # vLLM request id -> what source said the request is
    queued: list[int] = []  # prompt indices granted and not yet started (waiting for a whole version)
    credit_request = None  # the id of the credit request held at the buffer, if any
    unacknowledged: list[int] = []  # samples messages sent, their acks not read yet
    generated = requests_added = 0
    period = RolloutPeriod(time.monotonic())
    while True:
        # 1. while the engine has room, one credit request waits at the buffer (it answers when it can grant,
        #    or at once with newer weights for an engine that holds none)
        room = rollout_cfg.prompts_per_generate - source.active - len(queued)
        busy = bool(in_flight) or source.active > 0  # generating, or episodes waiting on their environment
        messaging_started = time.monotonic()  # requests and polls to the buffer count as sending
        if credit_request is None and (room > 0 or version is None) and time.monotonic() >= weights.retry_at:
            credit_request = client.send("credit_request", {
                "policy_version": -1 if version is None else version,
                "wanted": 0 if version is None else room * rollout_cfg.samples_per_prompt})
        # 2. its answer: waited for when the engine has nothing to do, only looked for between steps otherwise
        grant = None
        if credit_request is not None and busy:
            grant = client.poll(credit_request)
        period.send_s += time.monotonic() - messaging_started
        waited = time.monotonic()
        if credit_request is not None and not busy:
            grant = client.wait(credit_request, waiting_for="generation credits")
        elif not busy:  # backing off after a failed load, nothing to generate meanwhile
            time.sleep(max(0.0, weights.retry_at - time.monotonic()))
        period.waiting_s += time.monotonic() - waited
        if grant is not None:
            credit_request = None
            if grant.fields["stop"]:
                break
            # positions in the run's prompt stream, each handed out once; a newer version may generate them
            queued += grant.fields["prompt_indices"]
            if version is None or grant.fields["policy_version"] > version:
                sync_started = time.monotonic()
                version = weights.load(grant, client)
                period.weight_sync_s += time.monotonic() - sync_started
        # 3. granted prompts start, and what is ready joins the engine, with the version it holds
        if version is not None:
            adding_started = time.monotonic()  # the engine takes each request in: generation work
            for index in queued:
                source.start(index, dataset_row(config.seed, len(prompts), index))
            queued = []
            for what, ids, sampling in source.take_ready(version):
                request_id = str(requests_added)
                requests_added += 1
                engine.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=ids), sampling,
                                              lora_request=weights.lora_request)
                in_flight[request_id] = what
            period.busy_s += time.monotonic() - adding_started
        # 4. one engine step; environments answer beside it
        if in_flight:
            step_started = time.monotonic()
            period.engine_steps += 1
            period.requests_stepped += len(in_flight)
            for output in engine.llm_engine.step():
                if output.finished:
                    source.turn_finished(in_flight.pop(output.request_id), output, version)
            period.busy_s += time.monotonic() - step_started
        waited = time.monotonic()
        # with nothing in the engine, the loop waits on the environments rather than spinning
        source.advance(waited, timeout=0.0 if in_flight else ENVIRONMENT_POLL_S)
        period.waiting_s += time.monotonic() - waited
        # 5. what finished is sent at once (acks are read as they come)
        send_started = time.monotonic()
        samples, dropped = source.finished()
        if samples:
            for i, sample in enumerate(samples):
                sample.sample_id = f"{id_prefix}-{generated + i}"
            if not generated:
                timeline.phase("first samples")  # credits, weights and the first groups generated
            unacknowledged.append(client.send("samples", *pack_samples(samples)))
            generated += len(samples)
            period.add(samples)
        if dropped:  # episodes that gave no sample: their credits come back
            unacknowledged.append(client.send("episodes_dropped", {
                "prompt_indices": [index for index, _ in dropped], "reasons": [reason for _, reason in dropped]}))
        unacknowledged = [request for request in unacknowledged if client.poll(request) is None]
        period.send_s += time.monotonic() - send_started
        # 6. a record a second, and whenever the engine runs dry
        now = time.monotonic()
        if now - period.started >= METRICS_EVERY_S or (not in_flight and period.samples):
            metrics.write({"step": version if version is not None else -1, "generated_total": generated,
                           "in_flight": len(in_flight), "prompts_skipped": skipped, **period.record(now),
                           **source.record(), **client.counters})
            period = RolloutPeriod(now)
    if in_flight:  # the run is over: what is still generating is of no use
        engine.llm_engine.abort_request(list(in_flight))
    # what was sent is acknowledged (the buffer counts samples that came after the learner finished),
    # and the last period's record written: the totals in the metrics are the log's
    unacknowledged = acknowledged(client, unacknowledged, ACK_GRACE_S)
    metrics.write({"step": version if version is not None else -1, "generated_total": generated,
                   "in_flight": len(in_flight), "prompts_skipped": skipped, **period.record(time.monotonic()),
                   **source.record(), **client.counters})
    log.info("stopping after %d samples at policy version %s%s", generated, version,
             f"; {len(unacknowledged)} messages of samples were not acknowledged before the buffer stopped"
             if unacknowledged else "")
    weights.close()
    metrics.close()
    client.close()
    # vLLM's engine process and workers, where it has them, exit now, reaped by this process rather
    # than left to init. An engine inside this process with one worker has none: its shutdown, a
    # gc.collect over the whole heap (1.4 s here), would only delay the exit that follows.
    in_this_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and rollout_cfg.tensor_parallel_size == 1
    if own_engine and not in_this_process:
        engine.llm_engine.engine_core.shutdown()


METRICS_EVERY_S = 1.0
ACK_GRACE_S = 5.0  # at the end: how long what was sent may take to be acknowledged


def acknowledged(client, requests: list[int], grace_s: float) -> list[int]:
    """Wait up to ``grace_s`` for the answers to ``requests``; returns those still unanswered."""
    deadline = time.monotonic() + grace_s
    try:
        while requests and time.monotonic() < deadline:
            requests = [request for request in requests if client.poll(request) is None]
            if requests:
                time.sleep(0.01)
    except BufferLost:  # the buffer is gone already: what is left stays unanswered
        pass
    return requests
ENVIRONMENT_POLL_S = 0.05  # with nothing in the engine: the longest wait for an environment's answer


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
                "tokens_per_s": self.response_tokens / max(self.busy_s, 1e-9), "busy_s": self.busy_s,
                "weight_sync_s": self.weight_sync_s, "send_s": self.send_s, "waiting_s": self.waiting_s,
                "iteration_s": now - self.started, "engine_steps": self.engine_steps,
                "requests_per_step": self.requests_stepped / max(self.engine_steps, 1),
                "prompt_indices": self.prompt_indices}
