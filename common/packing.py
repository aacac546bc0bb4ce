"""Packed and prefix-shared forward passes: a micro-batch's rows as one sequence, so that no padding
and no shared prompt is computed twice. The same in the learner (actor and critic) and the scorer
(reference, teacher, reward model).

- ``none``: each row right-padded to the longest (``common.sequences.collate``).
- ``pack``: the rows one after another, without padding. Each row's position ids restart at 0 and
  its tokens attend only its own earlier tokens (a block-diagonal causal mask).
- ``tree``: the rows as a prefix tree (AReaL's tree training): rows that begin with the same tokens
  (the n responses to one prompt; an episode's parts, each extending the last) share one copy of
  that prefix. Each token attends its ancestors and itself, at its depth as its position.

A tree's nodes are laid out in depth-first order: the rows sorted by their tokens, each adding the
tokens past what it shares with the row before it (in sorted order, no earlier row shares more).
Token ``j`` of a row is then one node, and the logits (or values) that score response token ``t``
are read at the node of position ``P + t - 1``, as ``common.sequences`` reads them from a padded row.

Built on what transformers offers for custom attention, in one of two ways:

- a model on SDPA (``checked`` gives it ``segment_attention``, registered with transformers'
  ``AttentionInterface``): the pass's nodes are one sequence [1, N], which the model's other
  layers compute with no padding at all, and each row's attention is SDPA of its own new nodes
  over its path (its prefix's nodes and its own), rows of like size in one call (``Segments``). A
  tree's shared prompt is computed once and attended by each of its rows, as in a padded pass;
  no node attends a sibling's nodes only to mask them.
- any other (eager, whose family may have its own; flash-attn for ``pack``): the nodes in packed
  rows of a 4-D additive mask [R, 1, W, W] with explicit ``position_ids`` (``bins``), which
  transformers passes to its kernels as it is.

A family whose positions or attention neither can steer (ALiBi from the 2-D mask, sliding
windows shorter than the sequences, a model that sees) is refused by ``refusal``, and a learner or
scorer that finds one falls back to ``none`` with a line saying why (``checked``), after comparing a
packed pass with a padded one on the model itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Literal

import torch

from common.sequences import SequenceBatch

Packing = Literal["none", "pack", "tree"]
PACKINGS: tuple[str, ...] = ("none", "pack", "tree")


def prefix_order(input_ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``input_ids`` [B, L] (right-padded, row i ``lengths[i]`` long) sorted by their
    tokens, and each one's common prefix with the row before it in that order (0 for the first).
    Returns (order [B] long, shared [B] long)."""
    input_ids, lengths = input_ids.cpu(), lengths.cpu()  # one copy from a device, not one a row
    rows = [input_ids[i, :int(lengths[i])].tolist() for i in range(len(lengths))]
    order = sorted(range(len(rows)), key=rows.__getitem__)
    shared = [0] + [_common_prefix(rows[a], rows[b]) for a, b in zip(order, order[1:])]
    return torch.tensor(order, dtype=torch.long), torch.tensor(shared, dtype=torch.long)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prompt_units(input_ids: torch.Tensor, lengths: torch.Tensor, prompt_lengths: torch.Tensor) -> list[torch.Tensor]:
    """The rows [B, L] (row i ``lengths[i]`` tokens, its prompt the first ``prompt_lengths[i]``) in
    units of rows that share a prompt: each unit's rows in their tokens' order, each sharing at
    least a whole prompt with the row before it (a prompt's responses; an episode's parts, each
    beginning with the one before). Returns each unit's row indices, the units in the order of
    their first rows in the batch (rows that share nothing are then units in the batch's order)."""
    return [unit for unit, _ in _units(input_ids, lengths, prompt_lengths)]


def _units(input_ids: torch.Tensor, lengths: torch.Tensor,
           prompt_lengths: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``prompt_units``, each with what each of its rows shares with the row before it in the unit
    (``prefix_order``'s, 0 for its first row)."""
    order, shared = prefix_order(input_ids, lengths)
    prompts = prompt_lengths.cpu()[order]
    joins = shared[1:] >= torch.minimum(prompts[1:], prompts[:-1])
    starts = [0] + (torch.nonzero(~joins).flatten() + 1).tolist()
    units = [(order[a:b], torch.cat([shared.new_zeros(1), shared[a + 1:b]]))
             for a, b in zip(starts, starts[1:] + [len(order)])]
    return sorted(units, key=lambda unit: int(unit[0].min()))


@dataclass(frozen=True)
class Layout:
    """Where each row's tokens are in a packed sequence of ``len(input_ids)`` nodes."""
    input_ids: torch.Tensor  # [N] long
    position_ids: torch.Tensor  # [N] long: each node's position in its rows
    node: torch.Tensor  # [B, L] long: the node of row i's token j (0 past its length)
    allowed: torch.Tensor  # [N, N] bool: node a attends node b (b an ancestor of a, or a itself)


def layout(input_ids: torch.Tensor, lengths: torch.Tensor, packing: Packing) -> Layout:
    """The rows of ``input_ids`` [B, L] (row i ``lengths[i]`` tokens long) packed (``pack``: one after
    another) or as a prefix tree (``tree``: depth-first, each shared prefix once)."""
    ids, positions, node, added = _nodes(input_ids, lengths, packing)
    allowed = torch.zeros((len(ids), len(ids)), dtype=torch.bool)
    for row, start in enumerate(added.tolist()):
        # a node attends the row's path up to itself: the causal mask of the row, its new nodes' rows
        length = int(lengths[row])
        allowed[node[row, start:length, None], node[row, None, :length]] = (
            torch.arange(length)[None] <= torch.arange(start, length)[:, None])
    return Layout(ids, positions, node, allowed)


def _nodes(input_ids: torch.Tensor, lengths: torch.Tensor,
           packing: Packing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' nodes (``layout``'s ``input_ids``, ``position_ids`` [N] and ``node`` [B, L]) and where
    each row's own nodes begin among its tokens, [B] long: past the prefix it shares with the row
    before it in the tree's order (0 for ``pack``)."""
    if packing == "tree":
        order, shared = prefix_order(input_ids, lengths)
    elif packing == "pack":
        order, shared = torch.arange(len(lengths)), torch.zeros(len(lengths), dtype=torch.long)
    else:
        raise ValueError(f"packing must be pack or tree to lay rows out, got {packing!r}")
    lengths = lengths.cpu()
    node = torch.zeros(input_ids.shape, dtype=torch.long)
    total = int((lengths[order] - shared).sum())
    ids, positions = torch.zeros(total, dtype=torch.long), torch.zeros(total, dtype=torch.long)
    added = torch.zeros(len(lengths), dtype=torch.long)
    start, previous = 0, None
    for row, common in zip(order.tolist(), shared.tolist()):
        length = int(lengths[row])
        new = length - common  # the nodes this row adds, after the prefix it shares with the previous row
        if common:
            node[row, :common] = node[previous, :common]
        node[row, common:length] = torch.arange(start, start + new)
        ids[start:start + new] = input_ids[row, common:length].cpu()
        positions[start:start + new] = torch.arange(common, length)
        added[row] = common
        start, previous = start + new, row
    return ids, positions, node, added


@dataclass(frozen=True)
class Segments:
    """A packed pass's attention row by row (``segment_attention``), its nodes one sequence [1, N]
    that the model's other layers compute without padding: each row's new nodes (a tree's branch,
    a packed row) are its queries, its whole path (its prefix's nodes and its own) its keys, rows
    of like size grouped into one SDPA call each. A tree's dense [N, N] mask costs every node
    against every node of its packed row; a row's keys are its path alone."""
    queries: tuple[torch.Tensor, ...]  # per group [G, Q] long: each row's new nodes, then its first node
    keys: tuple[torch.Tensor, ...]  # per group [G, K] long: each row's path, then its first node
    allowed: tuple[torch.Tensor, ...]  # per group [G, 1, Q, K] bool: a query attends its path up to itself
    slots: tuple[torch.Tensor, ...]  # per group [n] long: the real queries among the G x Q
    inverse: torch.Tensor  # [N] long: the groups' real queries, one after another, back in node order

    def to(self, device) -> "Segments":
        return Segments(*(tuple(t.to(device) for t in getattr(self, name))
                          for name in ("queries", "keys", "allowed", "slots")), self.inverse.to(device))


def segments(node: torch.Tensor, lengths: torch.Tensor, added: torch.Tensor) -> Segments:
    """The ``Segments`` of rows whose tokens are the nodes ``node`` [B, L] (``_nodes``), row i
    ``lengths[i]`` long, its own nodes from token ``added[i]`` on. Rows in order of their new
    nodes, most first; a group takes the next row while its padded shape (rows x most queries x
    most keys) stays within 1.25 times the sum of its rows' own."""
    lengths = lengths.cpu()
    new = lengths - added
    groups, group, real = [], [], 0
    # a row with no node of its own (a response the same as another) has no query: no group's
    for row in [row for row in torch.argsort(new, descending=True, stable=True).tolist() if new[row] > 0]:
        size = int(new[row]) * int(lengths[row])
        if group:
            queries, keys = int(new[group[0]]), max(int(lengths[group].max()), int(lengths[row]))
            if (len(group) + 1) * queries * keys > _GROUP_SLACK * (real + size):
                groups.append(group)
                group, real = [], 0
        group, real = group + [row], real + size
    groups.append(group)
    parts = [_segment_group(node, lengths, added, torch.tensor(rows)) for rows in groups]
    order = torch.cat([nodes for *_, nodes in parts])
    return Segments(*(tuple(part[i] for part in parts) for i in range(4)), torch.argsort(order))


def _segment_group(node: torch.Tensor, lengths: torch.Tensor, added: torch.Tensor, rows: torch.Tensor):
    """One group of ``Segments``: (queries, keys, allowed, slots) and the node of each real query."""
    starts, ends = added[rows], lengths[rows]
    width_q, width_k = int((ends - starts).max()), int(ends.max())
    query_depth = starts[:, None] + torch.arange(width_q)[None]  # [G, Q]: each query's position in its row
    real = query_depth < ends[:, None]
    key_depth = torch.arange(width_k)[None]
    first = node[rows, :1]  # a padding slot reads its row's first node (and attends it alone: no row of -inf)
    keys = torch.where(key_depth < ends[:, None], node[rows, :width_k], first)
    queries = torch.where(real, torch.gather(node[rows], 1, query_depth.clamp(max=node.shape[1] - 1)), first)
    allowed = (key_depth[:, None] <= query_depth[..., None]) & real[..., None]
    allowed[..., 0] = True
    return queries, keys, allowed[:, None], torch.nonzero(real.flatten()).flatten(), queries[real]


def segment_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                      segments: Segments | None = None, **kwargs):
    """transformers' SDPA attention (``AttentionInterface``'s ``sdpa``), row by row where a packed
    pass hands its ``segments``: query [1, H, N, D], key and value [1, Hkv, N, D] of the pass's N
    nodes gathered to each group's rows [G, H, Q, D] and [G, Hkv, K, D], SDPA with the group's
    mask, and the real queries' outputs back in node order. Returns ([1, N, H, D], None) as
    transformers' attention functions do. A pass without segments (``none``, or a dense packed
    pass) is SDPA as it is."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outputs = []
    for queries, keys, allowed, slots in zip(segments.queries, segments.keys, segments.allowed, segments.slots):
        out, _ = sdpa_attention_forward(module, query[0][:, queries].transpose(0, 1), key[0][:, keys].transpose(0, 1),
                                        value[0][:, keys].transpose(0, 1), allowed, **kwargs)  # [G, Q, H, D]
        outputs.append(out.reshape(-1, *out.shape[2:])[slots])
    return torch.cat(outputs)[segments.inverse][None], None


_GROUP_SLACK = 1.25  # a group's padded shape against its rows' own (bench/packing.py: 1.1-2 alike)

SEGMENTED = "tether_sdpa"  # the attention implementation of a model whose packed passes go row by row


def segmented(model, on: bool = True) -> bool:
    """Give ``model`` (a module, DeepSpeed engine, LoRA or tether's ValueModel) ``segment_attention``
    in place of SDPA (``on``), or SDPA back. A model running another implementation (eager, whose
    family may have its own; flash-attn) keeps it and its packed passes dense 4-D masks. Returns
    whether the model now runs ``segment_attention``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    config = _config(model)
    implementation = _attention(config)
    if implementation not in ("sdpa", SEGMENTED):
        return False
    if on and SEGMENTED not in AttentionInterface._global_mapping:
        AttentionInterface.register(SEGMENTED, segment_attention)
        AttentionMaskInterface.register(SEGMENTED, _segments_mask)
    if on != (implementation == SEGMENTED):  # the setter writes every sub-config: only where it changes
        config._attn_implementation = SEGMENTED if on else "sdpa"
    return on


def segments_on(model) -> bool:
    """Whether ``model`` (a module, DeepSpeed engine, LoRA or ValueModel) runs ``segment_attention``."""
    return _attention(_config(model)) == SEGMENTED


def _segments_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """The mask transformers builds for a model of ``segment_attention``: SDPA's for a padded pass (its
    2-D mask given), none for a pass of segments (no mask given), which would otherwise be an
    [N, N] one built from its position ids and left unread."""
    from transformers.masking_utils import sdpa_mask

    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def packed(batch: SequenceBatch, packing: Packing, model=None) -> SequenceBatch:
    """``batch`` (right-padded rows) laid out as ``packing`` for ``model`` (its module,
    DeepSpeed engine or None: float32 and SDPA). A model of ``segment_attention``: every node one
    sequence, input_ids and position_ids [1, N], no attention_mask, and the pass's ``segments``.
    Any other: its rows in packed rows (``bins``), each a ``layout`` of whole rows, right-padded to
    the longest: input_ids and position_ids [R, W], a 4-D additive attention mask [R, 1, W, W] in
    the model's dtype. Either way response_positions [B, T] and last_positions [B] index the nodes
    one after another (``SequenceBatch.gather``).
    ``none``, or a batch of a policy that sees (its images, or the learner's blank image: the model
    places image tokens in padded rows, and ``checked`` turns packing off for it with a line):
    ``batch`` as it is."""
    if packing == "none" or batch.images is not None or batch.blank is not None:
        return batch
    device, lengths = batch.input_ids.device, batch.lengths.cpu()
    input_ids = batch.input_ids.cpu()
    if segments_on(model):  # one sequence of every node, attention row by row
        ids, positions, node, added = _nodes(input_ids, lengths, packing)
        return _indexed(replace(batch, input_ids=ids[None].to(device), attention_mask=None,
                                position_ids=positions[None].to(device),
                                segments=segments(node, lengths, added).to(device)), node.to(device))
    groups = bins(input_ids, lengths, batch.response_positions[:, 0].cpu() + 1, packing)
    lays = [layout(input_ids[group], lengths[group], packing) for group in groups]
    width = max(len(lay.input_ids) for lay in lays)
    ids = torch.zeros((len(lays), width), dtype=torch.long)
    positions = torch.zeros((len(lays), width), dtype=torch.long)
    allowed = torch.eye(width, dtype=torch.bool).repeat(len(lays), 1, 1)  # padding attends itself alone
    node = torch.zeros(input_ids.shape, dtype=torch.long)
    for r, (group, lay) in enumerate(zip(groups, lays)):
        n = len(lay.input_ids)
        ids[r, :n], positions[r, :n], allowed[r, :n, :n] = lay.input_ids, lay.position_ids, lay.allowed
        node[group, :lay.node.shape[1]] = lay.node + r * width
    if packing == "pack" and _attention(_config(model)).startswith("flash"):
        # unmeasured (no GPU was lent to this project's sessions): flash-attn's varlen kernel, which
        # takes no 4-D mask and reads the sequences of one row from its position ids restarting at 0
        # (transformers finds them in a batch of one row only): the packed rows as one; a node's
        # index r x W + j stays where it is
        mask, ids, positions = None, ids.reshape(1, -1), positions.reshape(1, -1)
    else:
        mask = additive(allowed.to(device), model)[:, None]
    return _indexed(replace(batch, input_ids=ids.to(device), attention_mask=mask, position_ids=positions.to(device)),
                    node.to(device))


def _indexed(run: SequenceBatch, node: torch.Tensor) -> SequenceBatch:
    """``run`` (a packed pass of the batch's rows) with its response and last positions read from
    the rows' to the nodes' (``node`` [B, L]: where each row's token is among the pass's nodes)."""
    return replace(run, response_positions=torch.gather(node, 1, run.response_positions),
                   last_positions=node[torch.arange(len(node), device=node.device), run.last_positions])


def _config(model):
    """The config of ``model`` (a module, DeepSpeed engine or None)."""
    return getattr(getattr(model, "module", model), "config", None)


def bins(input_ids: torch.Tensor, lengths: torch.Tensor, prompt_lengths: torch.Tensor,
         packing: Packing) -> list[torch.Tensor]:
    """The rows of a pass [B, L] (``lengths`` [B], prompts ``prompt_lengths`` [B] long) in packed rows:
    first fit, largest first, of the rows (``pack``) or of the units of rows that share a prompt
    (``tree``: ``prompt_units``, a unit larger than a packed row cut in runs of rows in their
    tokens' order): the dense layout, for a model off SDPA. A packed row's attention is dense over
    it, so one row of every token would cost the square of the pass's tokens where padded rows cost
    each the square of its own: packed rows are as long as the longest row (``pack``: none attends
    over more than a padded row does), or twice that (``tree``: a prompt with its responses; its
    attention may cost up to four padded rows', but it replaces two rows or more, and SDPA over 4
    rows of 600 took 0.11 s where 16 padded rows of 300 took 0.16 s here). Returns each packed
    row's row indices."""
    capacity = (2 if packing == "tree" else 1) * int(lengths.max())
    if packing == "pack":
        items = [(torch.tensor([row]), int(lengths[row])) for row in range(len(lengths))]
    else:
        items = []
        for unit, shared in _units(input_ids, lengths, prompt_lengths):
            # in their tokens' order, a run of rows is a tree of its first row and what each adds
            sizes, added = lengths[unit].tolist(), (lengths[unit] - shared).tolist()
            start = 0
            while start < len(unit):
                size, end = sizes[start], start + 1
                while end < len(unit) and size + added[end] <= capacity:
                    size, end = size + added[end], end + 1
                items.append((unit[start:end], size))
                start = end
    rows: list[list[torch.Tensor]] = []
    room: list[int] = []
    for item, size in sorted(items, key=lambda entry: -entry[1]):
        fits = next((b for b, left in enumerate(room) if left >= size), None)
        if fits is None:
            rows.append([item])
            room.append(capacity - size)
        else:
            rows[fits].append(item)
            room[fits] -= size
    return [torch.cat(items) for items in rows]


def additive(allowed: torch.Tensor, model=None) -> torch.Tensor:
    """``allowed`` (bool) as an additive attention mask in ``model``'s dtype (None: float32): 0 where
    a token may attend, the dtype's lowest where not."""
    dtype = next(model.parameters()).dtype if model is not None else torch.float32
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed,
                                                                                       torch.finfo(dtype).min)


def for_model(run: SequenceBatch, model) -> SequenceBatch:
    """A packed ``run`` made for one model, for ``model``: the same layout, its mask in ``model``'s
    dtype (the actor's pass read again by the critic)."""
    if run.segments is not None and not segments_on(model):
        raise ValueError(f"a pass laid out for segment attention cannot run on a model of "
                         f"{_attention(_config(model))}: lay it out for that model (common.packing.packed)")
    mask = run.attention_mask
    if run.position_ids is None or mask is None or mask.dtype == next(model.parameters()).dtype:
        return run
    return replace(run, attention_mask=additive(mask == 0, model))


def _attention(config) -> str:
    """The attention implementation a model of ``config`` runs: sdpa, eager, flash_attention_2..."""
    return str(getattr(config, "_attn_implementation", None) or "sdpa")


def packed_tokens(input_ids: torch.Tensor, lengths: torch.Tensor, packing: Packing) -> int:
    """What a forward pass of these rows computes, in tokens: rows x longest (``none``), their sum
    (``pack``), or the prefix tree's nodes (``tree``)."""
    if not len(lengths):
        return 0
    if packing == "none":
        return len(lengths) * int(lengths.max())
    if packing == "pack":
        return int(lengths.sum())
    order, shared = prefix_order(input_ids, lengths)
    return int(lengths.sum() - shared.sum())


def refusal(model_config, max_length: int | None, packing: Packing = "tree") -> str | None:
    """Why a model of ``model_config`` cannot take a packed pass, or None: a family whose positions
    come from the 2-D mask (ALiBi), a sliding window shorter than the sequences (the 4-D mask would
    let a token see past it), a model that sees (its image tokens are placed in the padded rows)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    family = getattr(model_config, "model_type", "?")
    attention = _attention(model_config)
    if packing == "tree" and attention.startswith("flash"):
        return f"{family} runs {attention}, which takes no tree's mask (sdpa does)"
    if text is not model_config or getattr(model_config, "vision_config", None) is not None:
        return f"{family} sees images, whose tokens the model places in padded rows"
    if family in _ALIBI:
        return f"{family} computes its ALiBi positions from the 2-D attention mask"
    window = getattr(text, "sliding_window", None)
    uses_window = getattr(text, "use_sliding_window", True) and window is not None
    if uses_window and (max_length is None or max_length > window):
        return (f"{family} attends within a sliding window of {window} tokens, shorter than the "
                f"sequences ({max_length or 'unbounded'}), which a 4-D mask does not apply")
    return None


_ALIBI = ("bloom", "mpt", "falcon", "baichuan")


def probe_mismatch(model, packing: Packing) -> float:
    """The largest difference of the last hidden states between a padded pass and a ``packing`` pass
    of the same four short rows (two sharing a prefix, and packed rows of two rows or more) on
    ``model`` itself, relative to their largest: what ``checked`` compares."""
    vocab = int(model.config.get_text_config().vocab_size)
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (5,), generator=generator)
    rows = [torch.cat([prefix, torch.randint(0, vocab, (n,), generator=generator)]) for n in (3, 6)]
    # two short rows more: 4 + 3 fit in one packed row beside the 8 and 11 (pack), as the two that
    # share a prefix fit in one tree, so that a mask a family ignores lets rows see each other
    rows += [torch.randint(0, vocab, (n,), generator=generator) for n in (4, 3)]
    lengths = torch.tensor([len(row) for row in rows])
    input_ids = torch.zeros((len(rows), int(lengths.max())), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, :len(row)] = row
    attention_mask = (torch.arange(input_ids.shape[1])[None] < lengths[:, None]).long()
    positions = torch.arange(1, input_ids.shape[1])[None].expand(len(rows), -1).clone()
    batch = SequenceBatch(input_ids, attention_mask, input_ids[:, 1:], positions - 1,
                          (positions < lengths[:, None]).float(), lengths - 1).to(next(model.parameters()).device)
    run = packed(batch, packing, model)
    with torch.no_grad():
        padded, pack = _outputs(model, batch), _outputs(model, run)
    mask = batch.response_mask.bool()
    reference = batch.gather(padded)[mask]
    return float((reference - run.gather(pack)[mask]).abs().max() / reference.abs().max().clamp(min=1e-6))


def _outputs(model, batch: SequenceBatch) -> torch.Tensor:
    """The last hidden states [B, L, H] of ``model``'s transformer body, which every head reads
    (a causal LM's, a critic's, a reward model's alike; a LoRA model's through its base)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    # no cache, as the learner's and the scorer's passes (transformers reads packed position ids then)
    return inner.base_model(**batch.model_inputs, use_cache=False).last_hidden_state.float()


def checked(model, packing: Packing, max_length: int | None, log, what: str, segments: bool = True) -> Packing:
    """``packing`` for ``model`` (a module: ``what`` names it in the line), or ``none`` with a line
    saying why where the family cannot take it (``refusal``), or where a packed pass of four short
    rows differs from a padded one by more than its dtype's rounding allows, relative to the
    hidden states' largest (a family that builds its own mask whatever it is handed: never silently
    wrong). A model on SDPA is given ``segment_attention`` (``segmented``) where its packed pass
    passes the probe (and ``segments``), else keeps SDPA and dense masks where those pass it."""
    if packing == "none":
        return packing
    config = model.config
    reason = refusal(config, max_length, packing)
    if reason is None:
        for segment in (True, False) if segments else (False,):
            if segmented(model, segment) != segment:
                continue  # off SDPA: no segment attention to give it
            reason = _probed(model, packing)
            if reason is None:
                return packing
    segmented(model, False)
    (log or logging.getLogger(__name__)).warning("packing %s is off for %s (none): %s", packing, what, reason)
    return "none"


def _probed(model, packing: Packing) -> str | None:
    """Why ``probe_mismatch`` finds ``model``'s packed pass unlike its padded one, or None."""
    config = model.config
    try:
        gap = probe_mismatch(model, packing)
    except Exception as error:  # noqa: BLE001 - a family whose forward refuses the 4-D mask or positions
        return f"a {packing} pass fails on {config.model_type}: {type(error).__name__}: {error}"
    if not gap <= _PROBE_TOLERANCE.get(next(model.parameters()).dtype, 0.1):
        return f"a {packing} pass differs from a padded one by {gap:.2e} on {config.model_type}"
    return None


# relative to the largest hidden state: float32 measured 1e-7 on the eight families of the tests;
# bf16 and fp16 keep 8 and 11 bits, and two kernels' sums round apart by a few of them
_PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.05, torch.float16: 0.01}
