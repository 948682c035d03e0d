"""msgpack codec for specmesh wire messages, on msgspec (docs/architecture.md, 'Messages').
Never pickle.

Wire format of one message, a list of frames:

- frame 0, the header: msgpack of a map ``{"tag": <int>, field_name: value, ...}`` holding
  every field of the message (protocol/messages.py). Tuples travel as lists; a nested message
  is a map of the same form; a :class:`~protocol.messages.Buffer` is an
  ``Ext(EXT_BUFFER, msgpack([frame_index, dtype_name, shape]))``.
- frames 1..n: the raw bytes of each Buffer, in the order they were met, passed through as-is
  (no copy of a ``memoryview``).

:func:`decode` trusts nothing. msgspec decodes the header straight into the tagged union of the
registered messages and checks every field's type and ``Meta`` bound in C (``bool`` is not
``int``; an ``int`` is accepted for a ``float``); unknown fields are refused; an absent field
with a default takes the default. The buffer references are checked against the frames (index,
dtype, shape, byte size, each frame used exactly once), then the checks that span fields
(protocol/cross_checks.py). Anything wrong raises :class:`ProtocolError`, and only that. Nesting
is bounded by the message classes (none contains itself), and a deeply nested header fails on
its first value of the wrong type, or at Python's recursion limit (a ProtocolError too). Frame
limits are module attributes, read at every call (tests may monkeypatch them).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta
from msgspec.msgpack import Ext

from specmesh.protocol.cross_checks import CROSS_FIELD_CHECKS
from specmesh.protocol.errors import ProtocolError
from specmesh.protocol.messages import DTYPE_ITEMSIZE, REGISTRY, Buffer, buffer_nbytes

#: Largest header frame accepted by :func:`decode`, bytes.
MAX_HEADER_BYTES = 16 << 20
#: Largest buffer frame accepted by :func:`decode`, bytes.
MAX_BUFFER_BYTES = 1 << 30
#: Most frames (header included) accepted by :func:`decode`.
MAX_FRAMES = 64
#: Most dimensions of a Buffer shape.
MAX_NDIM = 16
#: msgpack extension code of a Buffer reference in the header.
EXT_BUFFER = 2

Frame = Any  # bytes | memoryview | an object with a ``.buffer`` memoryview (zmq.Frame)

#: A Buffer reference, ``[frame_index, dtype_name, shape]``: bounds checked by msgspec.
_BufferRef = tuple[
    Annotated[int, Meta(ge=1)],
    Literal[tuple(DTYPE_ITEMSIZE)],  # type: ignore[misc]
    Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_NDIM)],
]
_ref_decoder = msgspec.msgpack.Decoder(_BufferRef)
_ref_encode = msgspec.msgpack.Encoder().encode
_any_decode = msgspec.msgpack.Decoder().decode
_ValidationError = msgspec.ValidationError

# Per-thread state of the call in progress: the frames being filled (encode) or read (decode)
# and the frame indices the header referenced so far (decode).
_state = threading.local()


# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------


def _enc_hook(obj: Any) -> Ext:
    """msgspec's hook for what it cannot encode: a Buffer becomes a frame and a reference."""
    if type(obj) is not Buffer:
        raise TypeError(f"{type(obj).__name__} is not a wire type (a registered message, a "
                        "Buffer or a msgpack-native value)")
    frames = getattr(_state, "out", None)
    if frames is None:
        raise TypeError("a Buffer outside a field typed Buffer")
    shape = list(obj.shape)
    nbytes = buffer_nbytes(obj.dtype, shape)
    data = obj.data
    if type(data) is bytes:
        size = len(data)
    else:
        mv = memoryview(data)
        if not mv.c_contiguous:
            raise ValueError("Buffer data must be C-contiguous")
        size = mv.nbytes
    if size != nbytes:
        raise ValueError(f"Buffer {obj.dtype}{tuple(shape)} needs {nbytes} bytes, has {size}")
    frames.append(data)
    return Ext(EXT_BUFFER, _ref_encode((len(frames) - 1, obj.dtype, shape)))


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_encode = _encoder.encode


def encode(msg: Any) -> list[bytes | memoryview]:
    """Encode a registered message into frames ``[header, *buffer_data]``.

    Buffer data is passed through without a copy (the caller must not mutate it until sent).
    Field values are not validated here (msgspec validates on decoding): a value of the wrong
    type that msgpack can carry reaches the peer, which refuses it.

    Raises:
        TypeError: ``msg`` is not an instance of a registered message class, or a value in it
            is neither a msgpack-native value, a nested message nor a Buffer.
        ValueError: a Buffer whose dtype is unknown or whose data size != prod(shape)*itemsize.
    """
    tables = _tables()
    has_buffers = tables.has_buffers.get(type(msg))
    if has_buffers is None:
        raise TypeError(f"{type(msg).__name__!r} is not a registered message class")
    if not has_buffers:
        return [_encode(msg)]
    frames: list = [b""]
    _state.out = frames
    try:
        frames[0] = _encode(msg)
    finally:
        _state.out = None
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


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------


def _dec_hook_no_frames(tp: type, obj: Any) -> Any:
    """msgspec's hook for a field typed Buffer, in a header that came alone."""
    raise ValueError(f"expected a Buffer reference, got {_what(obj)} (and the message has no "
                     "buffer frames)")


def _what(obj: Any) -> str:
    return f"ext {obj.code}" if type(obj) is Ext else type(obj).__name__


def _dec_hook(tp: type, obj: Any) -> Buffer:
    """msgspec's hook for a field typed Buffer: resolve the reference against the frames.
    (msgspec adds the field's path to what it raises.)"""
    if type(obj) is not Ext or obj.code != EXT_BUFFER:
        raise ValueError(f"expected a Buffer reference, got {_what(obj)}")
    try:
        idx, dtype, shape = _ref_decoder.decode(obj.data)
    except (_ValidationError, msgspec.DecodeError) as e:
        raise ValueError(f"malformed Buffer reference: {e}") from None
    frames = _state.frames
    if idx >= len(frames):
        raise ValueError(f"Buffer references frame {idx} of {len(frames)}")
    used = _state.used
    if idx in used:
        raise ValueError(f"frame {idx} referenced twice")
    nbytes = buffer_nbytes(dtype, shape)
    data_frame = frames[idx]
    if nbytes != len(data_frame):  # frames are bytes or 1-D 'B' memoryviews: len() is bytes
        raise ValueError(
            f"Buffer {dtype}{shape} needs {nbytes} bytes, frame {idx} has {len(data_frame)}")
    used.add(idx)
    return Buffer(dtype, shape, data_frame)


class _Tables:
    """Decoders and encoding facts of one state of :data:`REGISTRY`."""

    def __init__(self) -> None:
        self.version = REGISTRY.version
        classes = tuple(REGISTRY.values())
        union = Union[classes]  # type: ignore[valid-type]
        self.alone = msgspec.msgpack.Decoder(union, dec_hook=_dec_hook_no_frames).decode
        self.framed = msgspec.msgpack.Decoder(union, dec_hook=_dec_hook).decode
        #: message class -> whether an instance may carry a Buffer (then encode tracks frames)
        self.has_buffers = {cls: _may_hold_buffer(cls, set()) for cls in classes}


def _may_hold_buffer(tp: Any, seen: set) -> bool:
    """Whether a value of type ``tp`` (a message class or a field type) may contain a Buffer."""
    if tp is Buffer:
        return True
    if hasattr(tp, "__struct_fields__"):  # a message class
        if tp in seen:
            return False
        seen.add(tp)
        return any(_may_hold_buffer(f.type, seen) for f in msgspec.structs.fields(tp))
    return any(_may_hold_buffer(a, seen) for a in getattr(tp, "__args__", ()))


_current: _Tables | None = None


def _tables() -> _Tables:
    global _current
    t = _current
    if t is None or t.version != REGISTRY.version:
        t = _current = _Tables()
    return t


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
    except TypeError as e:
        raise ProtocolError(f"frame of type {type(frame).__name__} is not a byte buffer: {e}"
                            ) from None
    if not mv.c_contiguous:
        raise ProtocolError("frame is not contiguous")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


def decode(frames: Sequence[Frame]) -> Any:
    """Decode one message from its frames (as produced by :func:`encode`).

    Args:
        frames: ``[header, *buffer_frames]``; each is bytes, a memoryview or an object with a
            ``.buffer`` memoryview (``zmq.Frame``). Buffer data is not copied: a decoded
            :class:`Buffer` holds the frame itself (bytes or a byte memoryview).

    Returns:
        The message (an instance of a registered class).

    Raises:
        ProtocolError: on anything malformed (and on nothing else): a frame that is not a
            byte buffer, zero or too many frames (``MAX_FRAMES``), an oversize header
            (``MAX_HEADER_BYTES``) or buffer (``MAX_BUFFER_BYTES``), bytes that are not one
            msgpack object, an unknown tag, a missing field without a default, an unknown
            field, a field of the wrong type or out of its ``Meta`` bounds, a bad buffer
            reference (missing / extra / reused frame, unknown dtype, negative dims, more than
            ``MAX_NDIM`` dims, byte size != prod(shape) * itemsize), a failed cross-field check,
            or a message whose ``__post_init__`` rejects its fields. ``request_id`` is set on
            the error when the header carried a string ``request_id`` field.
    """
    header = None
    try:
        if isinstance(frames, (bytes, bytearray, memoryview, str)):
            raise ProtocolError("decode() takes a sequence of frames, not a single buffer")
        try:
            n = len(frames)
        except TypeError:
            raise ProtocolError(
                f"decode() takes a sequence of frames, got {type(frames).__name__}") from None
        if n == 0:
            raise ProtocolError("no frames")
        if n > MAX_FRAMES:
            raise ProtocolError(f"{n} frames > MAX_FRAMES={MAX_FRAMES}")
        header = frames[0] if type(frames[0]) is bytes else _as_view(frames[0])
        if len(header) > MAX_HEADER_BYTES:
            raise ProtocolError(
                f"header of {len(header)} bytes > MAX_HEADER_BYTES={MAX_HEADER_BYTES}")
        tables = _tables()
        if n == 1:
            msg = tables.alone(header)
        else:
            views = [header]
            for i in range(1, n):
                view = _as_view(frames[i])
                if len(view) > MAX_BUFFER_BYTES:
                    raise ProtocolError(
                        f"frame {i} of {len(view)} bytes > MAX_BUFFER_BYTES={MAX_BUFFER_BYTES}")
                views.append(view)
            used: set[int] = set()
            _state.frames, _state.used = views, used
            try:
                msg = tables.framed(header)
            finally:
                _state.frames = _state.used = None
            if len(used) != n - 1:
                unused = sorted(set(range(1, n)) - used)
                raise ProtocolError(f"frames {unused} are not referenced")
        cross = CROSS_FIELD_CHECKS.get(type(msg))
        if cross is not None:
            error = cross(msg)
            if error:
                raise ProtocolError(error)
        return msg
    except Exception as e:  # noqa: BLE001 - a peer must never crash the role: all -> ProtocolError
        raise _protocol_error(e, header) from None


def _protocol_error(e: Exception, header: bytes | memoryview | None) -> ProtocolError:
    """``e`` as a ProtocolError naming the message class, the field and the request when the
    header says them (read again, leniently: this is the error path only)."""
    body = None
    if header is not None:
        try:
            body = _any_decode(header)
        except Exception:  # noqa: BLE001 - not msgpack, or nested past the recursion limit
            pass
    if type(body) is not dict:
        body = {}
    request_id = body.get("request_id")
    request_id = request_id if type(request_id) is str else None
    if isinstance(e, (ProtocolError, _ValidationError, msgspec.DecodeError)):
        text = str(e)
    else:
        text = f"undecodable message: {type(e).__name__}: {e}"
    tag = body.get("tag")
    cls = REGISTRY.get(tag) if type(tag) is int else None
    if cls is not None:  # "Expected `int` - at `$.a.b`" -> "Class.a.b: Expected `int`"
        head, at, path = text.rpartition(" - at `$")
        text = f"{cls.__name__}{path[:-1]}: {head}" if at else f"{cls.__name__}: {text}"
    elif text.endswith(" - at `$.tag`"):
        text = (f"unknown message tag {tag}" if type(tag) is int
                else f"message tag must be an int, got {type(tag).__name__}")
    if isinstance(e, ProtocolError):
        e.args = (text,)
        if e.request_id is None:
            e.request_id = request_id
        return e
    return ProtocolError(text, request_id=request_id)


__all__ = [
    "encode", "decode", "encoded_size", "MAX_HEADER_BYTES", "MAX_BUFFER_BYTES", "MAX_FRAMES",
    "MAX_NDIM", "EXT_BUFFER",
]
