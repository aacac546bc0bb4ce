"""The blank image: what a data-parallel rank whose micro-batch shows no image runs its forward
with, so that under ZeRO its collectives meet the other ranks' (``BlankImage`` says why). The
learner adds it to a batch (``common.sequences.SequenceBatch.with_blank``), the stages to their
examples (``stages.examples``)."""

from __future__ import annotations

import io
import weakref
from dataclasses import dataclass
from typing import Any

from common.processors import expanded_ids, image_layout, pixel_inputs


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


def blank_image(processor) -> BlankImage | None:
    """The ``BlankImage`` of ``processor``'s family: a 56-pixel square of one colour (not black:
    Idefics3 drops an image of zeros as padding) as the processor expands and lays it out, in one
    tile where the family cuts images into tiles (Idefics3 and SmolVLM: up to 17 of them, thousands
    of tokens, that every row of the micro-batch would be padded to). None for a policy that sees
    no image (``processor`` None)."""
    if processor is None:
        return None
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
