"""The stages' data: rows of a file become examples of token ids, each a group of sequences that go
through the model in one forward pass (a demonstration: one; a ranking: its K responses; a pair:
chosen and rejected).

A prompt is read as PPO reads it (``common.prompts``): ``"prompt"`` text tokenized with the
tokenizer's special tokens, or ``"messages"``, a chat rendered by the chat template with the
generation prompt. A response to a text prompt is its text and the end-of-sequence token, as the
rollout's responses end when they stop; a response to a chat is what the template writes for it
as the assistant's turn. So the reward model scores, and SFT teaches, the tokens PPO generates.

A model that sees images (``common.image_prompts``, ``common.processors``) reads a row's images
as the rollout does: its prompt holds each image's tokens as the processor expands them (the ids
vLLM reports), and the batch carries the images' pixel inputs (``model_inputs``).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from common.config import ConfigError
from common.prompts import (chat_of, chat_token_ids, keys_of, numbered_records, prompt_problem,
                            prompt_token_ids)


@dataclass
class Example:
    """One example: ``rows`` token-id sequences (prompt + response), ``loss_masks`` 1 at each row's
    tokens taught or scored (its response), and ``ranks`` (0 the best; equal: a tie), one a row."""
    rows: list[list[int]]
    loss_masks: list[list[int]]
    ranks: list[int]
    reference: torch.Tensor | None = None  # DPO: the reference's log pi(response | prompt) of each row
    images: list[bytes] = field(default_factory=list)  # its prompt's images, encoded (a model that sees)

    @property
    def cost(self) -> int:
        """Padded tokens of its forward pass alone: rows x longest."""
        return len(self.rows) * max(len(row) for row in self.rows)


def read_examples(path: str, key: str, tokenizer, form: str, max_len: int,
                  processor=None) -> tuple[list[Example], int]:
    """The examples of a stage's data file (config key ``key``) and how many rows were left out for
    passing ``max_len`` tokens (image tokens included). ``form``: "demonstration" (sft), "ranking"
    (rm) or "pair" (dpo). ``processor``: a model that sees (``seen_example``). A row of the wrong
    form, or a bad image, is an error naming the key, the file and the row."""
    from common.images import read_images
    from common.prompts import image_paths

    numbered = numbered_records(path, key, *FORMS[form])
    model_key = f"{key.split('.')[0]}.model"  # rm.data -> rm.model: whose tokenizer reads the rows
    examples, read = [], {}
    for where, row in numbered:
        images = read_images(row, path, where, key, read) if processor is not None else []  # names the row itself
        try:
            if processor is not None:
                example = seen_example(form, row, processor, images, model_key)
            elif image_paths(row):  # every form: a text model's chat template would drop them unseen
                raise ConfigError(f"the row has images but {model_key} does not see images (its config has no "
                                  "vision tower)")
            else:
                example = EXAMPLE_OF[form](row, tokenizer, model_key)
        except ValueError as error:  # ConfigError, and image_paths' "images" that is not a list of paths
            raise ConfigError(f"{key}: {path} {where}: {error}") from None
        if max(len(ids) for ids in example.rows) <= max_len and all(any(mask) for mask in example.loss_masks):
            examples.append(example)
    if not examples:
        raise ConfigError(f"{key}: none of the {len(numbered)} rows of {path} fits in {max_len} tokens (max_len)")
    return examples, len(numbered) - len(examples)


def model_inputs(examples: list[Example], pad_token_id: int, processor, device
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """(the model's inputs, input_ids [B, L], loss_mask [B, L]) of every row of ``examples`` on
    ``device``: ``padded``'s, and with a model's ``processor`` (one that sees) the pixel inputs of
    each row's prompt images. On one of several ranks, rows that show no image have the blank
    image's row after them (``training.blank_image.BlankImage``; its loss mask 0): B is one more than the
    examples' rows, and a caller that reads a figure a row reads the first ``rows_of(examples)``."""
    from common.images import decoded
    from common.processors import pixel_inputs
    from training import parallel
    from training.blank_image import blank_image

    input_ids, attention_mask, loss_mask = padded(examples, pad_token_id)
    shown = processor is not None and any(example.images for example in examples)
    blank = blank_image(processor) if processor is not None and not shown and parallel.world_size() > 1 else None
    if blank is not None:
        input_ids, attention_mask = blank.after(input_ids, attention_mask)
        loss_mask = torch.nn.functional.pad(loss_mask, (0, input_ids.shape[1] - loss_mask.shape[1], 0, 1))
    inputs = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
    if shown:
        pixels = pixel_inputs(processor, [decoded(e.images) for e in examples for _ in e.rows])
        inputs.update({name: value.to(device) for name, value in pixels.items()})
    elif blank is not None:
        inputs.update(blank.inputs(rows_of(examples), device))
    return inputs, inputs["input_ids"], loss_mask.to(device)


def rows_of(examples: list[Example]) -> int:
    """How many rows ``examples`` have (a response each)."""
    return sum(len(example.rows) for example in examples)


def held_out(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, held out): ``fraction`` of ``examples`` drawn by ``seed``, at least one each when
    ``fraction`` > 0."""
    if fraction <= 0:
        return examples, []
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    count = min(len(examples) - 1, max(1, round(fraction * len(examples))))
    chosen = set(order[:count])
    return ([e for i, e in enumerate(examples) if i not in chosen], [e for i, e in enumerate(examples) if i in chosen])


def padded(examples: list[Example], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row of ``examples`` in order, right-padded: (input_ids [B, L], attention_mask [B, L],
    loss_mask [B, L]), B the examples' rows together."""
    rows = [row for example in examples for row in example.rows]
    masks = [mask for example in examples for mask in example.loss_masks]
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, mask) in enumerate(zip(rows, masks)):
        input_ids[i, :len(row)] = torch.tensor(row)
        attention_mask[i, :len(row)] = 1
        loss_mask[i, :len(mask)] = torch.tensor(mask)
    return input_ids, attention_mask, loss_mask


# --------------------------------------------------------------------------- rows -> examples


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def _texts_problem(row: dict, *keys: str) -> str | None:
    for key in keys:
        if not _is_text(row.get(key)):
            return f'has no "{key}" text {keys_of(row)}' if key not in row else f'has a non-text "{key}"'
    return None


def _demonstration_problem(row: Any) -> str | None:
    problem = prompt_problem(row)
    if problem or not _is_text(row.get("prompt")):  # a chat teaches its assistant turns
        return problem
    return _texts_problem(row, "response")


def _ranking_problem(row: Any) -> str | None:
    problem = prompt_problem(row)
    if problem:
        return problem
    if "responses" not in row and "ranking" not in row:
        return _texts_problem(row, "chosen", "rejected")
    responses, ranking = row.get("responses"), row.get("ranking")
    if not isinstance(responses, list) or len(responses) < 2 or not all(map(_is_text, responses)):
        return f'has "responses" {json.dumps(responses)[:80]}, not a list of 2 or more texts'
    if not isinstance(ranking, list) or not all(isinstance(rank, int) and not isinstance(rank, bool)
                                                for rank in ranking):
        return f'has "ranking" {json.dumps(ranking)[:80]}, not a list of int ranks'
    if len(ranking) != len(responses):
        return f'has {len(ranking)} ranks in "ranking" for {len(responses)} "responses" (one a response)'
    return None


def _pair_problem(row: Any) -> str | None:
    return prompt_problem(row) or _texts_problem(row, "chosen", "rejected")


STAGE_FORMS = {"sft": "demonstration", "rm": "ranking", "dpo": "pair"}  # the rows each stage reads
FORMS = {  # each form: what is wrong with a row (None: nothing), and what a row of it is
    "demonstration": (_demonstration_problem, '{"prompt", "response"} or {"messages"} (a chat whose assistant turns '
                                              "are taught)"),
    "ranking": (_ranking_problem, '{"prompt", "chosen", "rejected"} or {"prompt", "responses": [2 or more texts], '
                                  '"ranking": [an int rank per response, 0 the best]} ("messages" for "prompt")'),
    "pair": (_pair_problem, '{"prompt" (or "messages"), "chosen", "rejected"}'),
}


def response_ids(row: dict[str, Any], prompt_ids: list[int], response: str, tokenizer,
                 model_key: str = "models.policy") -> list[int]:
    """The token ids of ``response`` after ``row``'s prompt (``prompt_ids``): its text and the
    end-of-sequence token after a text prompt; the chat template's assistant turn after a chat."""
    chat = chat_of(row, None)
    if chat is None:
        ids = list(tokenizer(response, add_special_tokens=False)["input_ids"])
        return ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    whole = chat_token_ids(tokenizer, [*chat, {"role": "assistant", "content": response}], False, model_key)
    if whole[:len(prompt_ids)] != prompt_ids:
        raise ConfigError("the chat template does not render the prompt as the start of prompt + response")
    return whole[len(prompt_ids):]


def demonstration(row: dict[str, Any], tokenizer, model_key: str = "sft.model") -> Example:
    """{"prompt", "response"}: the loss on the response. {"messages"}: on each assistant turn,
    found as the tokens the template adds for it after the chat before it with the generation
    prompt."""
    if _is_text(row.get("response")):
        prompt = prompt_token_ids(row, tokenizer, model_key=model_key)
        response = response_ids(row, prompt, row["response"], tokenizer, model_key)
        return Example([prompt + response], [[0] * len(prompt) + [1] * len(response)], [0])
    ids, mask = assistant_turns(row["messages"],
                                lambda prefix, generation: chat_token_ids(tokenizer, prefix, generation, model_key))
    return Example([ids], [mask], [0])


def assistant_turns(messages: list[dict[str, Any]], ids_of: Callable[[list, bool], list[int]]
                    ) -> tuple[list[int], list[int]]:
    """(the chat's ids, a mask 1 at each assistant turn's): a turn's tokens are those the template
    adds for it after the chat before it with the generation prompt. ``ids_of(prefix,
    generation_prompt)``: a prefix of ``messages`` rendered as ids."""
    ids = ids_of(messages, False)
    mask = [0] * len(ids)
    for turn, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = ids_of(messages[:turn], True) if turn else []
        through = ids_of(messages[:turn + 1], False)
        if through[:len(before)] != before or ids[:len(through)] != through:
            raise ConfigError(f"the chat template renders turn {turn} differently once later turns follow; its "
                              "assistant tokens cannot be found")
        mask[len(before):len(through)] = [1] * (len(through) - len(before))
    if not any(mask):
        raise ConfigError('"messages" holds no assistant turn to learn from')
    return ids, mask


def ranking(row: dict[str, Any], tokenizer, model_key: str = "rm.model") -> Example:
    """{"prompt", "chosen", "rejected"} (ranks 0, 1) or {"prompt", "responses", "ranking"}."""
    responses, ranks = _ranked(row)
    prompt = prompt_token_ids(row, tokenizer, model_key=model_key)
    return answered(prompt, [response_ids(row, prompt, response, tokenizer, model_key) for response in responses],
                    ranks)


def _ranked(row: dict[str, Any]) -> tuple[list[str], list[int]]:
    """A ranking row's responses and their ranks (0 the best): chosen then rejected, or its own."""
    if _is_text(row.get("chosen")):
        return [row["chosen"], row["rejected"]], [0, 1]
    return row["responses"], list(row["ranking"])


def answered(prompt: list[int], answers: list[list[int]], ranks: list[int], images: list[bytes] = ()) -> Example:
    """One row per answer after ``prompt``, its loss on the answer's tokens."""
    return Example([prompt + answer for answer in answers], [[0] * len(prompt) + [1] * len(answer)
                                                             for answer in answers], ranks, images=list(images))


def pair(row: dict[str, Any], tokenizer, model_key: str = "dpo.model") -> Example:
    """{"prompt", "chosen", "rejected"}: rows chosen then rejected."""
    return ranking({key: row[key] for key in ("prompt", "messages", "chosen", "rejected") if key in row}, tokenizer,
                   model_key)


EXAMPLE_OF = {"demonstration": demonstration, "ranking": ranking, "pair": pair}


def seen_example(form: str, row: dict[str, Any], processor, images: list[bytes], model_key: str) -> Example:
    """A row for a model that sees (``processor``): a demonstration {"prompt" or "messages",
    "response"}, a pair {..., "chosen", "rejected"} or a ranking ({..., "responses", "ranking"}
    too), with its ``images`` (none: a text row beside them). The prompt is expanded as vLLM
    expands it; a response to a text prompt is its text and the end-of-sequence token, to a chat
    the template's assistant turn."""
    from common.image_prompts import vision_prompt_text
    from common.processors import check_placeholders, expanded_ids

    if form == "demonstration" and not _is_text(row.get("response")):
        return seen_chat_demonstration(row, processor, images)
    responses, ranks = ([row["response"]], [0]) if form == "demonstration" else _ranked(row)
    chat = chat_of(row, None)
    text = vision_prompt_text(row, processor)
    check_placeholders(text, images, processor)
    prompt = expanded_ids(processor, text, images, chat is None)
    answers = []
    for response in responses:
        if chat is None:  # its text and the end of sequence, as for a text model
            answers.append(response_ids(row, prompt, response, processor.tokenizer, model_key))
            continue
        whole = expanded_ids(processor, vision_prompt_text(row, processor, response=response), images, False)
        if whole[:len(prompt)] != prompt:
            raise ConfigError("the chat template does not render the prompt as the start of prompt + response")
        answers.append(whole[len(prompt):])
    return answered(prompt, answers, ranks, images)


def seen_chat_demonstration(row: dict[str, Any], processor, images: list[bytes]) -> Example:
    """{"messages"} for a model that sees: the loss on each assistant turn, found as
    ``demonstration`` finds it (the tokens the template adds for the turn after the chat before it
    with the generation prompt), every prefix expanded with the images it shows."""
    from common.image_prompts import images_shown, vision_chat
    from common.processors import expanded_ids

    messages = vision_chat(row, processor)

    def ids_of(prefix: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        text = processor.apply_chat_template(prefix, add_generation_prompt=generation_prompt, tokenize=False)
        return expanded_ids(processor, text, images[:images_shown(prefix)], False)

    ids, mask = assistant_turns(messages, ids_of)
    return Example([ids], [mask], [0], images=images)
