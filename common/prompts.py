"""The run's prompts: the data file's rows, how a row becomes the tokens generated from, and
which row each position of the run's prompt stream holds.

A row is ``{"prompt": "..."}`` (text, tokenized as is) or ``{"messages": [{"role", "content"},
...]}`` (a chat, rendered by the policy tokenizer's chat template with the generation prompt);
other keys ride along for reward functions (an ``answer`` to check against). Files are JSON lines
or Parquet.

The buffer owns the stream: it hands out positions (``prompt_index`` on the wire and on every
sample) with the credits, each once, so no prompt is generated twice across rollout engines,
their restarts and ``--resume``. A rollout turns a position into a row of its prompt file with
``dataset_row``: pass ``e`` over the data is a shuffle seeded by ``(seed, e)``, so the order is a
function of ``seed`` alone and every engine agrees on it without talking to another.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import numpy as np

from common.config import ConfigError


@lru_cache(maxsize=4)
def _epoch_order(seed: int, size: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(size)


def dataset_row(seed: int, size: int, prompt_index: int) -> int:
    """Row of a data set of ``size`` prompts at position ``prompt_index`` of the stream."""
    if size < 1:
        raise ValueError(f"a prompt stream needs at least one prompt, got {size}")
    if prompt_index < 0:
        raise ValueError(f"prompt_index must be >= 0, got {prompt_index}")
    epoch, offset = divmod(prompt_index, size)
    return int(_epoch_order(seed, size, epoch)[offset])


def read_rows(path: str, key: str = "data.prompts") -> list[dict[str, Any]]:
    """Every row of a prompt file (config key ``key``), checked: each has a text ``prompt`` or a
    ``messages`` chat. The error names the key, the file and the line or row."""
    return read_records(path, key, _valid_row,
                        'has neither "prompt" (text) nor "messages" (a list of {"role": ..., "content": ...})')


def read_texts(path: str) -> list[dict[str, Any]]:
    """Every row of a PPO-ptx file (``data.ptx``), checked: each has a ``text``."""
    return read_records(path, "data.ptx", lambda row: isinstance(row, dict) and isinstance(row.get("text"), str),
                        'has no "text"')


def read_records(path: str, key: str, valid, problem: str) -> list[dict[str, Any]]:
    """The rows of a data file (config key ``key``): JSON lines (a ``.json`` file may also hold one
    list of rows) or Parquet. A row for which ``valid(row)`` is false is an error saying ``problem``,
    naming the key, the file and the line or row."""
    if path.endswith(".parquet"):
        import pyarrow.parquet

        try:
            rows = pyarrow.parquet.read_table(path).to_pylist()
        except Exception as error:  # not Parquet, damaged
            raise ConfigError(f"{key}: {path} does not read as Parquet: {error}") from None
        numbered = [(f"row {number}", row) for number, row in enumerate(rows, 1)]
    else:
        try:
            with open(path, encoding="utf-8") as file:
                text = file.read()
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"{key}: cannot read {path}: {error}") from None
        if path.endswith(".json") and text.lstrip().startswith("["):
            try:
                numbered = [(f"row {number}", row) for number, row in enumerate(json.loads(text), 1)]
            except json.JSONDecodeError as error:
                raise ConfigError(f"{key}: {path} is not JSON: {error}") from None
        else:
            numbered = []
            for number, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        numbered.append((f"line {number}", json.loads(line)))
                    except json.JSONDecodeError as error:
                        raise ConfigError(f"{key}: {path} line {number} is not JSON: {error}") from None
    for where, row in numbered:
        if not valid(row):
            raise ConfigError(f"{key}: {path} {where} {problem}")
    if not numbered:
        raise ConfigError(f"{key}: {path} holds no row")
    return [row for _, row in numbered]


def _valid_row(row: Any) -> bool:
    if not isinstance(row, dict):
        return False
    if isinstance(row.get("prompt"), str):
        return True
    messages = row.get("messages")
    return (isinstance(messages, list) and bool(messages)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages))


def chat_of(row: dict[str, Any], system_prompt: str | None) -> list[dict[str, str]] | None:
    """The row's chat with ``system_prompt`` first where it has no system message; None for a
    text prompt."""
    messages = row.get("messages") if not isinstance(row.get("prompt"), str) else None
    if messages is None:
        return None
    if system_prompt is not None and messages[0]["role"] != "system":
        return [{"role": "system", "content": system_prompt}, *messages]
    return list(messages)


def prompt_token_ids(row: dict[str, Any], tokenizer, system_prompt: str | None = None,
                     tools: list[dict] | None = None) -> list[int]:
    """The token ids the policy generates from for one row: a text prompt tokenized as is (with
    the tokenizer's special tokens), a chat through the tokenizer's chat template with the
    generation prompt added (and the ``tools``' JSON schemas, where the rollout has tools)."""
    chat = chat_of(row, system_prompt)
    if chat is None:
        return list(tokenizer(row["prompt"])["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError('data.prompts: a row is a chat ("messages") but the policy tokenizer has no chat template '
                          '(chat_template in tokenizer_config.json); give "prompt" text instead')
    try:
        ids = tokenizer.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=True)
    except Exception as error:  # the template's own checks (roles must alternate, no system role, ...)
        with_system = " (with data.system_prompt)" if system_prompt else ""
        raise ConfigError(f"data.prompts: the policy tokenizer's chat template refuses a chat{with_system}: "
                          f"{type(error).__name__}: {error}; chat: {json.dumps(chat)[:300]}") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def prompts_within(rows: list[dict[str, Any]], tokenizer, limit: int, system_prompt: str | None, key: str,
                   path: str, tools: list[dict] | None = None) -> tuple[list[list[int]], list[int]]:
    """Token ids of the rows (of ``path``, config key ``key``) whose prompt is at most ``limit``
    tokens long, and those rows' indices; the others are left out (vLLM would refuse them). None
    fitting is an error naming the key and the file."""
    token_ids, kept = [], []
    for row_index, row in enumerate(rows):
        ids = prompt_token_ids(row, tokenizer, system_prompt, tools)
        if 0 < len(ids) <= limit:
            token_ids.append(ids)
            kept.append(row_index)
    if not kept:
        raise ConfigError(f"{key}: none of the {len(rows)} prompts of {path} fits in rollout.max_model_len - "
                          f"rollout.max_new_tokens = {limit} tokens")
    return token_ids, kept
