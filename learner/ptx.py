"""PPO-ptx (InstructGPT): the policy keeps a language-modelling loss on SFT / pretraining text,
``learner.ptx_coef`` x the mean next-token loss over the tokens of ``learner.ptx_batch_size``
sequences of ``data.ptx`` per optimizer step, so RLHF does not erode what SFT taught.
"""

from __future__ import annotations

import torch

from common.distributions import logprobs_from_logits
from common.prompts import read_texts
from common.sequences import pad_rows


def read_ptx(path: str, tokenizer, max_tokens: int) -> list[list[int]]:
    """Token ids of every ``{"text": ...}`` row of ``data.ptx`` (JSON lines or Parquet), cut to
    ``max_tokens``; rows of fewer than two tokens teach nothing and are left out."""
    rows = read_texts(path)
    sequences = [tokenizer(row["text"])["input_ids"][:max_tokens] for row in rows]
    return [ids for ids in sequences if len(ids) >= 2]


class PtxStream:
    """Batches of ptx sequences, the same on every rank: pass ``e`` over the data is a shuffle
    seeded by ``(seed, e)``, so a resumed run can find its place from the step alone."""

    def __init__(self, sequences: list[list[int]], batch_size: int, seed: int) -> None:
        if not sequences:
            raise ValueError("data.ptx holds no sequence of two tokens or more")
        self.sequences, self.batch_size, self.seed = sequences, batch_size, seed
        self.position = 0
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, its shuffle), drawn once a pass

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [P, L] right-padded with 0, attention_mask [P, L]."""
        rows = []
        for _ in range(self.batch_size):
            epoch, offset = divmod(self.position, len(self.sequences))
            if self._order is None or self._order[0] != epoch:
                shuffle = torch.Generator().manual_seed(self.seed * 7919 + epoch)
                self._order = (epoch, torch.randperm(len(self.sequences), generator=shuffle))
            rows.append(self.sequences[int(self._order[1][offset])])
            self.position += 1
        return pad_rows(rows)


def ptx_token_losses(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss of each position that predicts a real token. logits: [P, L, V]; input_ids,
    attention_mask: [P, L]. Returns (loss [P, L - 1], mask [P, L - 1] float)."""
    targets = input_ids[:, 1:]
    mask = (attention_mask[:, 1:] * attention_mask[:, :-1]).float()
    return -logprobs_from_logits(logits[:, :-1], targets), mask
