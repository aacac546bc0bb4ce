"""Which rows go into each forward/backward pass of a rank: micro-batches by row count or by
token budget, of rows of like length, so that little of what is computed is padding; or, packed
(``common.packing``), of as many rows as the budget's packed tokens hold.

A micro-batch costs its rows x its longest row (prompt + response, ``SequenceBatch.select`` trims
the rest). Rows sorted by length, longest first, and cut where the next row would pass the budget
waste only the difference between neighbours. Every rank must run as many passes as the others (a
ZeRO-3 forward and a ZeRO-2 backward are collectives), so a rank with fewer splits its costliest
micro-batch until it has as many.
"""

from __future__ import annotations

import torch

from common.config import LearnerConfig, StageConfig
from common.packing import Packing, packed_tokens, prefix_order
from training import parallel


def plan(lengths: torch.Tensor, max_rows: int | None = None, max_tokens: int | None = None,
         shared: torch.Tensor | None = None, order: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Micro-batches of the rows whose lengths are ``lengths`` [n] (long): a list of index tensors
    into ``lengths``, together each index once, longest rows first. At most ``max_rows`` rows each,
    and at most ``max_tokens`` padded tokens (rows x longest) each; a row longer than
    ``max_tokens`` goes alone. Neither limit: one micro-batch of all rows.

    A packed pass (``common.packing``) costs what it computes: cut ``order`` (default longest
    first) where the next row's tokens past the ``shared`` [n] prefix it has with the row before
    it in ``order`` (zeros: ``pack``) would pass ``max_tokens``."""
    order = torch.argsort(lengths, descending=True, stable=True) if order is None else order
    parts, start = [], 0
    while start < len(order):
        longest = int(lengths[order[start]])  # the part's first row is its longest
        rows = len(order) - start
        if max_rows is not None:
            rows = min(rows, max_rows)
        if shared is not None:
            rows = _packed_rows(lengths[order[start:start + rows]], shared[start:start + rows], max_tokens)
        elif max_tokens is not None:
            rows = max(1, min(rows, max_tokens // longest))
        parts.append(order[start:start + rows])
        start += rows
    return parts


def _packed_rows(lengths: torch.Tensor, shared: torch.Tensor, max_tokens: int | None) -> int:
    """How many of these rows (in order) one packed pass of ``max_tokens`` takes: at least one."""
    if max_tokens is None:
        return len(lengths)
    added = (lengths - shared).clone()
    added[0] = lengths[0]  # a part's first row shares with nothing before it
    fits = int((torch.cumsum(added, 0) <= max_tokens).sum())
    return max(1, fits)


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


def deal_in_order(rows: torch.Tensor, costs: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s share of ``rows`` kept in their order (a prefix tree's: rows that share a
    prompt side by side), cut into ``world`` runs of like total ``costs`` [len(rows)] (the packed
    tokens each row adds): a prompt's rows stay on one rank, except where a cut falls among them."""
    ends = torch.cumsum(costs, 0).double()
    total = float(ends[-1]) if len(ends) else 0.0
    # a row goes to the rank whose share of the total holds the middle of its cost
    middles = ends - costs.double() / 2
    owner = torch.clamp((middles * world / max(total, 1e-9)).long(), max=world - 1)
    return rows[owner == rank]


def split_to(parts: list[torch.Tensor], lengths: torch.Tensor, count: int, cost=None) -> list[torch.Tensor]:
    """``parts`` (from ``plan``) split until there are ``count``: each time the costliest part of
    two rows or more is halved (``cost``: a part's cost, default rows x longest). Past one row a
    part, the rest are empty: a rank with fewer rows than another has passes still runs as many (a
    filler pass, which trains nothing)."""
    cost = cost if cost is not None else (lambda part: len(part) * int(lengths[part].max()))
    rows = sum(len(part) for part in parts)
    empty = parts[0].new_zeros(0) if parts else torch.zeros(0, dtype=torch.long)
    parts = list(parts) + [empty] * max(0, count - max(rows, len(parts)))
    while len(parts) < count:
        splittable = [i for i, part in enumerate(parts) if len(part) > 1]
        costliest = max(splittable, key=lambda i: cost(parts[i]))
        part = parts.pop(costliest)
        parts[costliest:costliest] = [part[:len(part) // 2], part[len(part) // 2:]]
    return parts


def micro_batches_of(rows: torch.Tensor, lengths: torch.Tensor, cfg: LearnerConfig | StageConfig,
                     world: int, input_ids: torch.Tensor | None = None,
                     packing: Packing = "none") -> list[torch.Tensor]:
    """This rank's ``rows`` (indices into the batch, whose sequences are ``lengths`` [B] long) in
    micro-batches of ``cfg.micro_batch(world)`` rows and ``cfg.max_tokens_per_microbatch`` tokens at
    most (``passes``), as many as any other rank has (``split_to``)."""
    mine = lengths[rows]
    own_ids = input_ids[rows] if input_ids is not None else None
    parts = passes(mine, own_ids, packing, cfg.micro_batch(world), cfg.max_tokens_per_microbatch)
    count = parallel.max_over_ranks(len(parts))
    cost = None if packing == "none" else (lambda part: packed_tokens(own_ids[part] if own_ids is not None else None,
                                                                       mine[part], packing))
    return [rows[part] for part in split_to(parts, mine, count, cost)]


def passes(lengths: torch.Tensor, input_ids: torch.Tensor | None, packing: Packing, max_rows: int | None,
           max_tokens: int | None) -> list[torch.Tensor]:
    """Forward passes of the rows of ``lengths`` [n] (``plan``): padded rows of like length, or a
    packed pass (``packing`` pack or tree, whose prefixes are read from ``input_ids`` [n, L]) that
    counts the tokens it computes, a tree's rows in their tokens' order so that rows of one prompt
    share a pass."""
    if packing == "none":
        return plan(lengths, max_rows, max_tokens)
    if packing == "tree":
        order, shared = prefix_order(input_ids, lengths)
    else:
        order, shared = torch.argsort(lengths, descending=True, stable=True), torch.zeros_like(lengths)
    return plan(lengths, max_rows, max_tokens, shared.to(lengths.device), order.to(lengths.device))


def padded_tokens(parts: list[torch.Tensor], lengths: torch.Tensor) -> int:
    """What a forward pass computes over ``parts``: the sum of rows x longest row."""
    return sum(len(part) * int(lengths[part].max()) for part in parts)


def pass_shares(input_ids: torch.Tensor, lengths: torch.Tensor, max_rows: int | None,
                max_tokens: int | None) -> dict[str, float]:
    """What packing would save on passes over these rows [n, L] (``lengths`` [n]), as padded passes
    of ``max_rows`` rows and ``max_tokens`` tokens cut them (``plan``): ``padding_share``, the share
    of the tokens they compute that is padding (what ``pack`` skips), and ``prefix_share``, the
    share of the real tokens that repeat a prefix another row has (what ``tree`` computes once)."""
    padded = padded_tokens(plan(lengths, max_rows, max_tokens), lengths)
    real = int(lengths.sum())
    tree = packed_tokens(input_ids, lengths, "tree")
    return {"padding_share": 1.0 - real / padded if padded else 0.0,
            "prefix_share": 1.0 - tree / real if real else 0.0}
