"""Prompts and chats that show images: a row's chat as a processor's chat template takes it (an
image part ``{"type": "image"}`` where it stands), its text with one placeholder per image, and
the prompts of a data file that fit, with their images' bytes (``prompts_with_images``, for any
policy: a text one's are ``common.prompts.prompts_within``').
"""

from __future__ import annotations

from typing import Any

from common.config import ConfigError
from common.images import read_images
from common.processors import check_placeholders, expanded_ids
from common.prompts import chat_of, image_paths, prompts_within


def template_chat(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as a processor's chat template takes them: each content a list of parts, text as
    ``{"type": "text", "text": ...}``, an image as ``{"type": "image"}`` where it stands (the
    template writes its placeholder there)."""
    return [{**message, "content": [{"type": "text", "text": content}] if isinstance(content := message["content"], str)
             else [{"type": "image"} if part["type"] in ("image", "image_url") else part for part in content]}
            for message in messages]


def vision_chat(row: dict[str, Any], processor, system_prompt: str | None = None) -> list[dict[str, Any]] | None:
    """The row's chat as the processor's chat template takes it (None for a text prompt): each
    content a list of parts, an image part ``{"type": "image"}`` where it stands, or the row's
    ``"images"`` opening its first user message. The images are in the order of ``image_paths``."""
    chat = chat_of(row, system_prompt)
    if chat is None:
        return None
    messages = [{"role": message["role"], "content": message["content"]} for message in template_chat(chat)]
    if row.get("images"):
        first_user = next(i for i, message in enumerate(chat) if message["role"] == "user")
        messages[first_user]["content"][:0] = [{"type": "image"}] * len(image_paths(row))
    return messages


def images_shown(messages: list[dict[str, Any]]) -> int:
    """How many image parts ``vision_chat``'s ``messages`` hold."""
    return sum(part["type"] == "image" for message in messages for part in message["content"])


def vision_prompt_text(row: dict[str, Any], processor, system_prompt: str | None = None,
                       response: str | None = None, tools: list[dict] | None = None) -> str:
    """The prompt's text with one placeholder per image (``processor.image_token``): a text prompt
    with its ``"images"`` before its text; a chat (``vision_chat``) through the processor's chat
    template with the generation prompt (and the ``tools`` schemas, as a text chat has them). With
    a ``response`` (a chat only): the chat and the response as the assistant's turn."""
    messages = vision_chat(row, processor, system_prompt)
    if messages is None:
        return processor.image_token * len(image_paths(row)) + row["prompt"]
    if response is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": response}]})
    return processor.apply_chat_template(messages, add_generation_prompt=response is None, tokenize=False,
                                         **({"tools": tools} if tools else {}))


def vision_prompt_ids(text: str, row: dict[str, Any], processor) -> list[int]:
    """``vision_prompt_text``'s token ids: a text prompt with the tokenizer's special tokens, a chat
    as its template wrote it (which holds any it wants: adding them again would double a BOS)."""
    return list(processor.tokenizer(text, add_special_tokens=chat_of(row, None) is None)["input_ids"])


def prompts_with_images(rows: list[dict[str, Any]], tokenizer, processor, limit: int, system_prompt: str | None,
                        key: str, path: str, tools: list[dict] | None = None
                        ) -> tuple[list[list[int]], list[int], list[list[bytes]] | None]:
    """The prompts that fit, for any policy: with its ``processor`` (one that sees) ``vision_prompts``'
    ids, rows and images; else ``common.prompts.prompts_within``'s ids and rows, and None."""
    if processor is not None:
        return vision_prompts(rows, processor, limit, system_prompt, key, path, tools)
    return (*prompts_within(rows, tokenizer, limit, system_prompt, key, path, tools), None)


def vision_prompts(rows: list[dict[str, Any]], processor, limit: int, system_prompt: str | None, key: str,
                   path: str, tools: list[dict] | None = None) -> tuple[list[list[int]], list[int], list[list[bytes]]]:
    """``prompts_within`` for a policy that sees: the token ids of the rows (of ``path``, config key
    ``key``) whose prompt, each image expanded into its tokens, is at most ``limit`` tokens long
    (one placeholder per image, unexpanded: vLLM expands them; a chat rendered with the ``tools``
    schemas), those rows' indices, and their images' bytes. A row whose images alone pass the limit
    is an error naming it; a longer text is left out, as a text prompt is."""
    # an image's tokens, by its bytes: each placeholder's expansion depends on its image alone, so the
    # processor runs once per distinct image, not once per row (the vision demo's 4096 rows of 48
    # images: 4.6 s -> 0.3 s)
    tokens_of: dict[bytes, int] = {}
    read: dict[str, bytes] = {}
    token_ids, kept, images = [], [], []
    for row_index, row in enumerate(rows):
        where = f"prompt {row_index + 1}"
        row_images = read_images(row, path, where, key, read)
        text = vision_prompt_text(row, processor, system_prompt, tools=tools)
        try:
            check_placeholders(text, row_images, processor)
        except ConfigError as error:
            raise ConfigError(f"{key}: {path} {where}: {error}") from None
        ids = vision_prompt_ids(text, row, processor)
        for image in row_images:
            if image not in tokens_of:
                tokens_of[image] = len(expanded_ids(processor, processor.image_token, [image], False))
        image_tokens = sum(tokens_of[image] for image in row_images)
        if image_tokens > limit:
            raise ConfigError(f"{key}: {path} {where}: its {len(row_images)} image(s) take "
                              f"{image_tokens - len(row_images)} more tokens than the prompt's text, past the {limit} "
                              "a prompt may have (rollout.max_model_len - max_new_tokens): smaller images, or a "
                              "longer max_model_len")
        if len(ids) - len(row_images) + image_tokens <= limit:
            token_ids.append(ids)
            kept.append(row_index)
            images.append(row_images)
    if not kept:
        raise ConfigError(f"{key}: no prompt of {path} fits in {limit} tokens with its images")
    return token_ids, kept, images
