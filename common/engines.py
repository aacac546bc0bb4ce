"""Building and driving a vLLM engine, for whatever role generates with one: the rollout's policy
and the scorer's judges (``scorer.judges``). A role says what it wants in an ``EngineSpec``; the
environment and ``vllm.LLM`` arguments that make it fastest on the device follow from it here.
``InFlight`` is the cycle every driver repeats: add requests, step the engine, hand each finished
request back with what its sender said it was."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Protocol


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


@dataclass(frozen=True)
class EngineSpec:
    """What one engine is to run and with which memory; None for in_process and enforce_eager: the
    fastest for the device (``engine_settings``)."""
    model: str
    dtype: str
    seed: int
    max_model_len: int | None
    kv_cache_gib: float  # the KV cache on the CPU
    gpu_memory_utilization: float  # the device's share on a GPU
    tensor_parallel_size: int = 1
    in_process: bool | None = None
    enforce_eager: bool | None = None
    cores: list[int] = field(default_factory=list)  # the CPU cores it may use; empty: all the process has
    sleep_mode: bool = False  # a GPU engine that frees its memory between shifts (colocated)


def engine_settings(spec: EngineSpec, cuda: bool) -> tuple[dict[str, str], dict]:
    """The environment and ``vllm.LLM`` arguments of ``spec``'s engine, built the fastest way the
    device allows (measured on CPU, docs/benchmarks.md "Start-up"):
    - in-process: vLLM's V1 engine otherwise runs as three processes that each import vLLM (~10 s
      apiece here); on CPU it runs in the caller's own. On GPUs vLLM's separate engine process
      overlaps scheduling with the GPU's work, so it stays the default there.
    - eager: on CPU there are no CUDA graphs to capture, and torch.compile only traced vLLM's
      logprob-rank helper, 2.2 s at the first generate for nothing; with dynamo off it runs as plain
      torch. On GPUs graphs are much of vLLM's speed: off by default there.
    - the KV cache: a size in bytes on CPU (any fraction of a GiB), a memory share on GPUs.
    - logprobs of the distribution actually sampled (after temperature, top-k, top-p, allowed
      tokens), the one the learner recomputes and a judge's verdicts are read from; vLLM's default
      is the raw logits' distribution."""
    in_process = spec.in_process if spec.in_process is not None else (not cuda and spec.tensor_parallel_size == 1)
    eager = spec.enforce_eager if spec.enforce_eager is not None else not cuda
    environment = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1"}
    if eager:
        environment["TORCHDYNAMO_DISABLE"] = "1"  # also for the engine's own processes, when it has them
    arguments = dict(model=spec.model, dtype=spec.dtype, seed=spec.seed, max_model_len=spec.max_model_len,
                     tensor_parallel_size=spec.tensor_parallel_size, enforce_eager=eager,
                     logprobs_mode="processed_logprobs")
    if cuda:  # unmeasured: no GPU was lent to this project's sessions (docs/benchmarks.md, "Not measured")
        arguments["gpu_memory_utilization"] = spec.gpu_memory_utilization
        arguments["enable_sleep_mode"] = spec.sleep_mode  # vLLM refuses sleep mode on the CPU
    else:
        arguments["kv_cache_memory_bytes"] = int(spec.kv_cache_gib * 2**30)
        if spec.cores or spec.tensor_parallel_size > 1:  # vLLM's CPU backend binds its OpenMP threads: tell it where
            environment["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind(spec.cores or sorted(os.sched_getaffinity(0)),
                                                                        spec.tensor_parallel_size)
    return environment, arguments


def make_engine(environment: dict[str, str], arguments: dict, **overrides):
    """A ``vllm.LLM`` of ``engine_settings``' environment and arguments, with ``overrides``."""
    os.environ.update(environment)
    if environment.get("TORCHDYNAMO_DISABLE") == "1":  # torch read the variable when it was imported
        import torch._dynamo

        torch._dynamo.config.disable = True
    from vllm import LLM

    return LLM(**{**arguments, **overrides})


class Requester(Protocol):
    """What ``InFlight`` drives: it says what to add, and takes each finished request back.
    ``what`` is the requester's own handle on a request (a prompt, an episode's turn, a judge's
    question), given back with the request's output."""

    def take_ready(self, version: int) -> list[tuple[Any, list[int], Any]]:
        """(what, prompt token ids, sampling params) of each request to add to the engine now."""

    def turn_finished(self, what: Any, output: Any, version: int) -> None:
        """A request's finished vLLM output; ``version``: the weights that generated its last token."""


class InFlight:
    """The requests in a vLLM engine and, for each, what the requester said it is."""

    def __init__(self, engine) -> None:
        from vllm import TokensPrompt

        self.engine, self.TokensPrompt = engine, TokensPrompt
        self.requests: dict[str, Any] = {}
        self.added = 0

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, requester: Requester, version: int = 0, lora_request=None) -> None:
        """Every request ``requester`` has ready joins the engine (between two of its steps), with
        the policy's LoRA adapter where a version is one (``learner.lora_sync: adapters``)."""
        from common.images import decoded

        for what, ids, sampling in requester.take_ready(version):
            request_id = str(self.added)
            self.added += 1
            images = getattr(what, "images", None)  # unexpanded placeholders in ids: vLLM expands each image's
            prompt = (self.TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": decoded(images)}) if images
                      else self.TokensPrompt(prompt_token_ids=ids))
            self.engine.llm_engine.add_request(request_id, prompt, sampling, lora_request=lora_request)
            self.requests[request_id] = what

    def step(self, requester: Requester, version: int = 0) -> None:
        """One engine step; each request it finishes goes back to ``requester``."""
        for output in self.engine.llm_engine.step():
            if output.finished:
                requester.turn_finished(self.requests.pop(output.request_id), output, version)

    def abort(self) -> None:
        if self.requests:
            self.engine.llm_engine.abort_request(list(self.requests))
            self.requests = {}
