"""A sample as it travels rollout -> buffer -> scorer -> buffer -> learner, declared once, and its
ragged packing.

``Sample`` is the table of a sample's columns: each wire column is one ``column(...)`` line saying
its name on the wire, whether it is one value per sample or one per prompt or response token, and
its type. The schema's sample fields and tensors (``sample_fields``, ``sample_tensors``), the
packing and the checks on receipt all follow from that table, so a new column is one line.

Samples of different lengths travel as one message: the per-token columns of every sample
concatenated into one flat tensor each, with the per-sample lengths as fields; per-sample columns
travel as lists.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from itertools import repeat
from operator import attrgetter, is_, is_not
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from protocol.errors import ProtocolError

if TYPE_CHECKING:
    from protocol.message import Message

Per = Literal["sample", "prompt token", "response token", "image byte"]

# the field that carries each sample's length of a per-token kind (an image byte's: its images' bytes,
# ``common.images.pack_images``; the field is left out of a message where no sample has images)
LENGTHS: dict[str, str] = {"prompt token": "prompt_lengths", "response token": "response_lengths",
                           "image byte": "image_byte_lengths"}
_OPTIONAL_LENGTHS = ("image byte",)  # kinds a sample may have none of
_LIST_TYPES = ("int", "float", "str")  # dtypes of per-sample columns that travel as lists


@dataclass(frozen=True)
class Column:
    """One column of a sample on the wire."""
    name: str  # the ``Sample`` attribute
    wire: str  # the field (per sample: a list) or the flat tensor (per token) that carries it
    per: Per
    # "int", "float", "str": a per-sample list field; a numpy dtype: a flat tensor ([samples] per sample)
    dtype: str
    scored: bool = False  # the scorer fills it in: it travels in ``scored`` and ``batch`` messages only
    # may be None. A list field: then None for every sample of a message. A per-token tensor: left out
    # of a message where no sample has it, and ``absent`` at each token of a sample without it
    optional: bool = False
    finite: bool = False  # trained on: NaN or inf refuses the message
    absent: float = 0.0

    @property
    def is_tensor(self) -> bool:
        return self.dtype not in _LIST_TYPES


def column(wire: str, per: Per, dtype: str, *, scored: bool = False, optional: bool = False, finite: bool = False,
           absent: float = 0.0, default: Any = MISSING) -> Any:
    """A ``Sample`` field that travels: ``Column``'s arguments, its name taken from the attribute."""
    return field(default=default, metadata={"column": (wire, per, dtype, scored, optional, finite, absent)})


@dataclass(eq=False)
class _Chunk:
    """The flat tensors of one received message, which its samples view into."""
    tensors: dict[str, np.ndarray]
    ends: dict[str, np.ndarray]  # per token kind ("prompt token", ...): cumulative lengths


@dataclass
class Sample:
    sample_id: str = column("sample_ids", "sample", "str")
    prompt_index: int = column("prompt_indices", "sample", "int")  # its place in the run's prompt stream
    # the policy version of the weights that generated its first token: the oldest, if they changed meanwhile
    behavior_version: int = column("behavior_versions", "sample", "int")
    prompt_tokens: np.ndarray = column("prompt_tokens", "prompt token", "int32")
    response_tokens: np.ndarray = column("response_tokens", "response token", "int32")
    behavior_logprobs: np.ndarray = column("behavior_logprobs", "response token", "float32", finite=True)  # vLLM's
    finish_reason: str = column("finish_reasons", "sample", "str")  # "stop" (end of sequence) or "length"
    ref_logprobs: np.ndarray | None = column("ref_logprobs", "response token", "float32", scored=True, finite=True,
                                             default=None)  # the frozen reference's, from the scorer
    # the teacher's (models.teacher, on-policy distillation), from the scorer, at the rollout's sampling
    # (a message where some samples lack it is refused: a logprob of 0, probability 1, would be trained)
    teacher_logprobs: np.ndarray | None = column("teacher_logprobs", "response token", "float32", scored=True,
                                                 optional=True, finite=True, absent=math.nan, default=None)
    # from the scorer: the reward model's score plus the reward functions' (what is trained on)
    reward: float | None = column("rewards", "sample", "float32", scored=True, finite=True, default=None)
    # from the scorer's rule-based gold reward, where the task has one (reported, never trained on)
    gold_reward: float | None = column("gold_rewards", "sample", "float", scored=True, optional=True, default=None)
    # from the scorer: why the sample's whole group is not to be trained (a reward call that failed, a
    # judge's answer that did not parse, under drop_group); "" or None: trained
    drop_reason: str | None = column("drop_reasons", "sample", "str", scored=True, optional=True, default=None)
    data_row: int = column("data_rows", "sample", "int", default=-1)  # the prompt's row in the data file
    # the version that generated its last token: newer than behavior_version when the weights changed
    # while it was generated (a streaming rollout loads them between engine steps); None: the same
    last_behavior_version: int = column("last_behavior_versions", "sample", "int", default=None)
    # an episode's tokens: 1 where the policy sampled the token, 0 at the environment's (an
    # observation, a tool's result), which carry no behavior logprob and are never trained on
    loss_mask: np.ndarray | None = column("loss_mask", "response token", "uint8", optional=True, absent=1.0,
                                          default=None)
    # the environment's reward for a turn, on that turn's last policy token
    turn_rewards: np.ndarray | None = column("turn_rewards", "response token", "float32", optional=True,
                                             finite=True, default=None)
    # an episode's conversation as JSON (a list of {"role", "content"}): what reward functions and an RM
    # with its own chat template read, and what evaluations show
    messages: str | None = column("messages", "sample", "str", optional=True, default=None)
    # the images its prompt shows (and an episode's observations), encoded, as common.images packs them
    images: np.ndarray | None = column("image_bytes", "image byte", "uint8", optional=True, default=None)
    # an episode's place in its group and its parts: a program that rewrites its context starts a new
    # token stream, a part, of the same episode (None: one part each, as every single response). The
    # parts of an episode travel, are kept and are trained together; only its last part holds a credit
    episode_index: int | None = column("episode_indices", "sample", "int", optional=True, default=None)
    part_index: int | None = column("part_indices", "sample", "int", optional=True, default=None)
    episode_parts: int | None = column("episode_parts", "sample", "int", optional=True, default=None)
    # where a received sample's arrays lie, so consecutive samples of one message are re-sent as
    # one slice rather than concatenated one by one (a 512-sample batch: 1.5 ms -> well under)
    chunk: _Chunk | None = field(default=None, repr=False, compare=False)
    row: int = field(default=-1, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.last_behavior_version is None:
            self.last_behavior_version = self.behavior_version

    @property
    def scored(self) -> bool:
        return all(getattr(self, name) is not None for name in _SCORED_REQUIRED)

    @property
    def final(self) -> bool:
        """Whether it is its episode's last part: the one its episode's credit, score and outcome
        belong to (every sample that is not part of a split episode is)."""
        return self.part_index is None or self.part_index == self.episode_parts - 1

    @property
    def episode(self) -> tuple[int, int | str]:
        """Its episode, across the episode's parts: (prompt index, episode index), or the sample's
        own id where it is the only part."""
        return self.prompt_index, (self.episode_index if self.episode_index is not None else self.sample_id)


def group_is_whole(samples: list[Sample], samples_per_prompt: int) -> bool:
    """Whether ``samples`` (of one prompt) are all of its group: each of its ``samples_per_prompt``
    episodes with every one of its parts."""
    parts = {s.episode: s.episode_parts or 1 for s in samples}  # a sample without parts: one episode
    return (len(parts) == samples_per_prompt and len(samples) == sum(parts.values())
            and len({(s.episode, s.part_index) for s in samples}) == len(samples))


COLUMNS: tuple[Column, ...] = tuple(Column(f.name, *f.metadata["column"]) for f in fields(Sample)
                                    if "column" in f.metadata)
_SCORED_REQUIRED = tuple(c.name for c in COLUMNS if c.scored and not c.optional)
_TOKENS = {"prompt token": "prompt_tokens", "response token": "response_tokens",
           "image byte": "images"}  # what each length counts


def sample_fields(scored: bool) -> dict[str, str]:
    """The schema's fields of a message that carries samples (scored: with the scorer's columns)."""
    declared = {c.wire: f"list[{c.dtype}]" + ("?" if c.optional else "") for c in COLUMNS
                if not c.is_tensor and (scored or not c.scored)}
    lengths = {name: "list[int]" + ("?" if per in _OPTIONAL_LENGTHS else "") for per, name in LENGTHS.items()}
    return {**declared, **lengths}


def sample_tensors(scored: bool) -> dict[str, str]:
    """The schema's tensors of a message that carries samples: the flat per-token columns, and the
    per-sample ones that travel as a tensor."""
    return {c.wire: c.dtype + ("?" if c.optional else "") for c in COLUMNS
            if c.is_tensor and (scored or not c.scored)}


def _runs(samples: list[Sample]) -> list[tuple[int, int]]:
    """[start, stop) index ranges of consecutive rows of one received message (or single samples)."""
    runs, start = [], 0
    for i in range(1, len(samples) + 1):
        if (i == len(samples) or samples[i].chunk is None or samples[i].chunk is not samples[i - 1].chunk
                or samples[i].row != samples[i - 1].row + 1):
            runs.append((start, i))
            start = i
    return runs


def _flat_tensor(samples: list[Sample], runs: list[tuple[int, int]], col: Column) -> np.ndarray:
    """One flat tensor of column ``col`` of every sample: a run of one message's rows whose arrays
    still view that message is sliced in one piece; anything else is copied sample by sample."""
    pieces = []
    for start, stop in runs:
        chunk = samples[start].chunk
        source = chunk.tensors.get(col.wire) if chunk is not None else None
        # numpy points every view at the object that owns the memory: the message's frame
        owner = source if source is None or source.base is None else source.base
        arrays = list(map(attrgetter(col.name), samples[start:stop]))
        whole = not col.optional or not any(map(is_, arrays, repeat(None)))
        if source is not None and whole and all(map(is_, map(attrgetter("base"), arrays), repeat(owner))):
            ends = chunk.ends[col.per]
            first, last = samples[start].row, samples[stop - 1].row
            pieces.append(source[(int(ends[first - 1]) if first > 0 else 0):int(ends[last])])
        elif col.optional:  # a sample without it has ``absent`` at each of its tokens
            lengths = map(_length, map(attrgetter(_TOKENS[col.per]), samples[start:stop]))
            pieces.extend(array if array is not None else np.full(n, col.absent, col.dtype)
                          for array, n in zip(arrays, lengths))
        else:
            pieces.extend(arrays)
    return np.concatenate(pieces).astype(col.dtype, copy=False) if pieces else np.zeros(0, col.dtype)


def pack_samples(samples: list[Sample], scored: bool = False) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Fields and flat tensors for a ``samples``/``score_work``/``scored``/``batch`` message."""
    if scored:
        unscored = [s.sample_id for name in _SCORED_REQUIRED for s in samples if getattr(s, name) is None]
        if unscored:
            raise ValueError(f"samples {unscored[:5]} are not scored")
    columns = [c for c in COLUMNS if scored or not c.scored]
    fields_out: dict[str, Any] = {}
    for col in (c for c in columns if not c.is_tensor):
        values = list(map(attrgetter(col.name), samples))
        if col.optional and any(v is None for v in values):
            values = None
        elif col.dtype == "float":  # a numpy float would not pack
            values = [float(v) for v in values]
        fields_out[col.wire] = values
    for per, name in LENGTHS.items():
        values = list(map(attrgetter(_TOKENS[per]), samples))
        if per not in _OPTIONAL_LENGTHS or any(value is not None for value in values):
            fields_out[name] = list(map(_length, values))
    runs = _runs(samples)
    tensors = {c.wire: (_flat_tensor(samples, runs, c) if c.per != "sample"
                        else np.array([getattr(s, c.name) for s in samples], dtype=c.dtype))
               for c in columns if c.is_tensor
               and (not c.optional or any(map(is_not, map(attrgetter(c.name), samples), repeat(None))))}
    return fields_out, tensors


def unpack_samples(message: Message) -> list[Sample]:
    """Samples from a decoded message; lengths must add up to the flat tensors exactly."""
    fields_in, tensors = message.fields, message.tensors
    count = len(fields_in["sample_ids"])
    present = [c for c in COLUMNS if c.wire in (tensors if c.is_tensor else fields_in)]
    for name in [c.wire for c in present if not c.is_tensor] + list(LENGTHS.values()):
        if fields_in.get(name) is not None and len(fields_in[name]) != count:
            raise ProtocolError(f"{message.type}: {name} has {len(fields_in[name])} entries for {count} samples")
    lengths = {per: fields_in.get(name) or [0] * count for per, name in LENGTHS.items()}
    if any(n < 1 for per in LENGTHS if per not in _OPTIONAL_LENGTHS for n in lengths[per]):
        raise ProtocolError(f"{message.type}: every sample needs a prompt and a response of length >= 1")
    if any(n < 0 for per in _OPTIONAL_LENGTHS for n in lengths[per]):
        raise ProtocolError(f"{message.type}: a negative length")
    for col in (c for c in present if c.is_tensor):
        shape = tensors[col.wire].shape
        if col.per == "sample" and shape != (count,):
            raise ProtocolError(f"{message.type}: {col.wire} has shape {shape} for {count} samples")
        if col.per != "sample" and shape != (sum(lengths[col.per]),):
            raise ProtocolError(f"{message.type}: {col.wire} has shape {shape}, lengths add to {sum(lengths[col.per])}")
    for col in (c for c in present if c.finite):
        values = tensors[col.wire] if col.is_tensor else fields_in[col.wire]
        if not (np.isfinite(values).all() if col.is_tensor else all(math.isfinite(v) for v in values)):
            raise ProtocolError(f"{message.type}: {col.wire} holds NaN or inf")
    _check_episodes(message.type, tensors, lengths["response token"])
    _check_parts(message.type, [fields_in.get(name) for name in ("episode_indices", "part_indices", "episode_parts")])
    if any(last < first for first, last in zip(fields_in["behavior_versions"], fields_in["last_behavior_versions"])):
        raise ProtocolError(f"{message.type}: a sample's last_behavior_version is older than its behavior_version")

    ends = {per: np.cumsum(lengths[per]) for per in LENGTHS}
    chunk = _Chunk(tensors, ends)
    bounds = {per: stops.tolist() for per, stops in ends.items()}
    columns = []  # each present column's values, sample by sample
    for col in present:
        if not col.is_tensor:
            columns.append(fields_in[col.wire] if fields_in[col.wire] is not None else [None] * count)
        elif col.per == "sample":
            columns.append(tensors[col.wire].tolist())
        else:  # views into the frame, cut where each sample's tokens end (none: a sample without images)
            flat, stops = tensors[col.wire], bounds[col.per]
            columns.append([flat[start:stop] if stop > start or col.per not in _OPTIONAL_LENGTHS else None
                            for start, stop in zip([0, *stops[:-1]], stops)])
    names = [col.name for col in present]
    return [Sample(**dict(zip(names, values)), chunk=chunk, row=i) for i, values in enumerate(zip(*columns))]


def _check_episodes(message_type: str, tensors: dict[str, np.ndarray], response_lengths: list[int]) -> None:
    """An episode's masks make sense: 0 or 1, at least one policy token per sample (a sample the
    policy had no part in has nothing to train), and turn rewards only on policy tokens (on an
    environment's token the advantages would never see them)."""
    mask = tensors.get("loss_mask")
    if mask is not None:
        if mask.size and mask.max() > 1:
            raise ProtocolError(f"{message_type}: loss_mask holds values other than 0 and 1")
        starts = np.cumsum([0, *response_lengths[:-1]]).astype(np.int64)
        if len(response_lengths) and (np.add.reduceat(mask.astype(np.int64), starts) == 0).any():
            raise ProtocolError(f"{message_type}: a sample's loss_mask has no policy token")
    rewards = tensors.get("turn_rewards")
    if rewards is not None and mask is not None and (rewards[mask == 0] != 0).any():
        raise ProtocolError(f"{message_type}: a turn reward sits on an environment token (loss_mask 0)")


def _length(values) -> int:
    return 0 if values is None else len(values)


def _check_parts(message_type: str, columns: list[list[int] | None]) -> None:
    """An episode's parts are numbered within it: the three columns come together, and each part's
    index is below its episode's count of parts."""
    if all(values is None for values in columns):
        return
    if any(values is None for values in columns):
        raise ProtocolError(f"{message_type}: episode_indices, part_indices and episode_parts come together "
                            "or not at all")
    if any(episode < 0 or not 0 <= part < parts for episode, part, parts in zip(*columns)):
        raise ProtocolError(f"{message_type}: a sample's part_index is not within its episode_parts "
                            "(or its episode_index is negative)")
