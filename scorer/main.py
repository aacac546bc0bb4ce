"""The scorer's loop: ask the buffer for samples, score them, send them back."""

from __future__ import annotations

import importlib
import time

import torch

from protocol.config import ConfigError, TetherConfig, check_paths
from protocol.runlog import MetricsWriter, setup_logging
from protocol.samples import pack_samples, unpack_samples
from protocol.transport import BufferClient


def load_function(spec: str):
    """``module:function`` -> the function; the error names the config key."""
    module_name, _, function_name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError, ValueError):
        raise ConfigError(f"scorer.gold_reward: cannot import {spec!r} (expected module:function)") from None


def run(config: TetherConfig, worker_index: int = 0) -> None:
    log = setup_logging(f"scorer{worker_index}", config.log_level)
    check_paths(config, "scorer")
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from protocol.sequences import disable_dropout
    from scorer.scoring import reference_logprobs, reward_scores

    device = "cuda" if torch.cuda.is_available() else "cpu"
    reference = disable_dropout(AutoModelForCausalLM.from_pretrained(config.reference_path, dtype=torch.float32)).to(device).eval()
    reward_model = disable_dropout(AutoModelForSequenceClassification.from_pretrained(
        config.models.reward, num_labels=1, dtype=torch.float32)).to(device).eval()
    pad_token_id = reference.config.pad_token_id if reference.config.pad_token_id is not None else 0
    gold_reward = load_function(config.scorer.gold_reward) if config.scorer.gold_reward else None
    metrics = MetricsWriter(config.run_dir, f"scorer{worker_index}")
    client = BufferClient(config.buffer_address, "scorer", str(worker_index), config.transport.max_frame_bytes,
                          config.transport.curve)
    client.connect(config.transport.connect_retries, config.transport.connect_interval_s)
    log.info("scoring with reference %s and reward model %s on %s", config.reference_path, config.models.reward, device)

    scored_total = 0
    period_started = time.monotonic()  # a period: from one record to the next, so the periods tile the run
    while True:
        work = client.request("score_request", {"max_samples": config.scorer.max_samples_per_request},
                              waiting_for="samples to score")
        if work.fields["stop"]:
            break
        samples = unpack_samples(work)
        busy_started = time.monotonic()
        for sample, ref in zip(samples, reference_logprobs(reference, samples, pad_token_id, config.rollout.temperature)):
            sample.ref_logprobs = ref.numpy()
        for sample, score in zip(samples, reward_scores(reward_model, samples, pad_token_id).tolist()):
            sample.rm_score = score
        if gold_reward is not None:
            for sample in samples:
                sample.gold_score = float(gold_reward(sample.prompt_tokens.tolist(), sample.response_tokens.tolist()))
        busy_s = time.monotonic() - busy_started
        client.request("scored", *pack_samples(samples, scored=True))
        scored_total += len(samples)
        tokens = sum(len(s.prompt_tokens) + len(s.response_tokens) for s in samples)
        now = time.monotonic()
        metrics.write({"scored": len(samples), "scored_total": scored_total, "busy_s": busy_s,
                       "waiting_s": busy_started - period_started, "tokens_per_s": tokens / max(busy_s, 1e-9),
                       "send_s": now - busy_started - busy_s, "iteration_s": now - period_started})
        period_started = now
    log.info("stopping after %d scored samples", scored_total)
    metrics.close()
    client.close()
