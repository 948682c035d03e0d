"""msgpack codec for specmesh wire messages (DESIGN.md §3). Never pickle.

Wire format of one message, a list of frames:

- frame 0, the header: msgpack of ``[tag, {field_name: value, ...}]``. Every field of the
  dataclass is present. Tuples travel as lists. A nested registered message is an
  ``ExtType(EXT_MESSAGE, packb([tag, {fields}]))``; a :class:`~protocol.messages.Buffer` is an
  ``ExtType(EXT_BUFFER, packb([frame_index, dtype_name, shape]))``.
- frames 1..n: the raw bytes of each Buffer, in the order they were met, passed through as-is
  (no copy of a ``memoryview``).

:func:`decode` trusts nothing: it validates the header against the dataclass annotations (the
checks of :mod:`protocol.schema`), the frame references, dtype names and byte sizes, and raises
:class:`ProtocolError` (only that) on anything wrong. Frame limits are module attributes, read at
every call (tests may monkeypatch them); nesting and shape limits live in :mod:`protocol.schema`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from specmesh.protocol.errors import ProtocolError
from specmesh.protocol._legacy.messages import REGISTRY, Buffer, buffer_nbytes
from specmesh.protocol._legacy.schema import (  # noqa: F401 - limits and ext codes are part of codec's API
    EXT_BUFFER,
    EXT_MESSAGE,
    MAX_DEPTH,
    MAX_NDIM,
    Ctx,
    decode_body,
    spec_of,
    split,
    unpack,
)

#: Largest header frame accepted by :func:`decode`, bytes.
MAX_HEADER_BYTES = 16 << 20
#: Largest buffer frame accepted by :func:`decode`, bytes.
MAX_BUFFER_BYTES = 1 << 30
#: Most frames (header included) accepted by :func:`decode`.
MAX_FRAMES = 64

_ExtType = msgpack.ExtType
_packb = msgpack.packb
# Initial msgpack Packer buffer (grows as needed). msgpack's 256 KiB default costs a large
# malloc per packb, ~10 us when packb nests (nested messages, buffer references).
_SMALL_BUF = 1024

Frame = Any  # bytes | memoryview | an object with a ``.buffer`` memoryview (zmq.Frame)


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------


def _as_view(frame: Frame) -> bytes | memoryview:
    """``frame`` as bytes or a contiguous 1-D byte memoryview (no copy)."""
    if type(frame) is bytes:
        return frame
    try:
        if isinstance(frame, memoryview):
            mv = frame
        else:
            buf = getattr(frame, "buffer", None)  # zmq.Frame
            mv = buf if isinstance(buf, memoryview) else memoryview(frame)
        if mv.ndim != 1 or mv.format != "B":
            if not mv.c_contiguous:
                raise ProtocolError("frame is not contiguous")
            mv = mv.cast("B")
        elif not mv.c_contiguous:
            raise ProtocolError("frame is not contiguous")
    except ProtocolError:
        raise
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"frame of type {_got(frame)} is not a byte buffer: {e}") from None
    return mv


def decode(frames: Sequence[Frame]) -> Any:
    """Decode one message from its frames (as produced by :func:`encode`).

    Args:
        frames: ``[header, *buffer_frames]``; each is bytes, a memoryview or an object with a
            ``.buffer`` memoryview (``zmq.Frame``). Buffer data is not copied: a decoded
            :class:`Buffer` holds the frame itself (bytes or a byte memoryview).

    Returns:
        The message dataclass instance.

    Raises:
        ProtocolError: on anything malformed (and on nothing else): a frame that is not a
            byte buffer, zero or too many frames (``MAX_FRAMES``), an oversize header
            (``MAX_HEADER_BYTES``) or buffer (``MAX_BUFFER_BYTES``), bytes that are not one
            msgpack object, an unknown tag, missing / unknown fields, a field of the wrong
            type, a bad buffer reference (missing / extra / reused frame, unknown dtype,
            negative dims, byte size != prod(shape) * itemsize), nesting past ``MAX_DEPTH``,
            or a dataclass that rejects its fields. ``request_id`` is set on the error when
            the header carried a string ``request_id`` field.
    """
    try:
        return _decode(frames)
    except ProtocolError:
        raise
    except Exception as e:  # noqa: BLE001 - safety net: a peer must never crash the role
        raise ProtocolError(f"undecodable message: {type(e).__name__}: {e}") from None


def _decode(frames: Sequence[Frame]) -> Any:
    if isinstance(frames, (bytes, bytearray, memoryview, str)):
        raise ProtocolError("decode() takes a sequence of frames, not a single buffer")
    try:
        n = len(frames)
    except TypeError:
        raise ProtocolError(f"decode() takes a sequence of frames, got {_got(frames)}") from None
    if n == 0:
        raise ProtocolError("no frames")
    if n > MAX_FRAMES:
        raise ProtocolError(f"{n} frames > MAX_FRAMES={MAX_FRAMES}")
    views = [_as_view(f) for f in frames]
    header = views[0]
    if len(header) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(header)} bytes > MAX_HEADER_BYTES={MAX_HEADER_BYTES}")
    for i in range(1, n):
        if len(views[i]) > MAX_BUFFER_BYTES:
            raise ProtocolError(
                f"frame {i} of {len(views[i])} bytes > MAX_BUFFER_BYTES={MAX_BUFFER_BYTES}")
    obj = unpack(header)
    request_id = None
    if type(obj) is list and len(obj) == 2 and type(obj[1]) is dict:
        request_id = obj[1].get("request_id")
        if type(request_id) is not str:
            request_id = None
    try:
        tag, body = split(obj)
        cls = REGISTRY.get(tag)
        if cls is None:
            raise ProtocolError(f"unknown message tag {tag}")
        ctx = Ctx(views)
        msg = decode_body(spec_of(cls), body, ctx)
        if len(ctx.used) != n - 1:
            unused = sorted(set(range(1, n)) - ctx.used)
            raise ProtocolError(f"{cls.__name__}: frames {unused} are not referenced")
        return msg
    except ProtocolError as e:
        if e.request_id is None:
            e.request_id = request_id
        raise


# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------


def _fields_of(msg: Any, spec) -> dict[str, Any]:
    return {name: getattr(msg, name) for name in spec.names}


def _buffer_ref(buf: Buffer, frames: list) -> _ExtType:
    shape = list(buf.shape)
    nbytes = buffer_nbytes(buf.dtype, shape)
    data = buf.data
    if type(data) is bytes:
        size = len(data)
    else:
        mv = memoryview(data)
        if not mv.c_contiguous:
            raise ValueError("Buffer data must be C-contiguous")
        size = mv.nbytes
    if size != nbytes:
        raise ValueError(f"Buffer {buf.dtype}{tuple(shape)} needs {nbytes} bytes, has {size}")
    frames.append(data)
    return _ExtType(EXT_BUFFER, _packb([len(frames) - 1, buf.dtype, shape], buf_size=_SMALL_BUF))


def encode(msg: Any) -> list[bytes | memoryview]:
    """Encode a registered message into frames ``[header, *buffer_data]``.

    Buffer data is passed through without a copy (the caller must not mutate it until sent).

    Raises:
        TypeError: ``msg`` (or a nested value) is not a registered message, a Buffer or a
            msgpack-native value.
        ValueError: a Buffer whose dtype is unknown or whose data size != prod(shape)*itemsize.
    """
    spec = spec_of(type(msg))
    frames: list = [b""]

    def default(obj: Any) -> _ExtType:
        if type(obj) is Buffer:
            return _buffer_ref(obj, frames)
        inner = spec_of(type(obj))
        return _ExtType(EXT_MESSAGE, _packb([inner.tag, _fields_of(obj, inner)], default=default,
                                            buf_size=_SMALL_BUF))

    frames[0] = _packb([spec.tag, _fields_of(msg, spec)], default=default, buf_size=_SMALL_BUF)
    return frames


def encoded_size(frames: Sequence[Frame]) -> int:
    """Total bytes of ``frames`` (header included), e.g. for transfer metrics."""
    total = 0
    for f in frames:
        if type(f) is bytes:
            total += len(f)
        else:
            buf = getattr(f, "buffer", None)
            total += (buf if isinstance(buf, memoryview) else memoryview(f)).nbytes
    return total


__all__ = [
    "encode", "decode", "encoded_size", "MAX_HEADER_BYTES", "MAX_BUFFER_BYTES", "MAX_FRAMES",
    "MAX_DEPTH", "MAX_NDIM", "EXT_MESSAGE", "EXT_BUFFER",
]
