"""The rollout's vLLM engine: how it is built on each device, the sampled distribution it is
given, and loading a published policy version into it in place."""

from __future__ import annotations

import time
from typing import Any

from common.config import ConfigError, TetherConfig
from common.engines import EngineSpec, make_engine
from common.engines import engine_settings as common_engine_settings
from protocol.codec import cut
from weight_sync.buckets import ShmWeightWriter, WeightManifest, WeightStreamError, outside, read_manifest
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



def engine_settings(config: TetherConfig, worker_index: int, cuda: bool) -> tuple[dict[str, str], dict]:
    """The environment and ``vllm.LLM`` arguments of rollout engine ``worker_index``: the rollout's
    settings as ``common.engines.engine_settings`` builds any engine, with tether's worker
    extension (weights loaded in place)."""
    rollout = config.rollout
    spec = EngineSpec(model=config.models.policy, dtype=rollout.dtype, seed=config.seed,
                      max_model_len=rollout.max_model_len, kv_cache_gib=rollout.kv_cache_gib,
                      gpu_memory_utilization=rollout.gpu_memory_utilization,
                      tensor_parallel_size=rollout.tensor_parallel_size, in_process=rollout.in_process,
                      enforce_eager=rollout.enforce_eager, cores=config.cores_of("rollout", worker_index),
                      # colocated, the engine sleeps between its shifts (rollout.shifts.GenerateShift),
                      # freeing the GPU memory for the scorer and the learner
                      sleep_mode=config.colocated)
    environment, arguments = common_engine_settings(spec, cuda)
    return environment, {**arguments, "worker_extension_cls": "rollout.worker_extension.WeightSyncExtension"}


def make_vllm_engine(config: TetherConfig, worker_index: int = 0, **overrides):
    """A ``vllm.LLM`` with tether's worker extension, built as ``engine_settings`` says, with
    ``overrides`` of its arguments."""
    import torch

    return make_engine(*engine_settings(config, worker_index, torch.cuda.is_available()), **overrides)


def image_arguments(images: list[list[bytes]] | None, per_episode: int | None = None) -> dict[str, Any]:
    """vLLM's arguments for prompts with ``images`` (None: text): the most images one prompt has,
    or episodes may show (``per_episode``, ``rollout.max_images_per_episode``; None: single responses)."""
    if images is None:
        return {}
    return {"limit_mm_per_prompt": {"image": max(max(map(len, images), default=1), per_episode or 0) or 1}}


def banned_words(config: TetherConfig, tokenizer) -> list[str]:
    """``sampling.banned_tokens`` as vLLM's bad words (it takes text): each token's own text. vLLM
    bans what each word encodes to, with and without a space before it, so those must be the
    banned tokens exactly, or vLLM would ban others than the learner leaves out (a ConfigError)."""
    from vllm import SamplingParams
    from vllm.tokenizers.hf import get_cached_tokenizer

    banned = config.sampling.banned_tokens
    if not banned:
        return []
    words = [tokenizer.convert_ids_to_tokens(token) for token in banned]
    params = SamplingParams(bad_words=[word or "" for word in words])
    try:  # through the tokenizer as the engine holds it (its max_token_id is read)
        params.update_from_tokenizer(get_cached_tokenizer(tokenizer))
        encoded = params._bad_words_token_ids  # what vLLM's sampler bans: no public reader of it
    except ValueError as error:  # vLLM's validation: too many words, a word of no token
        raise ConfigError(f"sampling.banned_tokens: vLLM refuses them as bad words: {error}") from None
    if sorted(map(tuple, encoded)) != sorted((token,) for token in banned):
        raise ConfigError(f"sampling.banned_tokens: {list(banned)} are {words} to vLLM, which it would ban as "
                          f"{[list(ids) for ids in encoded]} (each also after a space), not these tokens alone: "
                          "a special token can be banned; part of a word cannot")
    return words


def sampling_params(config: TetherConfig, bad_words: list[str] = (), **overrides):
    """vLLM's sampling settings: ``config.sampling`` (which the learner's logprobs reproduce; its
    banned tokens as ``banned_words`` gave them) and the rollout's lengths, with ``overrides`` (the
    evaluator's: one response, its own seed)."""
    from vllm import SamplingParams

    rollout = config.rollout
    sampling = config.sampling
    if len(bad_words) != len(sampling.banned_tokens):  # the learner leaves them out: so must vLLM
        raise ValueError(f"sampling.banned_tokens {list(sampling.banned_tokens)} given to vLLM as {list(bad_words)}: "
                         "pass banned_words(config, tokenizer)")
    return SamplingParams(**{"n": rollout.samples_per_prompt, "temperature": sampling.temperature,
                             "top_p": sampling.top_p, "top_k": sampling.top_k, "max_tokens": rollout.max_new_tokens,
                             "ignore_eos": rollout.ignore_eos, "logprobs": 0,
                             # tether reads token ids and decodes what it needs itself: vLLM's text of each
                             # response and of each sampled token's logprob is work the engine's loop waits for
                             "detokenize": False,
                             **({"bad_words": list(bad_words)} if bad_words else {}), **overrides})


def apply_weights(engine, grant, staging, prefetcher, config: TetherConfig, log,
                  adapter=None) -> tuple[int | None, str | None]:
    """Load the version the buffer announced: (the version now in the engine, None), or (None, why)
    when nothing of it could be read: the engine is then tagged with no version and generates
    nothing until a whole one loads. A load that failed part-way raises ``EngineNeedsRestart``."""
    started = time.monotonic()
    try:
        manifest = WeightManifest.from_dict(grant.fields["weights_manifest"])
        if staging is not None:  # another host: bring the buckets here first
            manifest = fetch_over_tcp(manifest, config.transport.weights_address, staging,
                                      max_frame_bytes=config.transport.max_frame_bytes, curve=config.transport.curve)
        refused = outside(manifest, staging.directory if staging is not None else config.weights_dir)
        if refused:
            raise WeightStreamError(refused)
        checked = prefetcher is not None and prefetcher.checked(manifest)
        if adapter is not None:  # learner.lora_sync adapters: the version is the policy's LoRA adapter alone
            with read_manifest(manifest, verify=not checked) as tensors:
                try:
                    adapter.load(engine, manifest.policy_version, tensors)
                except ValueError as error:
                    raise IncompatibleWeights(f"learner.lora_sync: {error}") from None
            results = [{"tensors": len(adapter.names)}]
        else:
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
        # and the vision tower's features of each image seen, which vLLM keeps by the image's hash
        engine.llm_engine.reset_encoder_cache()
        how = ("fetch over tcp and load" if staging is not None else
               "load from shared memory, checked while written" if checked else "load from shared memory")
        how += " its LoRA adapter" if adapter is not None else ""
        log.info("now generating with policy version %d (%.2fs to %s)", manifest.policy_version,
                 time.monotonic() - started, how)
        return grant.fields["policy_version"], None
    except (IncompatibleWeights, EngineNeedsRestart):
        raise
    except Exception as error:  # WeightLoads.load says it, once it knows whether the run is still on
        return None, f"{type(error).__name__}: {error}"
    finally:
        if prefetcher is not None:
            prefetcher.release()




class WeightLoads:
    """Loading the versions the buffer announces into the engine (from shared memory, checked while
    written, or fetched over TCP from another host), and what a failed load means: the engine holds
    no version, the buffer is told, the next credit request waits (``retry_at``, backing off), and
    ``rollout.max_weight_load_failures`` failures in a row raise ``WeightsNotLoading``."""

    def __init__(self, engine, config: TetherConfig, name: str, log, adapter=None) -> None:
        self.engine, self.config, self.log, self.adapter = engine, config, log, adapter
        self.staging = self.prefetcher = None
        if config.transport.weight_transport == "tcp":
            self.staging = ShmWeightWriter(f"{config.weights_dir}-{name}", config.transport.weight_bucket_mb << 20)
        else:
            self.prefetcher = WeightPrefetcher(config.weights_stream_address, config.weights_dir)
        self.failures = 0  # loads failed in a row
        self.retry_at = 0.0  # after a failed load: no credit request before then

    def load(self, grant, client) -> int | None:
        """The version ``grant`` announces, into the engine: that version, or None when it failed."""
        version, error = apply_weights(self.engine, grant, self.staging, self.prefetcher, self.config, self.log,
                                       self.adapter)
        if error is None:
            self.failures = 0
            return version
        self.failures += 1
        announced = grant.fields["policy_version"]
        answer = client.request("weights_refused", {"policy_version": announced, "failures": self.failures,
                                                    "reason": cut(error)})
        if not answer.fields["accepted"]:  # the run is over: the learner's slots went with it, as expected
            self.log.info("the run finished while policy version %d was loading (%s)", announced, error)
            return None
        self.log.warning("could not load policy version %d: %s", announced, error)
        if self.failures >= self.config.rollout.max_weight_load_failures:
            raise WeightsNotLoading(f"{self.failures} loads of the learner's weights in a row failed "
                                    f"(rollout.max_weight_load_failures); the last, of policy version {announced}: "
                                    f"{error}")
        self.retry_at = time.monotonic() + min(30.0, REFUSED_WEIGHTS_BACKOFF_S * 2 ** (self.failures - 1))
        return None

    @property
    def lora_request(self):
        """What every request carries: the policy's adapter with ``learner.lora_sync`` adapters."""
        return self.adapter.request if self.adapter is not None else None

    def close(self) -> None:
        if self.adapter is not None:
            self.adapter.close()
        if self.staging is not None:
            self.staging.close(remove=True)
        if self.prefetcher is not None:
            self.prefetcher.close()
