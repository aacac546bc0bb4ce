"""Where each model tether runs is: a local directory or a Hugging Face hub id, resolved the same
way by every role and by ``tether run`` before it starts them (without torch: this module imports
none, so the launcher starts the roles at once).

A hub id is fetched once into the local Hugging Face cache (``HF_HOME``; ``HF_HUB_OFFLINE=1``
uses only what is there) and the role then loads the snapshot directory, so vLLM, transformers
and the learner's checkpoint (which copies the policy's tokenizer files) all read one place.
"""

from __future__ import annotations

import os

from common import verifiers_data
from common.config import ConfigError, TetherConfig
from common.lengths import max_model_len

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


def check_prompts_source(prompts: str, key: str = "data.prompts") -> None:
    """A prompts source (``key``) is a file, or ``verifiers:<id>``: an environment's dataset, which
    has no file (``common.prompts.read_rows`` reads it, and says what is wrong with it)."""
    if verifiers_data.environment_id(prompts) is None and not os.path.isfile(prompts):
        raise ConfigError(f"{key}: {prompts} does not exist (a JSON-lines or Parquet file, or verifiers:<id>)")


def resolve_models(config: TetherConfig, role: str) -> TetherConfig:
    """The config with the models ``role`` loads as local directories, and the files it reads
    checked; errors name the config key. The buffer loads no model."""
    models = config.models
    keys = {
        "rollout": ["policy"],
        "scorer": ["policy", *(["reference"] if models.reference else []), *(["reward"] if models.reward else []),
                   *(["teacher"] if models.teacher else [])],
        "learner": ["policy", *(["reward"] if models.reward and models.critic_init != "policy" else [])],
        "buffer": [],
    }[role]
    resolved = {key: local_model_dir(f"models.{key}", getattr(models, key)) for key in keys}
    if role in ("rollout", "scorer"):
        check_prompts_source(config.data.prompts)
    config = config.model_copy(update={"models": models.model_copy(update=resolved)})
    if "policy" not in resolved:
        return config
    length = max_model_len(config)
    budget = config.learner.max_tokens_per_microbatch
    if budget is not None and budget < length:
        raise ConfigError(f"learner.max_tokens_per_microbatch ({budget}) is less than rollout.max_model_len ({length}, "
                          "what the policy allows where unset): a sequence that long would not fit in one pass")
    return config.model_copy(update={"rollout": config.rollout.model_copy(update={"max_model_len": length})})
