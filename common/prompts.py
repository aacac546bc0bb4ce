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

from common import verifiers_data
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


def read_rows(path: str, key: str = "data.prompts", environment_args: dict[str, Any] | None = None
              ) -> list[dict[str, Any]]:
    """Every row of a prompt file (config key ``key``), checked: each has a text ``prompt`` or a
    ``messages`` chat. The error names the key, the file, the line or row, and what is wrong.
    ``verifiers:<id>`` (``verifiers:<id>#eval``): that verifiers environment's dataset (its eval
    dataset), the environment made with ``environment_args`` (``rollout.environment_args``;
    ``environments.verifiers_envs``)."""
    expected = '{"prompt": text} or {"messages": [{"role": ..., "content": ...}, ...]}'
    if verifiers_data.environment_id(path) is None:
        return read_records(path, key, prompt_problem, expected)
    rows = verifiers_data.dataset_rows(path, environment_args, key)
    numbered = [(f"row {number}", row) for number, row in enumerate(rows, 1)]
    return [row for _, row in checked_records(numbered, path, key, prompt_problem, expected)]


def read_texts(path: str) -> list[dict[str, Any]]:
    """Every row of a PPO-ptx file (``data.ptx``), checked: each has a ``text``."""
    return read_records(path, "data.ptx", lambda row: None if isinstance(row, dict) and isinstance(
        row.get("text"), str) else 'has no "text"', '{"text": text}')


def read_records(path: str, key: str, problem_of, expected: str) -> list[dict[str, Any]]:
    """The rows of a data file (config key ``key``), each checked by ``problem_of(row)``: None
    where the row is good, else what is wrong with it, for an error naming the key, the file, the
    line (or a Parquet or JSON list's row), the problem and the ``expected`` form."""
    return [row for _, row in numbered_records(path, key, problem_of, expected)]


def numbered_records(path: str, key: str, problem_of, expected: str) -> list[tuple[str, dict[str, Any]]]:
    """``read_records``' rows with where each is: ("line 5", row) in JSON lines (blank lines
    counted, as an editor counts them), ("row 3", row) in Parquet or a JSON list."""
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
    return checked_records(numbered, path, key, problem_of, expected)


def checked_records(numbered: list[tuple[str, Any]], path: str, key: str, problem_of, expected: str
                    ) -> list[tuple[str, dict[str, Any]]]:
    """``numbered`` rows (where each is, the row), each checked by ``problem_of``, and at least one."""
    for where, row in numbered:
        problem = problem_of(row)
        if problem:
            raise ConfigError(f"{key}: {path} {where} {problem}; a row is {expected}")
    if not numbered:
        raise ConfigError(f"{key}: {path} holds no row")
    return numbered


def keys_of(row: dict) -> str:
    """A row's keys, for an error that says what it has in place of what it lacks."""
    return f"(its keys: {', '.join(map(str, row)) or 'none'})"


def messages_problem(messages: Any) -> str | None:
    """What is wrong with a chat, or None: a non-empty list of {"role": text, "content": ...}, the
    content text or a list of parts (``content_problem``)."""
    if not isinstance(messages, list) or not messages:
        return f'has "messages" {json.dumps(messages)[:80]}, not a list of messages'
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f'has "messages"[{i}] {json.dumps(message)[:80]}, not a {{"role", "content"}} object'
        if not isinstance(message.get("role"), str):
            found = "no" if "role" not in message else f"a non-text {json.dumps(message['role'])[:40]} as"
            return f'has {found} "role" in "messages"[{i}] {keys_of(message)}'
        if "content" not in message:
            return f'has no "content" in "messages"[{i}] {keys_of(message)}'
        problem = content_problem(message["content"])
        if problem is not None:
            return f'has {problem} as "content" of "messages"[{i}]'
    return None


IMAGE_PART = 'an image part {"type": "image", "image": path} (or "path"; or OpenAI\'s "image_url": {"url": ...})'


def content_problem(content: Any) -> str | None:
    """What is wrong with a message's content, or None: text, or a list of parts in the OpenAI / HF
    form, each a text part {"type": "text", "text": ...} or an ``IMAGE_PART``."""
    if isinstance(content, str):
        return None
    if not isinstance(content, list):
        return f"a non-text {json.dumps(content)[:40]}"
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if kind in ("image", "image_url") and image_part_path(part) is not None:
            continue
        return (f"a list whose part {j} {json.dumps(part)[:80]} is neither a text part "
                f'{{"type": "text", "text": ...}} nor {IMAGE_PART}')
    return None


def image_part_path(part: dict[str, Any]) -> str | None:
    """The file (or data: URL) an image part names, or None where it names none."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        return url if isinstance(url, str) and url else None
    found = part.get("image", part.get("path", part.get("url")))
    return found if isinstance(found, str) and found else None


def content_text(content: str | list[dict[str, Any]]) -> str:
    """A message's content as text: itself, or its text parts a line each, as vLLM's OpenAI server
    joins them for a text model (its images left out)."""
    return content if isinstance(content, str) else "\n".join(part["text"] for part in content
                                                              if part.get("type") == "text")


def image_paths(row: dict[str, Any]) -> list[str]:
    """The images a row names, in the order the prompt shows them: its ``"images"`` (shown before
    the prompt's text) or its messages' image parts (where each stands); none for a text-only row.
    Each is a file path (relative to the data file) or a ``data:`` URL."""
    images = row.get("images", [])
    if not isinstance(images, list) or not all(isinstance(path, str) and path for path in images):
        raise ValueError(f'"images" must be a list of file paths, got {str(images)[:80]}')
    messages = row.get("messages") if not isinstance(row.get("prompt"), str) else None
    parts = [image_part_path(part) for message in messages or [] if isinstance(message.get("content"), list)
             for part in message["content"] if part.get("type") in ("image", "image_url")]
    if images and parts:
        raise ValueError('has both "images" and image parts in its messages: name each image once, where it stands')
    return images or parts


def text_chat(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``chat`` with each message's content as text (``content_text``), as a text model's template reads it."""
    return [{**message, "content": content_text(message["content"])} for message in chat]


def prompt_problem(row: Any) -> str | None:
    """What keeps ``row`` from being a prompt, or None: a text ``prompt`` or a ``messages`` chat."""
    if not isinstance(row, dict):
        return f"is {json.dumps(row)[:80]}, not a JSON object"
    if isinstance(row.get("prompt"), str):
        return None
    if "messages" in row:
        return messages_problem(row["messages"])
    if "prompt" in row:
        return f'has a non-text "prompt" {json.dumps(row["prompt"])[:80]}'
    return f'has no "prompt" and no "messages" {keys_of(row)}'


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
                     tools: list[dict] | None = None, model_key: str = "models.policy") -> list[int]:
    """The token ids the policy generates from for one row: a text prompt tokenized as is (with
    the tokenizer's special tokens), a chat through the tokenizer's chat template with the
    generation prompt added (and the ``tools``' JSON schemas, where the rollout has tools).
    ``model_key``: the config key of the model whose tokenizer this is, for the errors (the
    caller adds the data's key, file and line)."""
    try:
        images = image_paths(row)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if images:
        raise ConfigError(f"the row has images but {model_key} does not see images (its config has no vision tower)")
    chat = chat_of(row, system_prompt)
    if chat is None:
        return list(tokenizer(row["prompt"])["input_ids"])
    return chat_token_ids(tokenizer, chat, True, model_key, tools,
                          " (with data.system_prompt)" if system_prompt else "")


def chat_token_ids(tokenizer, chat: list[dict[str, Any]], generation_prompt: bool, model_key: str,
                   tools: list[dict] | None = None, note: str = "") -> list[int]:
    """``chat`` through the chat template of ``model_key``'s tokenizer, each content as text (a text
    model's template reads text; ``text_chat``); one it has not, or that its template refuses, is a
    ``ConfigError`` naming the model's key (a template's own exception, a Jinja traceback, would name
    neither)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f'a row is a chat ("messages") but the tokenizer of {model_key} has no chat template '
                          '(chat_template.jinja, or chat_template in tokenizer_config.json); give "prompt" text')
    try:
        ids = tokenizer.apply_chat_template(text_chat(chat), tools=tools, add_generation_prompt=generation_prompt,
                                            tokenize=True)
    except Exception as error:  # the template's own checks (roles must alternate, no system role, ...)
        raise ConfigError(f"the chat template of {model_key} refuses a chat{note}: {type(error).__name__}: "
                          f"{str(error)[:300]}; chat: {json.dumps(chat)[:300]}") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def prompts_within(rows: list[dict[str, Any]], tokenizer, limit: int, system_prompt: str | None, key: str,
                   path: str, tools: list[dict] | None = None) -> tuple[list[list[int]], list[int]]:
    """Token ids of the rows (of ``path``, config key ``key``) whose prompt is at most ``limit``
    tokens long, and those rows' indices; the others are left out (vLLM would refuse them). None
    fitting is an error naming the key and the file."""
    token_ids, kept = [], []
    for row_index, row in enumerate(rows):
        try:
            ids = prompt_token_ids(row, tokenizer, system_prompt, tools)
        except ConfigError as error:
            raise ConfigError(f"{key}: {path} prompt {row_index + 1}: {error}") from None
        if 0 < len(ids) <= limit:
            token_ids.append(ids)
            kept.append(row_index)
    if not kept:
        raise ConfigError(f"{key}: none of the {len(rows)} prompts of {path} fits in rollout.max_model_len - "
                          f"rollout.max_new_tokens = {limit} tokens")
    return token_ids, kept
