"""The rollout's loop: ask for credits, take newer weights if there are some, generate, send."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field

from common.config import ConfigError, TetherConfig
from common.models import resolve_models
from common.prompts import dataset_row, prompts_within, read_rows
from common.runlog import MetricsWriter, StartupTimeline, setup_logging
from protocol.samples import Sample, pack_samples
from protocol.transport import connect_to_buffer
from weight_sync.buckets import ShmWeightWriter, WeightManifest, WeightStreamError
from weight_sync.stream import WeightPrefetcher
from weight_sync.tcp import fetch_over_tcp

REFUSED_WEIGHTS_BACKOFF_S = 1.0  # doubled after each failed load in a row, up to 30 s


class IncompatibleWeights(ConfigError):
    """vLLM's loader refuses the learner's weights themselves: no later version can load either."""


class EngineNeedsRestart(RuntimeError):
    """A weight load failed part-way: the engine holds a mix of versions, and vLLM's reload does not
    recover from it (measured: a whole version loaded next fails too). The rollout exits non-zero;
    `tether run` starts it again, from the SFT weights and then the newest version."""


class WeightsNotLoading(ConfigError):
    """``rollout.max_weight_load_failures`` loads in a row failed: the engine cannot generate with
    the learner's weights, and a restart would fail the same way (a ConfigError: not restarted)."""


def prompts_that_fit(config: TetherConfig, tokenizer, log) -> tuple[list[list[int]], list[int], int]:
    """Token ids of every prompt of ``data.prompts`` that leaves room for ``max_new_tokens`` in
    ``max_model_len``, their rows in the file, and how many were skipped. Longer ones are skipped
    and counted (vLLM would refuse them); every engine skips the same ones, so the prompt stream
    means the same to all."""
    started = time.monotonic()
    rows = read_rows(config.data.prompts)
    limit = config.rollout.max_model_len - config.rollout.max_new_tokens
    token_ids, kept = prompts_within(rows, tokenizer, limit, config.data.system_prompt, "data.prompts",
                                     config.data.prompts)
    skipped = len(rows) - len(kept)
    log.info("%d prompts tokenized in %.1fs%s", len(rows), time.monotonic() - started,
             f"; {skipped} skipped: longer than {limit} tokens (rollout.max_model_len - max_new_tokens)"
             if skipped else "")
    return token_ids, kept, skipped


def omp_threads_bind(cores: list[int], tensor_parallel_size: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for one engine: its cores split evenly between its tensor-parallel
    workers, ``|`` between workers ("0|1"); with fewer cores than workers they take turns. vLLM's
    automatic binding wants a NUMA node per worker and refuses TP > 1 on a one-node machine."""
    if tensor_parallel_size <= len(cores):
        per_worker = len(cores) // tensor_parallel_size
        groups = [cores[i * per_worker:(i + 1) * per_worker] for i in range(tensor_parallel_size)]
    else:
        groups = [[cores[i % len(cores)]] for i in range(tensor_parallel_size)]
    return "|".join(",".join(str(core) for core in group) for group in groups)


def engine_settings(config: TetherConfig, worker_index: int, cuda: bool) -> tuple[dict[str, str], dict]:
    """The environment and ``vllm.LLM`` arguments of engine ``worker_index``, built the fastest way
    the device allows (measured on CPU, docs/benchmarks.md "Start-up"):
    - in-process (``rollout.in_process``): vLLM's V1 engine otherwise runs as three processes that
      each import vLLM (~10 s apiece here); on CPU it runs in the rollout's own. On GPUs vLLM's
      separate engine process overlaps scheduling with the GPU's work, so it stays the default there.
    - eager (``rollout.enforce_eager``): on CPU there are no CUDA graphs to capture, and torch.compile
      only traced vLLM's logprob-rank helper, 2.2 s at the first generate for nothing; with dynamo
      off it runs as plain torch. On GPUs graphs are much of vLLM's speed: off by default there.
    - the KV cache: a size in bytes on CPU (``kv_cache_gib``, any fraction), a memory share on GPUs."""
    rollout = config.rollout
    in_process = rollout.in_process if rollout.in_process is not None else (
        not cuda and rollout.tensor_parallel_size == 1)
    eager = rollout.enforce_eager if rollout.enforce_eager is not None else not cuda
    environment = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1"}
    if eager:
        environment["TORCHDYNAMO_DISABLE"] = "1"  # also for the engine's own processes, when it has them
    arguments = dict(
        model=config.models.policy, dtype=rollout.dtype, seed=config.seed, max_model_len=rollout.max_model_len,
        tensor_parallel_size=rollout.tensor_parallel_size, enforce_eager=eager,
        worker_extension_cls="rollout.worker_extension.WeightSyncExtension",
        # Logprobs of the distribution actually sampled (after temperature, top-k, top-p), the one the
        # learner recomputes; vLLM's default is the raw logits' distribution.
        logprobs_mode="processed_logprobs",
    )
    if cuda:  # unmeasured: no GPU was lent to this project's sessions (docs/benchmarks.md, "Not measured")
        arguments["gpu_memory_utilization"] = rollout.gpu_memory_utilization
    else:
        arguments["kv_cache_memory_bytes"] = int(rollout.kv_cache_gib * 2**30)
        cores = config.cores_of("rollout", worker_index)
        if cores or rollout.tensor_parallel_size > 1:  # vLLM's CPU backend binds its OpenMP threads: tell it where
            environment["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind(cores or sorted(os.sched_getaffinity(0)),
                                                                        rollout.tensor_parallel_size)
    return environment, arguments


def make_vllm_engine(config: TetherConfig, worker_index: int = 0):
    """A ``vllm.LLM`` with tether's worker extension, built as ``engine_settings`` says."""
    import torch

    environment, arguments = engine_settings(config, worker_index, torch.cuda.is_available())
    os.environ.update(environment)
    if environment.get("TORCHDYNAMO_DISABLE") == "1":  # torch read the variable when it was imported
        import torch._dynamo

        torch._dynamo.config.disable = True
    from vllm import LLM

    return LLM(**arguments)


@dataclass
class Generating:
    """A prompt in the engine: its place in the prompt stream, its row in the data file, and the
    policy version its first token was generated with (the oldest: weights may change before it ends)."""
    prompt_index: int
    data_row: int
    version: int


def to_samples(outputs, generating: list[Generating], last_version: int, id_prefix: str,
               counter: int) -> list[Sample]:
    """Samples of finished vLLM requests (a group of ``samples_per_prompt`` each), ``generating[i]``
    saying what ``outputs[i]`` was; ``last_version``: the weights the engine holds now, which
    generated each request's last token."""
    import numpy as np

    samples = []
    for request, prompt in zip(outputs, generating):
        for completion in request.outputs:
            tokens = list(completion.token_ids)
            logprobs = [entry[token].logprob for entry, token in zip(completion.logprobs, tokens)]
            samples.append(Sample(
                sample_id=f"{id_prefix}-{counter + len(samples)}",
                prompt_index=prompt.prompt_index,
                behavior_version=prompt.version,
                last_behavior_version=last_version,
                prompt_tokens=np.asarray(request.prompt_token_ids, dtype=np.int32),
                response_tokens=np.asarray(tokens, dtype=np.int32),
                behavior_logprobs=np.asarray(logprobs, dtype=np.float32),
                finish_reason="length" if completion.finish_reason == "length" else "stop",
                data_row=prompt.data_row,
            ))
    return samples


def sampling_params(config: TetherConfig, **overrides):
    """vLLM's sampling settings: ``config.sampling`` (which the learner's logprobs reproduce) and the
    rollout's lengths, with ``overrides`` (the evaluator's: one response, its own seed)."""
    from vllm import SamplingParams

    rollout = config.rollout
    sampling = config.sampling
    return SamplingParams(**{"n": rollout.samples_per_prompt, "temperature": sampling.temperature,
                             "top_p": sampling.top_p, "top_k": sampling.top_k, "max_tokens": rollout.max_new_tokens,
                             "ignore_eos": rollout.ignore_eos, "logprobs": 0, **overrides})


def apply_weights(engine, grant, staging, prefetcher, config: TetherConfig, log) -> tuple[int | None, str | None]:
    """Load the version the buffer announced: (the version now in the engine, None), or (None, why)
    when nothing of it could be read: the engine is then tagged with no version and generates
    nothing until a whole one loads. A load that failed part-way raises ``EngineNeedsRestart``."""
    started = time.monotonic()
    try:
        manifest = WeightManifest.from_dict(grant.fields["weights_manifest"])
        if staging is not None:  # another host: bring the buckets here first
            manifest = fetch_over_tcp(manifest, config.transport.weights_address, staging,
                                      max_frame_bytes=config.transport.max_frame_bytes, curve=config.transport.curve)
        checked = prefetcher is not None and prefetcher.checked(manifest)
        results = engine.collective_rpc("load_published_weights", args=(manifest.to_dict(), checked))
        refusals = [result["refused"] for result in results if "refused" in result]
        partial = [result["partial"] for result in results if "partial" in result]
        failures = [result["unreadable"] for result in results if "unreadable" in result]
        if refusals:
            raise IncompatibleWeights(
                f"models.policy: vLLM's model of {config.models.policy} cannot load the learner's weights "
                f"(policy version {manifest.policy_version}): {refusals[0]}. Every version would be refused the same "
                "way; the family's vLLM loader and the transformers model disagree on a parameter name")
        if partial:
            raise EngineNeedsRestart(f"loading policy version {manifest.policy_version} failed part-way ({partial[0]}): the "
                                     "engine holds a mix of versions and cannot generate; it must be started again")
        if failures:
            raise WeightStreamError(failures[0])
        # KV computed with the old weights must serve no token of the new ones: cached prefixes go, and
        # requests in flight are recomputed (vLLM preempts them, keeping their tokens so far), so every
        # token from here on is sampled from the new version
        engine.reset_prefix_cache(reset_running_requests=True)
        how = ("fetch over tcp and load" if staging is not None else
               "load from shared memory, checked while written" if checked else "load from shared memory")
        log.info("now generating with policy version %d (%.2fs to %s)", manifest.policy_version,
                 time.monotonic() - started, how)
        return grant.fields["policy_version"], None
    except (IncompatibleWeights, EngineNeedsRestart):
        raise
    except Exception as error:
        log.warning("could not load policy version %d: %s", grant.fields["policy_version"], error)
        return None, f"{type(error).__name__}: {error}"
    finally:
        if prefetcher is not None:
            prefetcher.release()


def run(config: TetherConfig, worker_index: int = 0, engine=None) -> None:
    """Engine ``worker_index`` of the rollout pool. ``engine``: an already built ``vllm.LLM``
    (benchmarks share one).

    Streaming: the engine is kept full. One credit request is held at the buffer while the engine
    has room; the prompts it grants join the engine between two of its steps, and each group that
    finishes is sent at once, so no response waits for the longest one of its grant. Newer weights
    come with a grant and are loaded between steps: requests in flight are recomputed with them
    and keep the version of their first token as ``behavior_version`` (the oldest, docs/design.md), the
    newest as ``last_behavior_version``."""
    name = f"rollout{worker_index}"
    log = setup_logging(name, config.log_level)
    timeline = StartupTimeline(config.run_dir, name)
    config = resolve_models(config, "rollout")
    from transformers import AutoTokenizer
    from vllm import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    timeline.phase("import")
    tokenizer = AutoTokenizer.from_pretrained(config.models.policy)
    prompts, data_rows, skipped = prompts_that_fit(config, tokenizer, log)
    timeline.phase("prompts")
    # the engine first: it is the longest part of anyone's start-up and needs nobody
    own_engine = engine is None
    engine = engine or make_vllm_engine(config, worker_index)
    timeline.phase("engine init")
    client = connect_to_buffer(config, "rollout", str(worker_index))
    timeline.phase("buffer connect")
    rollout_cfg = config.rollout
    sampling = sampling_params(config, output_kind=RequestOutputKind.FINAL_ONLY)  # only finished requests come out
    metrics = MetricsWriter(config.run_dir, name)
    staging = prefetcher = None
    if config.transport.weight_transport == "tcp":
        staging = ShmWeightWriter(f"{config.weights_dir}-{name}", config.transport.weight_bucket_mb << 20)
    else:
        prefetcher = WeightPrefetcher(config.weights_stream_address)
    id_prefix = uuid.uuid4().hex[:8]
    log.info("generating with %s, %d prompts, %d samples per prompt, up to %d prompts at once", config.models.policy,
             len(prompts), rollout_cfg.samples_per_prompt, rollout_cfg.prompts_per_generate)

    version = 0  # the policy version the engine holds; None after a failed load: no new prompt joins then
    failures = 0  # weight loads failed in a row
    retry_at = 0.0  # after a failed load, the next credit request waits until then (backing off)
    in_flight: dict[str, Generating] = {}  # vLLM request id -> its prompt
    queued: list[int] = []  # prompt indices granted and not yet in the engine (waiting for a whole version)
    credit_request = None  # the id of the credit request held at the buffer, if any
    unacknowledged: list[int] = []  # samples messages sent, their acks not read yet
    generated = requests_added = 0
    period = RolloutPeriod(time.monotonic())
    while True:
        # 1. while the engine has room, one credit request waits at the buffer (it answers when it can grant,
        #    or at once with newer weights for an engine that holds none)
        room = rollout_cfg.prompts_per_generate - len(in_flight) - len(queued)
        messaging_started = time.monotonic()  # requests and polls to the buffer count as sending
        if credit_request is None and (room > 0 or version is None) and time.monotonic() >= retry_at:
            credit_request = client.send("credit_request", {
                "policy_version": -1 if version is None else version,
                "wanted": 0 if version is None else room * rollout_cfg.samples_per_prompt})
        # 2. its answer: waited for when the engine has nothing to do, only looked for between steps otherwise
        grant = None
        if credit_request is not None and in_flight:
            grant = client.poll(credit_request)
        period.send_s += time.monotonic() - messaging_started
        waited = time.monotonic()
        if credit_request is not None and not in_flight:
            grant = client.wait(credit_request, waiting_for="generation credits")
        elif not in_flight:  # backing off after a failed load, nothing to generate meanwhile
            time.sleep(max(0.0, retry_at - time.monotonic()))
        period.waiting_s += time.monotonic() - waited
        if grant is not None:
            credit_request = None
            if grant.fields["stop"]:
                break
            # positions in the run's prompt stream, each handed out once; a newer version may generate them
            queued += grant.fields["prompt_indices"]
            if version is None or grant.fields["policy_version"] > version:
                sync_started = time.monotonic()
                version, error = apply_weights(engine, grant, staging, prefetcher, config, log)
                period.weight_sync_s += time.monotonic() - sync_started
                if error is not None:
                    failures += 1
                    client.request("weights_refused", {"policy_version": grant.fields["policy_version"],
                                                       "failures": failures, "reason": error})
                    if failures >= rollout_cfg.max_weight_load_failures:
                        raise WeightsNotLoading(f"{failures} loads of the learner's weights in a row failed "
                                                f"(rollout.max_weight_load_failures); the last, of policy version "
                                                f"{grant.fields['policy_version']}: {error}")
                    retry_at = time.monotonic() + min(30.0, REFUSED_WEIGHTS_BACKOFF_S * 2 ** (failures - 1))
                else:
                    failures = 0
        # 3. granted prompts join the engine, with the version it holds
        if version is not None and queued:
            adding_started = time.monotonic()  # the engine takes each request in: generation work
            for index in queued:
                row = dataset_row(config.seed, len(prompts), index)
                request_id = str(requests_added)
                requests_added += 1
                engine.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompts[row]), sampling)
                in_flight[request_id] = Generating(index, data_rows[row], version)
            queued = []
            period.busy_s += time.monotonic() - adding_started
        # 4. one engine step; what finished in it is sent at once (acks are read as they come)
        if in_flight:
            step_started = time.monotonic()
            period.engine_steps += 1
            period.requests_stepped += len(in_flight)
            finished = [output for output in engine.llm_engine.step() if output.finished]
            period.busy_s += time.monotonic() - step_started
            if finished:
                send_started = time.monotonic()
                samples = to_samples(finished, [in_flight.pop(output.request_id) for output in finished], version,
                                     id_prefix, generated)
                if not generated:
                    timeline.phase("first samples")  # credits, weights and the first groups generated
                unacknowledged.append(client.send("samples", *pack_samples(samples)))
                generated += len(samples)
                period.add(samples)
                period.send_s += time.monotonic() - send_started
        polling_started = time.monotonic()
        unacknowledged = [request for request in unacknowledged if client.poll(request) is None]
        period.send_s += time.monotonic() - polling_started
        # 5. a record a second, and whenever the engine runs dry
        now = time.monotonic()
        if now - period.started >= METRICS_EVERY_S or (not in_flight and period.samples):
            metrics.write({"step": version if version is not None else -1, "generated_total": generated,
                           "in_flight": len(in_flight), "prompts_skipped": skipped, **period.record(now),
                           **client.counters})
            period = RolloutPeriod(now)
    log.info("stopping after %d samples at policy version %s", generated, version)
    if in_flight:  # the run is over: what is still generating is of no use
        engine.llm_engine.abort_request(list(in_flight))
    if staging is not None:
        staging.close(remove=True)
    if prefetcher is not None:
        prefetcher.close()
    metrics.close()
    client.close()
    # vLLM's engine process and workers, where it has them, exit now, reaped by this process rather
    # than left to init. An engine inside this process with one worker has none: its shutdown, a
    # gc.collect over the whole heap (1.4 s here), would only delay the exit that follows.
    in_this_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and rollout_cfg.tensor_parallel_size == 1
    if own_engine and not in_this_process:
        engine.llm_engine.engine_core.shutdown()


METRICS_EVERY_S = 1.0


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
