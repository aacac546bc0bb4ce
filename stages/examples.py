"""The stages' data: rows of a file become examples of token ids, each a group of sequences that go
through the model in one forward pass (a demonstration: one; a ranking: its K responses; a pair:
chosen and rejected).

A prompt is read as PPO reads it (``common.prompts``): ``"prompt"`` text tokenized with the
tokenizer's special tokens, or ``"messages"``, a chat rendered by the chat template with the
generation prompt. A response to a text prompt is its text and the end-of-sequence token, as the
rollout's responses end when they stop; a response to a chat is what the template writes for it
as the assistant's turn. So the reward model scores, and SFT teaches, the tokens PPO generates.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from common.config import ConfigError
from common.prompts import chat_of, prompt_token_ids, read_records


@dataclass
class Example:
    """One example: ``rows`` token-id sequences (prompt + response), ``loss_masks`` 1 at each row's
    tokens taught or scored (its response), and ``ranks`` (0 the best; equal: a tie), one a row."""
    rows: list[list[int]]
    loss_masks: list[list[int]]
    ranks: list[int]
    reference: torch.Tensor | None = None  # DPO: the reference's log pi(response | prompt) of each row

    @property
    def cost(self) -> int:
        """Padded tokens of its forward pass alone: rows x longest."""
        return len(self.rows) * max(len(row) for row in self.rows)


def read_examples(path: str, key: str, tokenizer, form: str, max_len: int) -> tuple[list[Example], int]:
    """The examples of a stage's data file (config key ``key``) and how many rows were left out for
    passing ``max_len`` tokens. ``form``: "demonstration" (sft), "ranking" (rm) or "pair" (dpo).
    A row of the wrong form is an error naming the key, the file and the row."""
    valid, problem = FORMS[form]
    rows = read_records(path, key, valid, problem)
    examples = []
    for number, row in enumerate(rows, 1):
        try:
            example = EXAMPLE_OF[form](row, tokenizer)
        except ConfigError as error:
            raise ConfigError(f"{key}: {path} row {number}: {error}") from None
        if max(len(ids) for ids in example.rows) <= max_len and all(any(mask) for mask in example.loss_masks):
            examples.append(example)
    if not examples:
        raise ConfigError(f"{key}: none of the {len(rows)} rows of {path} fits in {max_len} tokens (max_len)")
    return examples, len(rows) - len(examples)


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


def _has_prompt(row: Any) -> bool:
    return isinstance(row, dict) and (_is_text(row.get("prompt")) or isinstance(row.get("messages"), list))


def _valid_demonstration(row: Any) -> bool:
    return _has_prompt(row) and (_is_text(row.get("response")) or not _is_text(row.get("prompt")))


def _valid_ranking(row: Any) -> bool:
    if not _has_prompt(row):
        return False
    if _is_text(row.get("chosen")) and _is_text(row.get("rejected")):
        return True
    responses, ranking = row.get("responses"), row.get("ranking")
    return (isinstance(responses, list) and len(responses) >= 2 and all(map(_is_text, responses))
            and isinstance(ranking, list) and len(ranking) == len(responses)
            and all(isinstance(rank, int) and not isinstance(rank, bool) for rank in ranking))


def _valid_pair(row: Any) -> bool:
    return _has_prompt(row) and _is_text(row.get("chosen")) and _is_text(row.get("rejected"))


STAGE_FORMS = {"sft": "demonstration", "rm": "ranking", "dpo": "pair"}  # the rows each stage reads
FORMS = {
    "demonstration": (_valid_demonstration, 'is neither {"prompt", "response"} nor {"messages"} (a chat whose '
                                            "assistant turns are taught)"),
    "ranking": (_valid_ranking, 'is neither {"prompt", "chosen", "rejected"} nor {"prompt", "responses": [2 or more '
                                'texts], "ranking": [an int rank per response, 0 the best]}'),
    "pair": (_valid_pair, 'is not {"prompt" (or "messages"), "chosen", "rejected"}'),
}


def response_ids(row: dict[str, Any], prompt_ids: list[int], response: str, tokenizer) -> list[int]:
    """The token ids of ``response`` after ``row``'s prompt (``prompt_ids``): its text and the
    end-of-sequence token after a text prompt; the chat template's assistant turn after a chat."""
    chat = chat_of(row, None)
    if chat is None:
        ids = list(tokenizer(response, add_special_tokens=False)["input_ids"])
        return ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    whole = _rendered(tokenizer, [*chat, {"role": "assistant", "content": response}], False)
    if whole[:len(prompt_ids)] != prompt_ids:
        raise ConfigError("the chat template does not render the prompt as the start of prompt + response")
    return whole[len(prompt_ids):]


def demonstration(row: dict[str, Any], tokenizer) -> Example:
    """{"prompt", "response"}: the loss on the response. {"messages"}: on each assistant turn,
    found as the tokens the template adds for it after the chat before it with the generation
    prompt."""
    if _is_text(row.get("response")):
        prompt = prompt_token_ids(row, tokenizer)
        response = response_ids(row, prompt, row["response"], tokenizer)
        return Example([prompt + response], [[0] * len(prompt) + [1] * len(response)], [0])
    messages = row["messages"]
    ids = _rendered(tokenizer, messages, False)
    mask = [0] * len(ids)
    for turn, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _rendered(tokenizer, messages[:turn], True) if turn else []
        through = _rendered(tokenizer, messages[:turn + 1], False)
        if through[:len(before)] != before or ids[:len(through)] != through:
            raise ConfigError(f"the chat template renders turn {turn} differently once later turns follow; its "
                              "assistant tokens cannot be found")
        mask[len(before):len(through)] = [1] * (len(through) - len(before))
    if not any(mask):
        raise ConfigError('"messages" holds no assistant turn to learn from')
    return Example([ids], [mask], [0])


def ranking(row: dict[str, Any], tokenizer) -> Example:
    """{"prompt", "chosen", "rejected"} (ranks 0, 1) or {"prompt", "responses", "ranking"}."""
    if _is_text(row.get("chosen")):
        responses, ranks = [row["chosen"], row["rejected"]], [0, 1]
    else:
        responses, ranks = row["responses"], row["ranking"]
    prompt = prompt_token_ids(row, tokenizer)
    answers = [response_ids(row, prompt, response, tokenizer) for response in responses]
    return Example([prompt + answer for answer in answers], [[0] * len(prompt) + [1] * len(answer)
                                                             for answer in answers], list(ranks))


def pair(row: dict[str, Any], tokenizer) -> Example:
    """{"prompt", "chosen", "rejected"}: rows chosen then rejected."""
    return ranking({key: row[key] for key in ("prompt", "messages", "chosen", "rejected") if key in row}, tokenizer)


EXAMPLE_OF = {"demonstration": demonstration, "ranking": ranking, "pair": pair}


def _rendered(tokenizer, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError('a row is a chat ("messages") but the tokenizer has no chat template; give "prompt" text')
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
