"""Images as tether carries them (issue 36): the encoded bytes of each image a data row names or
an environment shows, read and checked to decode; packed into one array for the wire; decoded
into the RGB pictures a processor (and vLLM) takes.

A row names its images by path, relative to its data file: ``{"prompt": ..., "images": ["a.png"]}``
(or ``"messages"`` with ``"images"``), or as ``data:`` URLs.

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
from typing import Any

import numpy as np

from common.config import ConfigError
from common.prompts import image_part_path, image_paths

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
