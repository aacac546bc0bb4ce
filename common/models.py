"""Where a role finds its models: a local directory or a Hugging Face hub id, resolved the same
way by every role, and whether two models read the same tokens.

A hub id is fetched once into the local Hugging Face cache (``HF_HOME``; ``HF_HUB_OFFLINE=1``
uses only what is there) and the role then loads the snapshot directory, so vLLM, transformers
and the learner's checkpoint (which copies the policy's tokenizer files) all read one place.
"""

from __future__ import annotations

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

    try:
        directory = snapshot_download(repo_id=name, allow_patterns=HUB_FILES)
        if not any(file.endswith(".safetensors") for file in os.listdir(directory)):  # an older repo
            directory = snapshot_download(repo_id=name, allow_patterns=[*HUB_FILES, "*.bin"])
    except Exception as error:  # not an id (HFValidationError), unknown, no network, no cache entry
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"{key}: {name!r} is not a directory, and as a Hugging Face hub id it cannot be had "
                          f"here ({type(error).__name__}: {reason})") from None
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
    return config.model_copy(update={"models": models.model_copy(update=resolved)})


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
