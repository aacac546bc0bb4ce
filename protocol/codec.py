"""msgpack envelope + raw tensor frames; every decode validates against ``schema.MESSAGES``.

Nothing is ever pickled: a peer with another schema version, an unknown message type, a field
of the wrong type, a tensor whose bytes do not match its declared dtype and shape, or a frame
over the size limit is refused with a ``ProtocolError`` that says what was wrong.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any, Sequence

import msgpack
import numpy as np

from protocol.errors import ProtocolError
from protocol.message import Message
from protocol.schema import MESSAGES, SCHEMA_VERSION, UNCHANGED_SINCE, string_limit

__all__ = ["DEFAULT_MAX_FRAME_BYTES", "Message", "ProtocolError", "cut", "decode", "encode"]

DEFAULT_MAX_FRAME_BYTES = 256 * 1024 * 1024
MAX_TENSOR_DIMS = 8  # tether's tensors are flat or 2-D: more is no message of ours

# a peer's value in an error: a few levels, a few items, a short string (a list nested 1,000 deep
# made repr raise RecursionError, and a 100 MB string a 100 MB log line)
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 3, 60, 60, 6, 6


def _shown(value: Any) -> str:
    return _REPR.repr(value)

_DTYPES = {name: np.dtype(name) for name in ("int32", "int64", "float32", "float16", "uint8", "bool")}
_PY_TYPES = {"int": int, "float": (int, float), "str": str, "bool": bool, "dict": dict, "any": object}


def encode(msg_type: str, fields: dict[str, Any] | None = None, tensors: dict[str, Any] | None = None,
           msg_id: int = 0) -> list[Any]:
    """Frames for one message: [envelope, tensor bytes...]. Tensors: numpy arrays or torch tensors."""
    schema = MESSAGES.get(msg_type)
    if schema is None:
        raise ProtocolError(f"unknown message type {msg_type!r}")
    fields = fields or {}
    arrays = {name: _as_numpy(value) for name, value in (tensors or {}).items()}
    _check_fields(msg_type, schema.fields, fields)  # refuse to send what the peer would refuse
    envelope = {
        "schema": SCHEMA_VERSION,
        "type": msg_type,
        "id": msg_id,
        "fields": fields,
        "tensors": [[name, str(array.dtype), list(array.shape)] for name, array in arrays.items()],
    }
    return [msgpack.packb(envelope, use_bin_type=True)] + [memoryview(np.ascontiguousarray(a)).cast("B")
                                                            for a in arrays.values()]


def decode(frames: Sequence[Any], max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, kept: bool = False) -> Message:
    """Validate and decode frames (bytes, memoryviews or zmq.Frame) into a ``Message``. Whatever
    the frames hold, a bad message is a ``ProtocolError``: the error a receiving loop catches.
    ``kept``: a message written earlier (a recorded batch), which an older schema version wrote
    alike where its type has not changed since (``schema.UNCHANGED_SINCE``)."""
    try:
        return _decode(frames, max_frame_bytes, kept)
    except ProtocolError:
        raise
    except Exception as error:  # RecursionError, MemoryError, ...: a check this codec missed, never a crash
        raise ProtocolError(f"malformed message ({type(error).__name__})") from None


def _decode(frames: Sequence[Any], max_frame_bytes: int, kept: bool = False) -> Message:
    buffers = [frame.buffer if hasattr(frame, "buffer") else frame for frame in frames]
    if not buffers:
        raise ProtocolError("empty message")
    for index, buffer in enumerate(buffers):
        size = memoryview(buffer).nbytes
        if size > max_frame_bytes:
            raise ProtocolError(f"frame {index} has {size} bytes, over the limit of {max_frame_bytes}")
    try:
        envelope = msgpack.unpackb(buffers[0], raw=False, strict_map_key=True)
    except Exception as error:  # msgpack raises several types for garbage
        raise ProtocolError(f"envelope is not valid msgpack ({type(error).__name__})") from None
    if not isinstance(envelope, dict):
        raise ProtocolError("envelope is not a map")
    schema_version, msg_type = envelope.get("schema"), envelope.get("type")
    since = UNCHANGED_SINCE.get(msg_type, SCHEMA_VERSION) if kept and isinstance(msg_type, str) else SCHEMA_VERSION
    if not (isinstance(schema_version, int) and since <= schema_version <= SCHEMA_VERSION):
        raise ProtocolError(f"peer speaks schema version {_shown(schema_version)}, this process speaks {SCHEMA_VERSION}"
                            + (f" (a kept {msg_type} message: from version {since} on)" if kept else ""))
    schema = MESSAGES.get(msg_type) if isinstance(msg_type, str) else None
    if schema is None:
        raise ProtocolError(f"unknown message type {_shown(msg_type)}")
    msg_id, fields, tensor_specs = envelope.get("id"), envelope.get("fields"), envelope.get("tensors")
    if not isinstance(msg_id, int) or not isinstance(fields, dict) or not isinstance(tensor_specs, list):
        raise ProtocolError(f"{msg_type}: envelope needs an int id, a fields map and a tensors list")
    _check_fields(msg_type, schema.fields, fields)
    if len(tensor_specs) != len(buffers) - 1:
        raise ProtocolError(f"{msg_type}: envelope declares {len(tensor_specs)} tensors but {len(buffers) - 1} frames came")
    tensors = {}
    for spec, buffer in zip(tensor_specs, buffers[1:]):
        name, array = _decode_tensor(msg_type, schema.tensors, spec, buffer)
        tensors[name] = array
    missing = {name for name, dtype in schema.tensors.items() if not dtype.endswith("?")} - set(tensors)
    if missing:
        raise ProtocolError(f"{msg_type}: missing tensor(s) {sorted(missing)}")
    return Message(type=msg_type, fields=fields, tensors=tensors, id=msg_id)


def cut(text: str, limit: int | None = None) -> str:
    """``text`` within ``limit`` characters, by default the bound of a ``reason`` (an error's, a
    stopping role's): what a process says of an error of unknown length still travels, or is logged."""
    limit = limit or string_limit("reason")
    return text if len(text) <= limit else text[:limit - 20] + " ... (cut)"


def _as_numpy(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach"):  # torch.Tensor, without importing torch here
        return value.detach().cpu().contiguous().numpy()
    raise ProtocolError(f"tensor must be a numpy array or torch tensor, got {type(value).__name__}")


def _check_fields(msg_type: str, declared: dict[str, str], fields: dict[str, Any]) -> None:
    unknown = set(fields) - set(declared)
    if unknown:
        raise ProtocolError(f"{msg_type}: unknown field(s) {_shown(sorted(unknown))}")
    for name, type_name in declared.items():
        optional = type_name.endswith("?")
        type_name = type_name.rstrip("?")
        if name not in fields:
            if optional:
                continue
            raise ProtocolError(f"{msg_type}: missing field {name!r}")
        value = fields[name]
        if value is None and optional:
            continue
        if type_name.startswith("list["):
            element_type = _PY_TYPES[type_name[5:-1]]
            ok = isinstance(value, list) and all(
                isinstance(v, element_type) and not (element_type is int and isinstance(v, bool)) for v in value
            )
        else:
            expected = _PY_TYPES[type_name]
            ok = isinstance(value, expected) and not (type_name == "int" and isinstance(value, bool))
        if not ok:
            raise ProtocolError(f"{msg_type}: field {name!r} must be {type_name}, got {type(value).__name__}")
        if type_name in ("str", "list[str]"):
            limit = string_limit(name)
            longest = max(map(len, value), default=0) if type_name == "list[str]" else len(value)
            if longest > limit:
                raise ProtocolError(f"{msg_type}: field {name!r} holds a string of {longest} characters, at most "
                                    f"{limit} characters are taken")


def _decode_tensor(msg_type: str, declared: dict[str, str], spec: Any, buffer: Any) -> tuple[str, np.ndarray]:
    if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str) and isinstance(spec[1], str)
            and isinstance(spec[2], list) and len(spec[2]) <= MAX_TENSOR_DIMS
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in spec[2])):
        raise ProtocolError(f"{msg_type}: malformed tensor spec {_shown(spec)}")
    name, dtype_name, shape = spec
    if name not in declared:
        raise ProtocolError(f"{msg_type}: unknown tensor {_shown(name)}")
    if dtype_name != declared[name].rstrip("?"):
        raise ProtocolError(f"{msg_type}: tensor {name!r} must be {declared[name].rstrip('?')}, got {dtype_name[:40]}")
    dtype = _DTYPES[dtype_name]
    expected_bytes = math.prod(shape) * dtype.itemsize  # Python's ints: int64's product of [2**32, 2**32] wrapped to 0
    actual_bytes = memoryview(buffer).nbytes
    if actual_bytes != expected_bytes:
        raise ProtocolError(
            f"{msg_type}: tensor {name!r} of shape {shape} {dtype_name} needs {expected_bytes} bytes, got {actual_bytes}"
        )
    # Zero-copy view over the received frame; read-only, as the frame's memory is.
    return name, np.frombuffer(buffer, dtype=dtype).reshape(shape)
