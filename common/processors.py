"""A model that sees images, and its processor: whether a model sees (its config), its processor
loaded and probed for how it lays out a batch's images, and each image placeholder expanded into
the image's tokens as the processor (and vLLM) expands it.

A prompt holds one placeholder per image (the processor's ``image_token``), unexpanded: vLLM
expands each into the image's tokens itself, and a prompt already expanded would be read as text.
The expanded ids vLLM reports are what a sample trains on; the scorer and the learner make the
same image inputs from the same bytes with the same processor (``pixel_inputs``).
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from common.config import ConfigError
from common.images import decoded


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
    (``training.blank_image``'s one tile)."""
    return list(processor(text=[text], images=[decoded(images)] if images else None,
                          add_special_tokens=special_tokens, **options)["input_ids"][0])


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


def pixel_inputs(processor, images: list[list], **options) -> dict[str, Any]:
    """The model's image inputs for a batch of rows, ``images`` [B] lists of PIL images (a row may
    have none): the processor's output without its text (``pixel_values`` and what else the family
    takes, e.g. ``pixel_attention_mask``, ``image_sizes``), laid out as the family lays a batch out
    (``image_layout``): a row each, or the rows' images one after another. ``options``: the image
    processor's (``training.blank_image``'s one tile)."""
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
