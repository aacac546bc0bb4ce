"""The rollout's loop: ask for credits, take newer weights if there are some, generate, send."""

from __future__ import annotations

import math
import os
import time
import uuid

from protocol.config import ConfigError, TetherConfig
from protocol.models import resolve_models
from protocol.prompts import dataset_row, prompts_within, read_rows
from protocol.runlog import MetricsWriter, setup_logging
from protocol.samples import Sample, pack_samples
from protocol.transport import connect_to_buffer
from protocol.weight_server import fetch_over_tcp
from protocol.weight_stream import WeightPrefetcher
from protocol.weights import ShmWeightWriter, WeightManifest, WeightStreamError

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


def make_engine(config: TetherConfig, worker_index: int = 0):
    """A ``vllm.LLM`` with tether's worker extension; placement and KV cache from the config."""
    import torch

    cores = config.cores_of("rollout", worker_index)
    tensor_parallel = config.rollout.tensor_parallel_size
    if cores or tensor_parallel > 1:  # vLLM's CPU backend binds its OpenMP threads itself; tell it where
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind(cores or sorted(os.sched_getaffinity(0)),
                                                                   tensor_parallel)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(config.rollout.kv_cache_gib))))
    from vllm import LLM

    options = {}
    if torch.cuda.is_available():
        options["gpu_memory_utilization"] = config.rollout.gpu_memory_utilization
    return LLM(
        model=config.models.policy,
        dtype=config.rollout.dtype,
        seed=config.seed,
        max_model_len=config.rollout.max_model_len,
        tensor_parallel_size=config.rollout.tensor_parallel_size,
        enforce_eager=True,
        worker_extension_cls="rollout.worker_extension.WeightSyncExtension",
        # Logprobs of the distribution actually sampled (after temperature, top-k, top-p), the one the
        # learner recomputes; vLLM's default is the raw logits' distribution.
        logprobs_mode="processed_logprobs",
        **options,
    )


def to_samples(outputs, prompt_indices: list[int], data_rows: list[int], version: int, id_prefix: str,
               counter: int) -> list[Sample]:
    import numpy as np

    samples = []
    for request, prompt_index, data_row in zip(outputs, prompt_indices, data_rows):
        for completion in request.outputs:
            tokens = list(completion.token_ids)
            logprobs = [entry[token].logprob for entry, token in zip(completion.logprobs, tokens)]
            samples.append(Sample(
                sample_id=f"{id_prefix}-{counter + len(samples)}",
                prompt_index=prompt_index,
                behavior_version=version,
                prompt_tokens=np.asarray(request.prompt_token_ids, dtype=np.int32),
                response_tokens=np.asarray(tokens, dtype=np.int32),
                behavior_logprobs=np.asarray(logprobs, dtype=np.float32),
                finish_reason="length" if completion.finish_reason == "length" else "stop",
                data_row=data_row,
            ))
    return samples


def sampling_params(config: TetherConfig, **overrides):
    """vLLM's sampling settings from ``config.rollout`` (the learner reproduces temperature, top-p
    and top-k), with ``overrides`` (the evaluator's: one response, its own seed)."""
    from vllm import SamplingParams

    rollout = config.rollout
    return SamplingParams(**{"n": rollout.samples_per_prompt, "temperature": rollout.temperature,
                             "top_p": rollout.top_p, "top_k": rollout.top_k, "max_tokens": rollout.max_new_tokens,
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
                f"(policy version {manifest.version}): {refusals[0]}. Every version would be refused the same "
                "way; the family's vLLM loader and the transformers model disagree on a parameter name")
        if partial:
            raise EngineNeedsRestart(f"loading policy version {manifest.version} failed part-way ({partial[0]}): the "
                                     "engine holds a mix of versions and cannot generate; it must be started again")
        if failures:
            raise WeightStreamError(failures[0])
        how = ("fetch over tcp and load" if staging is not None else
               "load from shared memory, checked while written" if checked else "load from shared memory")
        log.info("now generating with policy version %d (%.2fs to %s)", manifest.version,
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
    (benchmarks share one)."""
    name = f"rollout{worker_index}"
    log = setup_logging(name, config.log_level)
    config = resolve_models(config, "rollout")
    client = connect_to_buffer(config, "rollout", str(worker_index))

    from transformers import AutoTokenizer
    from vllm import TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(config.models.policy)
    prompts, data_rows, skipped = prompts_that_fit(config, tokenizer, log)
    own_engine = engine is None
    engine = engine or make_engine(config, worker_index)
    rollout_cfg = config.rollout
    sampling = sampling_params(config)
    metrics = MetricsWriter(config.run_dir, name)
    staging = prefetcher = None
    if config.transport.weight_transport == "tcp":
        staging = ShmWeightWriter(f"{config.weights_dir}-{name}", config.transport.weight_bucket_mb << 20)
    else:
        prefetcher = WeightPrefetcher(config.weights_stream_address)
    id_prefix = uuid.uuid4().hex[:8]
    version, generated = 0, 0
    wanted = rollout_cfg.prompts_per_generate * rollout_cfg.samples_per_prompt
    log.info("generating with %s, %d prompts, %d samples per prompt", config.models.policy, len(prompts),
             rollout_cfg.samples_per_prompt)

    period_started, sync_s = time.monotonic(), 0.0  # a period: from one record to the next
    failures = 0  # weight loads failed in a row; while any, the engine holds no whole version (version None)
    carried: list[int] = []  # prompt indices granted with a version whose successor failed to load: kept
    while True:
        # an engine without a whole version asks for weights only: the buffer answers with the newest at once
        grant = client.request("credit_request", {"policy_version": -1 if version is None else version,
                                                  "wanted": 0 if version is None else wanted},
                               waiting_for="generation credits")
        if grant.fields["stop"]:
            break
        # positions in the run's prompt stream, each handed out once; a newer version may generate them
        indices, carried = carried + grant.fields["prompt_indices"], []
        if version is None or grant.fields["policy_version"] > version:
            sync_started = time.monotonic()
            version, error = apply_weights(engine, grant, staging, prefetcher, config, log)
            sync_s += time.monotonic() - sync_started
            if error is not None:
                failures, carried = failures + 1, indices
                client.request("weights_refused", {"policy_version": grant.fields["policy_version"],
                                                   "failures": failures, "reason": error})
                if failures >= rollout_cfg.max_weight_load_failures:
                    raise WeightsNotLoading(f"{failures} loads of the learner's weights in a row failed "
                                            f"(rollout.max_weight_load_failures); the last, of policy version "
                                            f"{grant.fields['policy_version']}: {error}")
                time.sleep(min(30.0, REFUSED_WEIGHTS_BACKOFF_S * 2 ** (failures - 1)))
                continue
            failures = 0
        if not indices:
            continue
        busy_started = time.monotonic()
        rows = [dataset_row(config.seed, len(prompts), index) for index in indices]
        outputs = engine.generate([TokensPrompt(prompt_token_ids=prompts[row]) for row in rows],
                                  sampling, use_tqdm=False)
        samples = to_samples(outputs, indices, [data_rows[row] for row in rows], version, id_prefix, generated)
        send_started = time.monotonic()
        client.request("samples", *pack_samples(samples))
        generated += len(samples)
        tokens = sum(len(s.response_tokens) for s in samples)
        now = time.monotonic()
        metrics.write({"step": version, "samples": len(samples), "generated_total": generated,
                       "response_tokens": tokens, "tokens_per_s": tokens / max(send_started - busy_started, 1e-9),
                       "busy_s": send_started - busy_started, "weight_sync_s": sync_s, "send_s": now - send_started,
                       "waiting_s": busy_started - period_started - sync_s, "iteration_s": now - period_started,
                       "prompt_indices": indices, "prompts_skipped": skipped, **client.counters})
        period_started, sync_s = now, 0.0
    log.info("stopping after %d samples at policy version %s", generated, version)
    if staging is not None:
        staging.close(remove=True)
    if prefetcher is not None:
        prefetcher.close()
    metrics.close()
    client.close()
    if own_engine:  # its engine process and workers exit now, reaped by this process, not left to init
        engine.llm_engine.engine_core.shutdown()
