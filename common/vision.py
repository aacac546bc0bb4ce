"""Images in prompts (issue 36): read from a data row, carried as their encoded bytes,
and turned into the model's inputs by the model's own processor: the same way in the rollout
(vLLM runs that processor on the images it is given) and in the roles that recompute logprobs.

A row names its images by path, relative to its data file: ``{"prompt": ..., "images": ["a.png"]}``
(or ``"messages"`` with ``"images"``). The prompt holds one placeholder per image (the processor's
``image_token``), unexpanded: vLLM expands each into the image's tokens itself, and a prompt
already expanded would be read as text. The expanded ids vLLM reports are what a sample trains on.

Why bytes travel with a sample rather than a path or a content-addressed file in the run
directory: the scorer and the learner may run on hosts that see neither the data file nor the run
directory (tether does not require a shared file system), and an encoded image is small next to
what it becomes (a 56x56 PNG is under 1 KB; its pixel values 37 KB in float32). The processor
decodes the same bytes to the same pixels in every role.
"""

from __future__ import annotations

import io
import os
import struct
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.config import ConfigError
from common.prompts import chat_of, image_part_path, image_paths, prompts_within

_LENGTH = struct.Struct("<I")  # each image's byte count, before its bytes (pack_images)


def read_images(row: dict[str, Any], data_path: str, where: str, key: str = "data.prompts",
                read: dict[str, bytes] | None = None) -> list[bytes]:
    """The encoded bytes of each image ``row`` names (paths relative to ``data_path``'s directory,
    or ``data:`` URLs), each checked to decode as an image. A bad one is a ConfigError naming the
    key, the data file, the row (``where``: "line 5", "row 3") and the image file. ``read``: the
    images read before, by path (rows of a file share images: each is read and checked once)."""
    try:
        paths = image_paths(row)
    except ValueError as error:
        raise ConfigError(f"{key}: {data_path} {where}: {error}") from None
    images = []
    for path in paths:
        full = _full_path(path, os.path.dirname(os.path.abspath(data_path)))
        if read is not None and full in read:
            images.append(read[full])
            continue
        try:
            data = encoded_image(path, full)
        except ValueError as error:
            raise ConfigError(f"{key}: {data_path} {where}: {error}") from None
        images.append(data)
        if read is not None and not path.startswith("data:"):
            read[full] = data
    return images


def _full_path(path: str, directory: str) -> str:
    """A row's image path as a file's path (relative to ``directory``); a URL as it is."""
    if path.startswith(("data:", "http://", "https://")):
        return path
    return os.path.join(directory, path.removeprefix("file://"))


def encoded_image(path: str, full: str) -> bytes:
    """The bytes of the image ``path`` names (``full``: its file, ``_full_path``), or of a ``data:``
    URL, checked to decode; a ValueError naming it where it cannot be read as an image."""
    import base64
    import binascii

    inline = path.startswith("data:")
    try:
        if path.startswith(("http://", "https://")):
            raise ValueError("tether fetches no URL: give a file beside the data or a data: URL")
        if inline:
            data = base64.b64decode(path.partition(",")[2], validate=True)
        else:
            with open(full, "rb") as file:
                data = file.read()
        _check_image(data)
    except (OSError, ValueError, binascii.Error) as error:
        shown = path[:40] + "..." if inline and len(path) > 40 else full
        raise ValueError(f"image {shown} cannot be read as an image ({type(error).__name__}: {error})") from None
    return data


def _check_image(data: bytes) -> None:
    """An OSError (PIL's UnidentifiedImageError is one) where ``data`` does not decode as an image."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        image.load()


def part_image(part: dict[str, Any]) -> bytes:
    """The encoded bytes of an environment's or a tool's image part: its ``image`` as encoded bytes,
    a PIL image (encoded as PNG), a file path (relative to the working directory) or a ``data:``
    URL; an ``image_url`` part's URL; MCP's image content (``data``, base64, and ``mimeType``). A
    ValueError saying what it was where it is none of those."""
    image = part.get("image", part.get("path", part.get("url"))) if part.get("type") == "image" else None
    if image is None and isinstance(part.get("data"), str) and isinstance(part.get("mimeType"), str):  # MCP's form
        image = f"data:{part['mimeType']};base64,{part['data']}"
    if isinstance(image, (bytes, bytearray)):
        try:
            _check_image(bytes(image))
        except OSError as error:
            raise ValueError(f"an image part's bytes do not decode as an image ({type(error).__name__}: {error})") \
                from None
        return bytes(image)
    if hasattr(image, "save") and hasattr(image, "size"):  # a PIL image
        encoded = io.BytesIO()
        image.save(encoded, format="PNG")
        return encoded.getvalue()
    path = image if isinstance(image, str) and image else image_part_path(part)
    if path is None:
        raise ValueError(f"an image part {str(part)[:80]} holds no image: give its encoded bytes, a PIL image, "
                         "a file path or a data: URL")
    return encoded_image(path, _full_path(path, os.getcwd()))


def observation_images(messages: list[dict[str, Any]]) -> list[bytes]:
    """The encoded bytes of each image part of ``messages`` (an environment's observation), in the
    order they are shown (``part_image``)."""
    return [part_image(part) for message in messages if isinstance(message["content"], list)
            for part in message["content"] if part.get("type") in ("image", "image_url")]


def template_chat(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as a processor's chat template takes them: each content a list of parts, text as
    ``{"type": "text", "text": ...}``, an image as ``{"type": "image"}`` where it stands (the
    template writes its placeholder there)."""
    return [{**message, "content": [{"type": "text", "text": content}] if isinstance(content := message["content"], str)
             else [{"type": "image"} if part["type"] in ("image", "image_url") else part for part in content]}
            for message in messages]


def expand_placeholders(ids: list[int], placeholder: int, expansions: list[list[int]],
                        columns: tuple[list, ...] = ()) -> tuple[list[int], tuple[list, ...]]:
    """``ids`` [T] with its i-th ``placeholder`` replaced by ``expansions[i]`` (the image's ids, as the
    processor and vLLM expand it), and each of ``columns`` (a value per id: logprobs, masks) given a
    0 at every expanded id in place of the placeholder's value. The placeholders must be as many as
    ``expansions``."""
    found = [position for position, token in enumerate(ids) if token == placeholder]
    if len(found) != len(expansions):
        raise ValueError(f"{len(found)} image placeholders for {len(expansions)} images")
    out, grown, start = [], tuple([] for _ in columns), 0
    for position, expansion in zip(found, expansions):
        out += ids[start:position] + expansion
        for column, into in zip(columns, grown):
            into += column[start:position] + [0] * len(expansion)
        start = position + 1
    out += ids[start:]
    for column, into in zip(columns, grown):
        into += column[start:]
    return out, grown


def pack_images(images: list[bytes]) -> np.ndarray:
    """A sample's images as one uint8 array: each image's byte count (4 bytes, little-endian), then
    its bytes. ``unpack_images`` reads it back."""
    return np.frombuffer(b"".join(_LENGTH.pack(len(image)) + image for image in images), dtype=np.uint8)


def unpack_images(packed: np.ndarray) -> list[bytes]:
    """``pack_images``' images, in order; a ValueError where the counts do not add up."""
    data, images, offset = memoryview(np.ascontiguousarray(packed, dtype=np.uint8)).cast("B"), [], 0
    while offset < len(data):
        if offset + _LENGTH.size > len(data):
            raise ValueError(f"packed images end inside an image's length at byte {offset}")
        (size,), offset = _LENGTH.unpack_from(data, offset), offset + _LENGTH.size
        if offset + size > len(data):
            raise ValueError(f"packed images end inside an image of {size} bytes at byte {offset}")
        images.append(bytes(data[offset:offset + size]))
        offset += size
    return images


def decoded(images: list[bytes]) -> list:
    """The images as RGB PIL images, what a processor (and vLLM) takes."""
    from PIL import Image

    return [Image.open(io.BytesIO(image)).convert("RGB") for image in images]


VISION_TOWERS = ("vision_model.", "vision_tower.", "visual.")  # where families keep their image encoder


def _in_tower(name: str) -> bool:
    return any(f".{tower}" in f".{name}." for tower in VISION_TOWERS)


def freeze_vision_tower(model) -> list[str]:
    """Stop the gradient of the image encoder's parameters (by their names' ``VISION_TOWERS``);
    returns the names of its modules, which LoRA's adapters leave alone too."""
    for name, parameter in model.named_parameters():
        if _in_tower(name):
            parameter.requires_grad_(False)
    return [name for name, _ in model.named_modules() if _in_tower(name)]


def sees_images(model: str) -> bool:
    """Whether the model in directory ``model`` is a vision-language one (its config has a vision
    tower's), read from its config alone."""
    import json

    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as file:
            return "vision_config" in json.load(file)
    except (OSError, ValueError):
        return False


def load_processor(model: str, check_layout: bool = True):
    """The model's processor where it sees images (its processor has an image processor), else None;
    a family whose batches tether cannot lay out is refused (``image_layout``) unless
    ``check_layout`` is False (a checkpoint's save, which only copies the processor's files)."""
    from transformers import AutoProcessor

    if not sees_images(model):
        return None
    try:
        processor = AutoProcessor.from_pretrained(model)
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(f"{model} is a vision-language model (its config has a vision tower) but its processor "
                          f"does not load ({type(error).__name__}: {error})") from None
    if getattr(processor, "image_processor", None) is None:
        raise ConfigError(f"{model} is a vision-language model (its config has a vision tower) but it has no "
                          "image processor (processor_config.json / preprocessor_config.json)")
    if check_layout:
        image_layout(processor)  # a family tether cannot batch is refused here, before anything trains
    return processor


def banning_placeholder(config, processor):
    """``config`` whose sampling never samples the image placeholder of a policy that sees (its
    ``processor``; None: ``config`` as is). A sampled placeholder is text to vLLM, which places
    images by the prompt's placeholders alone, but an image slot to the model's forward in the
    scorer and the learner, which would find more slots than images."""
    if processor is None:
        return config
    token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    return config.model_copy(update={"sampling": config.sampling.banning([token])})


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


def check_placeholders(text: str, images: list[bytes], processor) -> None:
    """A ConfigError where ``text`` shows another number of image placeholders than there are
    ``images``: a literal placeholder in a row's own text would take an image slot of its own."""
    shown = text.count(processor.image_token)
    if shown != len(images):
        raise ConfigError(f"its text holds {shown} image placeholder(s) ({processor.image_token!r}) for "
                          f"{len(images)} image(s): the text may not hold the placeholder itself")


def expanded_ids(processor, text: str, images: list[bytes], special_tokens: bool, **options) -> list[int]:
    """``text``'s token ids with each placeholder expanded into its image's tokens, as the processor
    (and vLLM) expands them: what the model's forward reads. ``options``: the image processor's
    (``blank_image``'s one tile)."""
    return list(processor(text=[text], images=[decoded(images)] if images else None,
                          add_special_tokens=special_tokens, **options)["input_ids"][0])


def vision_prompt_ids(text: str, row: dict[str, Any], processor) -> list[int]:
    """``vision_prompt_text``'s token ids: a text prompt with the tokenizer's special tokens, a chat
    as its template wrote it (which holds any it wants: adding them again would double a BOS)."""
    return list(processor.tokenizer(text, add_special_tokens=chat_of(row, None) is None)["input_ids"])


def pixel_inputs(processor, images: list[list], **options) -> dict[str, Any]:
    """The model's image inputs for a batch of rows, ``images`` [B] lists of PIL images (a row may
    have none): the processor's output without its text (``pixel_values`` and what else the family
    takes, e.g. ``pixel_attention_mask``, ``image_sizes``), laid out as the family lays a batch out
    (``image_layout``): a row each, or the rows' images one after another. ``options``: the image
    processor's (``blank_image``'s one tile)."""
    if image_layout(processor) == "images":
        images = [image for row in images for image in row]
        if not images:
            return {}
    return _image_inputs(processor.image_processor(images, return_tensors="pt", **options))


def _image_inputs(output) -> dict[str, Any]:
    """An image processor's ``output`` without its text."""
    return {name: value for name, value in output.items() if name not in ("input_ids", "attention_mask")}


# a processor's layout, found once (``image_layout``): a weak key, so a processor let go is not kept
_LAYOUTS: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def image_layout(processor) -> str:
    """How the family's image processor lays out a batch's images: "rows", every tensor one entry
    per prompt, its images padded within (Idefics3's ``pixel_values`` [B, images, 3, H, W]); or
    "images", every tensor one entry per image, the prompts' images one after another (LLaVA's
    ``pixel_values`` [images, 3, H, W], which its forward hands to the placeholders in order).
    Read from the processor's answer to two rows of two and one probe images: a batch alone cannot
    tell (rows of 1, 0 and 2 images are three entries either way). Any other layout (Qwen-VL's
    patches of every image in one tensor, read by ``image_grid_thw``) is a ConfigError."""
    layout = _LAYOUTS.get(processor)
    if layout is not None:
        return layout
    from PIL import Image

    probe = Image.new("RGB", (56, 56), (128, 128, 128))
    try:
        output = processor.image_processor([[probe, probe], [probe]], return_tensors="pt")
    except Exception as error:  # the processor's own refusal, whatever its type
        raise ConfigError(f"{type(processor).__name__} could not process two prompts of 56-pixel probe images "
                          f"({type(error).__name__}: {error}), so tether cannot tell how it batches images") from None
    inputs = _image_inputs(output)
    odd = [name for name, value in inputs.items() if not (hasattr(value, "shape") and len(value.shape) >= 1)]
    if odd:  # tether moves and slices each input by its first dimension
        raise ConfigError(f"{type(processor).__name__}'s image inputs {', '.join(odd)} are not tensors with an entry "
                          "per prompt or per image: tether cannot batch this family's images (issue 36)")
    entries = {name: int(value.shape[0]) for name, value in inputs.items()}
    layout = "rows" if set(entries.values()) == {2} else "images" if set(entries.values()) == {3} else None
    if layout is None:
        raise ConfigError(f"{type(processor).__name__}'s image inputs are neither one entry per prompt nor one per "
                          f"image (entries for 2 prompts of 3 images: {entries}): tether batches rows by one of the "
                          "two, and does not read this family's yet (issue 36: Idefics3's and LLaVA's it does)")
    _LAYOUTS[processor] = layout
    return layout


@dataclass(frozen=True)
class BlankImage:
    """One probe image as the family's model reads it, for a data-parallel rank whose micro-batch
    shows no image: it runs its forward with this image's row after its rows (trained and measured
    for nothing), so that its forward and backward take the image path as another rank's do.
    Under ZeRO-3 each module's parameters are gathered by all ranks together, in the order the
    modules run; under ZeRO-1 and 2 gradients are reduced in buckets filled in the order they
    come. A rank that skipped the vision tower and the connector would meet the others in other
    collectives (gloo: "collective mismatch"; NCCL: a hang)."""

    ids: list[int]  # a text prompt of the image alone: its placeholder expanded, the tokenizer's specials
    pad: int  # an id for the positions past a row's end (masked), never the image placeholder
    image: dict[str, Any]  # its image inputs as one row's
    no_image: dict[str, Any] | None  # "rows" layout: an imageless row's entry (the family's padding); else None

    def after(self, input_ids, attention_mask) -> tuple[Any, Any]:
        """[B, L] ``input_ids`` and ``attention_mask`` with this image's prompt as a row more after
        their rows, [B + 1, max(L, its length)] (the columns added to theirs: padding)."""
        import torch
        from torch.nn.functional import pad

        width, length = max(input_ids.shape[1], len(self.ids)), len(self.ids)
        row = torch.full((1, width), self.pad, dtype=input_ids.dtype, device=input_ids.device)
        row[0, :length] = torch.as_tensor(self.ids)
        mask = pad(attention_mask, (0, width - attention_mask.shape[1], 0, 1))
        mask[-1, :length] = 1
        return torch.cat([pad(input_ids, (0, width - input_ids.shape[1]), value=self.pad), row]), mask

    def inputs(self, rows: int, device) -> dict[str, Any]:
        """The image inputs of ``rows`` rows that show no image and of this image's row after them."""
        import torch

        if self.no_image is None:  # "images": an entry an image, none for an imageless row
            return {name: value.to(device) for name, value in self.image.items()}
        return {name: torch.cat([self.no_image[name].expand(rows, *value.shape[1:]), value]).to(device)
                for name, value in self.image.items()}


# a processor's blank image, made once (``blank_image``)
_BLANKS: "weakref.WeakKeyDictionary[Any, BlankImage]" = weakref.WeakKeyDictionary()


def blank_image(processor) -> BlankImage:
    """The ``BlankImage`` of ``processor``'s family: a 56-pixel square of one colour (not black:
    Idefics3 drops an image of zeros as padding) as the processor expands and lays it out, in one
    tile where the family cuts images into tiles (Idefics3 and SmolVLM: up to 17 of them, thousands
    of tokens, that every row of the micro-batch would be padded to)."""
    blank = _BLANKS.get(processor)
    if blank is not None:
        return blank
    from PIL import Image

    probe = Image.new("RGB", (56, 56), (200, 120, 40))
    encoded = io.BytesIO()
    probe.save(encoded, format="PNG")
    whole = {"do_image_splitting": False} if getattr(processor.image_processor, "do_image_splitting", False) else {}
    inputs = pixel_inputs(processor, [[], [probe]], **whole)
    rows = image_layout(processor) == "rows"
    tokenizer, placeholder = processor.tokenizer, processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    # padding is masked, so any id serves but the placeholder, which the model counts wherever it is
    pad = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0, 1) if i is not None and i != placeholder)
    blank = BlankImage(expanded_ids(processor, processor.image_token, [encoded.getvalue()], True, **whole), pad,
                       {name: value[1:] if rows else value for name, value in inputs.items()},
                       {name: value[:1] for name, value in inputs.items()} if rows else None)
    _BLANKS[processor] = blank
    return blank


def prompts_with_images(rows: list[dict[str, Any]], tokenizer, processor, limit: int, system_prompt: str | None,
                        key: str, path: str, tools: list[dict] | None = None
                        ) -> tuple[list[list[int]], list[int], list[list[bytes]] | None]:
    """The prompts that fit, for any policy: with its ``processor`` (one that sees) ``vision_prompts``'
    ids, rows and images; else ``common.prompts.prompts_within``'s ids and rows, and None."""
    if processor is not None:
        return vision_prompts(rows, processor, limit, system_prompt, key, path, tools)
    return (*prompts_within(rows, tokenizer, limit, system_prompt, key, path, tools), None)


def engine_arguments(images: list[list[bytes]] | None, per_episode: int | None = None) -> dict[str, Any]:
    """vLLM's arguments for prompts with ``images`` (None: text): the most images one prompt has,
    or episodes may show (``per_episode``, ``rollout.max_images_per_episode``; None: single responses)."""
    if images is None:
        return {}
    return {"limit_mm_per_prompt": {"image": max(max(map(len, images), default=1), per_episode or 0) or 1}}


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
