"""How samples become model inputs, identically in the scorer and the learner.

Each sample is ``prompt + response`` right-padded to the longest in the batch. In an episode the
response holds the environment's tokens too: ``response_mask`` is 1 at the policy's tokens only
(the sample's ``loss_mask``), so everything trained or measured per token covers those alone. The logits at
position ``p`` predict token ``p + 1``, so response token ``j`` of a sample with a prompt of
length ``P`` is scored by the logits (and valued by the critic) at position ``P + j - 1``:
``response_positions`` holds those indices, and ``gather_response`` picks them out.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from typing import Any

import torch

from protocol.samples import Sample


@dataclass
class SequenceBatch:
    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long
    response_tokens: torch.Tensor  # [B, T] long
    response_positions: torch.Tensor  # [B, T] long, index into L of the logits for each response token
    response_mask: torch.Tensor  # [B, T] float: 1 at the policy's response tokens
    last_positions: torch.Tensor  # [B] long, position of each sample's last real token
    # a policy that sees: its processor's image inputs of each row, rows first (Idefics3's pixel_values
    # [B, images, 3, H, W] and pixel_attention_mask), which the model takes beside the ids
    images: dict[str, torch.Tensor] | None = None
    # [B] bool: the rows that have images (the others' image inputs are the family's padding, which a
    # forward of such rows alone refuses: Idefics3 finds no real image and fails)
    seen: torch.Tensor | None = None
    # a family whose image inputs are one entry per image (``common.processors.image_layout``: LLaVA's
    # pixel_values [images, 3, H, W]), the rows' images one after another: how many each row has
    image_counts: list[int] | None = None
    # a policy that sees, in the learner: its ``training.blank_image.BlankImage``, the row a
    # data-parallel rank adds to a micro-batch that shows no image (``with_blank``)
    blank: Any = None
    # a packed pass (``common.packing.packed``): [R, W] each node's position in its row; the
    # attention_mask is then [R, 1, W, W] (or None: flash-attn's varlen), and the positions above
    # index the R x W nodes one after another (``gather``)
    position_ids: torch.Tensor | None = None
    # a packed pass of a model whose attention goes row by row (``common.packing.Segments``): its
    # nodes are then one row [1, N] with no attention_mask, and each row's attention reads its path
    segments: Any = None

    def to(self, device: torch.device | str) -> "SequenceBatch":
        # a packed pass of segments (or flash-attn's) has no attention_mask
        return SequenceBatch(*(None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                               for f in fields(self) if f.name not in _NOT_TENSORS),
                             images=_each(self.images, lambda tensor: tensor.to(device)), seen=self.seen,
                             image_counts=self.image_counts, blank=self.blank,
                             position_ids=None if self.position_ids is None else self.position_ids.to(device),
                             segments=None if self.segments is None else self.segments.to(device))

    @property
    def model_inputs(self) -> dict[str, Any]:
        """What the model's forward takes: the ids, their mask, a packed pass's positions (and
        segments) and any image inputs."""
        packed = {} if self.position_ids is None else {"position_ids": self.position_ids}
        if self.segments is not None:
            packed["segments"] = self.segments
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, **packed, **(self.images or {})}

    def select(self, rows: torch.Tensor) -> "SequenceBatch":
        """The batch of ``rows`` only, its padding trimmed to their longest sequence and response
        (a forward pass costs rows x width: columns that are padding in every row are waste)."""
        width = int(self.last_positions[rows].max()) + 1
        # to the last policy token: an episode's environment tokens may leave holes in the mask
        masked = self.response_mask[rows] > 0
        positions = torch.arange(masked.shape[1], device=masked.device)
        response_width = max(1, int(torch.where(masked, positions + 1, 0).max()))
        return SequenceBatch(self.input_ids[rows, :width], self.attention_mask[rows, :width],
                             self.response_tokens[rows, :response_width],
                             self.response_positions[rows, :response_width],
                             self.response_mask[rows, :response_width], self.last_positions[rows],
                             *self._images_of(rows), blank=self.blank)

    def with_blank(self) -> "SequenceBatch":
        """This batch, which shows no image, and one row more after its rows: ``blank``'s image
        prompt, none of whose tokens is trained or measured (its response mask 0). Its forward takes
        the image path as a batch with images does; the callers read its first rows' outputs."""
        blank, rows = self.blank, len(self.input_ids)
        input_ids, attention_mask = blank.after(self.input_ids, self.attention_mask)
        return SequenceBatch(input_ids, attention_mask, _row_more(self.response_tokens),
                             _row_more(self.response_positions), _row_more(self.response_mask),
                             torch.cat([self.last_positions, self.last_positions.new_tensor([len(blank.ids) - 1])]),
                             blank.inputs(rows, input_ids.device), torch.tensor([False] * rows + [True]),
                             None if blank.no_image is not None else [0] * rows + [1])

    def _images_of(self, rows: torch.Tensor) -> tuple[dict[str, torch.Tensor] | None, torch.Tensor | None,
                                                      list[int] | None]:
        """(images, seen, image_counts) of ``rows``: none where no row of them has an image."""
        if self.images is None or not bool(self.seen[rows.cpu()].any()):
            return None, None, None
        if self.image_counts is None:  # an entry a row
            return _each(self.images, lambda tensor: tensor[rows]), self.seen[rows.cpu()], None
        # an entry an image: the rows' images, in the rows' order
        chosen = rows.cpu().tolist()
        starts = [0, *itertools.accumulate(self.image_counts)]
        index = torch.tensor([i for row in chosen for i in range(starts[row], starts[row + 1])], dtype=torch.long)
        return (_each(self.images, lambda tensor: tensor[index.to(tensor.device)]), self.seen[rows.cpu()],
                [self.image_counts[row] for row in chosen])

    def gather(self, per_position: torch.Tensor) -> torch.Tensor:
        """[B, T, ...]: of a forward's outputs over this batch ([rows, L, ...]: logits, values), the
        entries that score each response token. A packed pass's rows hold the B rows' tokens among
        them: its positions index its rows' nodes one after another."""
        if self.position_ids is not None:
            # indexed, not gathered from a view expanded to B rows: the backward of a gather fills a
            # gradient of its input's shape, B x R x W x V of logits
            return per_position.reshape(-1, *per_position.shape[2:])[self.response_positions]
        return gather_response(per_position, self.response_positions)

    @property
    def lengths(self) -> torch.Tensor:
        """[B] long: each row's prompt + response length."""
        return self.last_positions + 1


_NOT_TENSORS = ("images", "seen", "image_counts", "blank", "position_ids", "segments")


def _row_more(tensor: torch.Tensor) -> torch.Tensor:
    """[B, T] ``tensor`` and a row of zeros after its rows."""
    return torch.nn.functional.pad(tensor, (0, 0, 0, 1))


def _each(images: dict[str, torch.Tensor] | None, change) -> dict[str, torch.Tensor] | None:
    return None if images is None else {name: change(tensor) for name, tensor in images.items()}


def collate(samples: list[Sample], pad_token_id: int, processor=None, blank: Any = None) -> SequenceBatch:
    """The samples as one right-padded batch; with a policy's ``processor`` (one that sees), the
    image inputs of their images too, as the processor makes them from the bytes each carries.
    ``blank``: the learner's ``training.blank_image.BlankImage``, which a data-parallel rank adds to
    a micro-batch that shows no image (``SequenceBatch.with_blank``); the scorer's batches have none."""
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    lengths = [len(s.prompt_tokens) + len(s.response_tokens) for s in samples]
    max_len, max_resp = max(lengths), max(len(s.response_tokens) for s in samples)
    batch = len(samples)
    input_ids = torch.full((batch, max_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, max_len), dtype=torch.long)
    response_tokens = torch.full((batch, max_resp), pad_token_id, dtype=torch.long)
    response_positions = torch.zeros((batch, max_resp), dtype=torch.long)
    response_mask = torch.zeros((batch, max_resp), dtype=torch.float32)
    for i, sample in enumerate(samples):
        prompt = torch.as_tensor(sample.prompt_tokens, dtype=torch.long)
        response = torch.as_tensor(sample.response_tokens, dtype=torch.long)
        prompt_len, resp_len = len(prompt), len(response)
        input_ids[i, :prompt_len] = prompt
        input_ids[i, prompt_len:prompt_len + resp_len] = response
        attention_mask[i, :prompt_len + resp_len] = 1
        response_tokens[i, :resp_len] = response
        response_positions[i, :resp_len] = torch.arange(prompt_len - 1, prompt_len + resp_len - 1)
        response_mask[i, :resp_len] = 1.0 if sample.loss_mask is None else torch.as_tensor(sample.loss_mask,
                                                                                            dtype=torch.float32)
    last_positions = attention_mask.sum(dim=1) - 1
    images = seen = counts = None
    if processor is not None and any(sample.images is not None for sample in samples):
        from common.images import decoded, unpack_images
        from common.processors import image_layout, pixel_inputs

        rows = [decoded(unpack_images(s.images)) if s.images is not None else [] for s in samples]
        images = pixel_inputs(processor, rows)
        seen = torch.tensor([bool(row) for row in rows])
        counts = [len(row) for row in rows] if image_layout(processor) == "images" else None
    return SequenceBatch(input_ids, attention_mask, response_tokens, response_positions, response_mask, last_positions,
                         images, seen, counts, blank)


def pad_rows(rows: list[list[int]], pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id rows right-padded into input_ids [B, L] (long) and attention_mask [B, L] (long)."""
    input_ids = torch.full((len(rows), max(len(row) for row in rows)), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, :len(row)] = torch.as_tensor(row, dtype=torch.long)
        attention_mask[i, :len(row)] = 1
    return input_ids, attention_mask


def gather_response(per_position: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """per_position: [B, L, ...] (logits [B, L, V] or values [B, L]); positions: [B, T]. Returns
    [B, T, ...]: the entries that score each response token."""
    index = positions
    for _ in range(per_position.dim() - 2):
        index = index.unsqueeze(-1)
    index = index.expand(*positions.shape, *per_position.shape[2:])
    return torch.gather(per_position, 1, index)


def policy_turns(loss_mask, length: int) -> list[tuple[int, int]]:
    """[start, stop) of each turn of the policy in a response of ``length`` tokens: the runs of 1 in
    an episode's ``loss_mask`` (between them, the environment's tokens); a single response (no
    mask) is one turn. A turn's last token, ``stop - 1``, is where its turn reward sits."""
    if loss_mask is None:
        return [(0, length)]
    import numpy as np

    edges = np.diff(np.concatenate([[0], np.asarray(loss_mask, dtype=np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))
