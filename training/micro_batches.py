"""Which rows go into each forward/backward pass of a rank: micro-batches by row count or by
token budget, of rows of like length, so that little of what is computed is padding.

A micro-batch costs its rows x its longest row (prompt + response, ``SequenceBatch.select`` trims
the rest). Rows sorted by length, longest first, and cut where the next row would pass the budget
waste only the difference between neighbours. Every rank must run as many passes as the others (a
ZeRO-3 forward and a ZeRO-2 backward are collectives), so a rank with fewer splits its costliest
micro-batch until it has as many.
"""

from __future__ import annotations

import torch

from common.config import LearnerConfig, StageConfig
from training import parallel


def plan(lengths: torch.Tensor, max_rows: int | None = None, max_tokens: int | None = None) -> list[torch.Tensor]:
    """Micro-batches of the rows whose lengths are ``lengths`` [n] (long): a list of index tensors
    into ``lengths``, together each index once, longest rows first. At most ``max_rows`` rows each,
    and at most ``max_tokens`` padded tokens (rows x longest) each; a row longer than
    ``max_tokens`` goes alone. Neither limit: one micro-batch of all rows."""
    order = torch.argsort(lengths, descending=True, stable=True)
    parts, start = [], 0
    while start < len(order):
        longest = int(lengths[order[start]])  # the part's first row is its longest
        rows = len(order) - start
        if max_rows is not None:
            rows = min(rows, max_rows)
        if max_tokens is not None:
            rows = max(1, min(rows, max_tokens // longest))
        parts.append(order[start:start + rows])
        start += rows
    return parts


def deal(rows: torch.Tensor, lengths: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s share of ``rows`` (indices into ``lengths``): sorted longest first and dealt
    to the ranks there and back (0, 1, 1, 0, 0, 1...), so every rank gets as many rows as the
    others (one fewer where they do not split evenly: a batch of episodes in parts), of like
    lengths."""
    ordered = rows[torch.argsort(lengths[rows], descending=True, stable=True)]
    dealt = torch.cat([ordered, ordered.new_full((-len(rows) % world,), -1)]).reshape(-1, world)
    dealt[1::2] = dealt[1::2].flip(1)
    share = dealt[:, rank]
    return share[share >= 0]


def split_to(parts: list[torch.Tensor], lengths: torch.Tensor, count: int) -> list[torch.Tensor]:
    """``parts`` (from ``plan``) split until there are ``count``: each time the costliest part of
    two rows or more is halved. Past one row a part, the rest are empty: a rank with fewer rows
    than another has passes still runs as many (a filler pass, which trains nothing)."""
    rows = sum(len(part) for part in parts)
    empty = parts[0].new_zeros(0) if parts else torch.zeros(0, dtype=torch.long)
    parts = list(parts) + [empty] * max(0, count - max(rows, len(parts)))
    while len(parts) < count:
        splittable = [i for i, part in enumerate(parts) if len(part) > 1]
        costliest = max(splittable, key=lambda i: len(parts[i]) * int(lengths[parts[i]].max()))
        part = parts.pop(costliest)
        parts[costliest:costliest] = [part[:len(part) // 2], part[len(part) // 2:]]
    return parts


def micro_batches_of(rows: torch.Tensor, lengths: torch.Tensor, cfg: LearnerConfig | StageConfig,
                     world: int) -> list[torch.Tensor]:
    """This rank's ``rows`` (indices into the batch, whose sequences are ``lengths`` [B] long) in
    micro-batches of ``cfg.micro_batch(world)`` rows and ``cfg.max_tokens_per_microbatch`` padded
    tokens at most, as many as any other rank has (``plan``, then ``split_to``)."""
    parts = plan(lengths[rows], cfg.micro_batch(world), cfg.max_tokens_per_microbatch)
    count = parallel.max_over_ranks(len(parts))
    return [rows[part] for part in split_to(parts, lengths[rows], count)]


def padded_tokens(parts: list[torch.Tensor], lengths: torch.Tensor) -> int:
    """What a forward pass computes over ``parts``: the sum of rows x longest row."""
    return sum(len(part) * int(lengths[part].max()) for part in parts)
