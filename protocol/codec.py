"""msgpack codec for specmesh wire messages (DESIGN.md §3). Never pickle.

Wire format of one message, a list of frames:

- frame 0, the header: msgpack of ``[tag, {field_name: value, ...}]``. Every field of the
  dataclass is present. Tuples travel as lists. A nested registered message is an
  ``ExtType(EXT_MESSAGE, packb([tag, {fields}]))``; a :class:`~protocol.messages.Buffer` is an
  ``ExtType(EXT_BUFFER, packb([frame_index, dtype_name, shape]))``.
- frames 1..n: the raw bytes of each Buffer, in the order they were met, passed through as-is
  (no copy of a ``memoryview``).

:func:`decode` trusts nothing: it validates the header against the dataclass annotations, the
frame references, dtype names and byte sizes, and raises :class:`ProtocolError` (only that) on
anything wrong. Limits are module attributes, read at every call (tests may monkeypatch them).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from protocol.errors import ProtocolError
from protocol.messages import DTYPE_ITEMSIZE, REGISTRY, Buffer

#: Largest header frame accepted by :func:`decode`, bytes.
MAX_HEADER_BYTES = 16 << 20
#: Largest buffer frame accepted by :func:`decode`, bytes.
MAX_BUFFER_BYTES = 1 << 30
#: Most frames (header included) accepted by :func:`decode`.
MAX_FRAMES = 64
#: Deepest nesting of registered messages inside one message (the top level is depth 0).
MAX_DEPTH = 8
#: Most dimensions of a Buffer shape.
MAX_NDIM = 16

#: msgpack extension codes of the header.
EXT_MESSAGE = 1
EXT_BUFFER = 2

_ExtType = msgpack.ExtType
_packb = msgpack.packb
_unpackb = msgpack.unpackb
_NoneType = type(None)
# Initial msgpack Packer buffer (grows as needed). msgpack's 256 KiB default costs a large
# malloc per packb, ~10 us when packb nests (nested messages, buffer references).
_SMALL_BUF = 1024

Frame = Any  # bytes | memoryview | an object with a ``.buffer`` memoryview (zmq.Frame)
_Check = Callable[[Any, "_Ctx"], Any]


# --------------------------------------------------------------------------------------------
# Per-class specs (cached)
# --------------------------------------------------------------------------------------------


class _Spec:
    """What the codec needs to know about one registered message class."""

    __slots__ = ("cls", "tag", "names", "name_set", "checks")

    def __init__(self, cls: type, tag: int, names: tuple[str, ...], checks: tuple) -> None:
        self.cls = cls
        self.tag = tag
        self.names = names
        self.name_set = frozenset(names)
        self.checks = checks  # ((field_name, check), ...) in field order


_SPECS: dict[type, _Spec] = {}


def _spec(cls: type) -> _Spec:
    """The cached spec of registered message class ``cls``.

    Raises:
        TypeError: ``cls`` is not a registered message dataclass, or a field has a type the
            codec does not support.
    """
    spec = _SPECS.get(cls)
    if spec is None:
        spec = _build_spec(cls)
    return spec


def _build_spec(cls: type) -> _Spec:
    tag = getattr(cls, "TAG", None)
    if (not isinstance(cls, type) or not dataclasses.is_dataclass(cls)
            or type(tag) is not int or REGISTRY.get(tag) is not cls):
        raise TypeError(f"{getattr(cls, '__name__', cls)!r} is not a registered message class")
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    names = tuple(f.name for f in fields)
    checks = tuple((n, _compile(hints[n], f"{cls.__name__}.{n}")) for n in names)
    spec = _Spec(cls, tag, names, checks)
    _SPECS[cls] = spec
    return spec


def _is_message_class(tp: Any) -> bool:
    return isinstance(tp, type) and REGISTRY.get(getattr(tp, "TAG", None)) is tp


# --------------------------------------------------------------------------------------------
# Field checks: check(value_from_wire, ctx) -> python value, or raise ProtocolError
# --------------------------------------------------------------------------------------------


class _Ctx:
    """Decoding state of one message: its frames, the buffer frames used so far, the depth."""

    __slots__ = ("frames", "used", "depth")

    def __init__(self, frames: list) -> None:
        self.frames = frames
        self.used: set[int] = set()
        self.depth = 0


def _got(v: Any) -> str:
    return type(v).__name__


def _c_int(v: Any, ctx: _Ctx) -> int:
    if type(v) is int:
        return v
    raise ProtocolError(f"expected int, got {_got(v)}")


def _c_float(v: Any, ctx: _Ctx) -> float:
    t = type(v)
    if t is float:
        return v
    if t is int:
        return float(v)
    raise ProtocolError(f"expected float, got {_got(v)}")


def _c_str(v: Any, ctx: _Ctx) -> str:
    if type(v) is str:
        return v
    raise ProtocolError(f"expected str, got {_got(v)}")


def _c_bytes(v: Any, ctx: _Ctx) -> bytes:
    if type(v) is bytes:
        return v
    raise ProtocolError(f"expected bytes, got {_got(v)}")


def _c_bool(v: Any, ctx: _Ctx) -> bool:
    if type(v) is bool:
        return v
    raise ProtocolError(f"expected bool, got {_got(v)}")


def _c_none(v: Any, ctx: _Ctx) -> None:
    if v is None:
        return None
    raise ProtocolError(f"expected None, got {_got(v)}")


def _c_list_int(v: Any, ctx: _Ctx) -> list[int]:
    if type(v) is not list:
        raise ProtocolError(f"expected list[int], got {_got(v)}")
    for x in v:
        if type(x) is not int:
            raise ProtocolError(f"expected list[int], got an element of type {_got(x)}")
    return v


def _c_buffer(v: Any, ctx: _Ctx) -> Buffer:
    if type(v) is not _ExtType or v.code != EXT_BUFFER:
        raise ProtocolError(f"expected a Buffer reference, got {_got(v)}")
    ref = _unpack(v.data)
    if type(ref) is not list or len(ref) != 3:
        raise ProtocolError("malformed Buffer reference")
    idx, dtype, shape = ref
    if type(idx) is not int or not 1 <= idx < len(ctx.frames):
        raise ProtocolError(f"Buffer references frame {idx!r} of {len(ctx.frames)}")
    if idx in ctx.used:
        raise ProtocolError(f"frame {idx} referenced twice")
    itemsize = DTYPE_ITEMSIZE.get(dtype) if type(dtype) is str else None
    if itemsize is None:
        raise ProtocolError(f"unknown dtype {dtype!r}")
    if type(shape) is not list or len(shape) > MAX_NDIM:
        raise ProtocolError(f"bad Buffer shape {shape!r}")
    nbytes = itemsize
    for s in shape:
        if type(s) is not int or s < 0:
            raise ProtocolError(f"bad Buffer shape {shape!r}")
        nbytes *= s
    data = ctx.frames[idx]
    if nbytes != len(data):  # frames are bytes or 1-D 'B' memoryviews: len() is the byte size
        raise ProtocolError(
            f"Buffer {dtype}{shape} needs {nbytes} bytes, frame {idx} has {len(data)}")
    ctx.used.add(idx)
    return Buffer(dtype, tuple(shape), data)


def _c_message(cls: type) -> _Check:
    def check(v: Any, ctx: _Ctx) -> Any:
        if type(v) is not _ExtType or v.code != EXT_MESSAGE:
            raise ProtocolError(f"expected a nested {cls.__name__}, got {_got(v)}")
        if ctx.depth >= MAX_DEPTH:
            raise ProtocolError("messages nested too deep")
        tag, body = _split(_unpack(v.data))
        if tag != cls.TAG:
            got = REGISTRY.get(tag)
            raise ProtocolError(
                f"expected a nested {cls.__name__}, got tag {tag} "
                f"({got.__name__ if got else 'unknown'})")
        ctx.depth += 1
        try:
            return _decode_body(_spec(cls), body, ctx)
        finally:
            ctx.depth -= 1

    return check


def _c_optional(inner: _Check) -> _Check:
    def check(v: Any, ctx: _Ctx) -> Any:
        return None if v is None else inner(v, ctx)

    return check


def _c_union(options: tuple[_Check, ...], what: str) -> _Check:
    def check(v: Any, ctx: _Ctx) -> Any:
        for option in options:
            try:
                return option(v, ctx)
            except ProtocolError:
                pass
        raise ProtocolError(f"expected {what}, got {_got(v)}")

    return check


def _c_list(inner: _Check, what: str) -> _Check:
    def check(v: Any, ctx: _Ctx) -> list:
        if type(v) is not list:
            raise ProtocolError(f"expected {what}, got {_got(v)}")
        return [inner(x, ctx) for x in v]

    return check


def _c_tuple(inner: _Check, what: str) -> _Check:
    def check(v: Any, ctx: _Ctx) -> tuple:
        if type(v) is not list:
            raise ProtocolError(f"expected {what}, got {_got(v)}")
        return tuple(inner(x, ctx) for x in v)

    return check


_SCALARS: dict[Any, _Check] = {
    int: _c_int, float: _c_float, str: _c_str, bytes: _c_bytes, bool: _c_bool,
    _NoneType: _c_none, None: _c_none, Buffer: _c_buffer,
}


def _compile(tp: Any, where: str) -> _Check:
    """Build the check for annotation ``tp`` (already resolved by get_type_hints).

    Raises:
        TypeError: ``tp`` is not a type the wire format supports.
    """
    check = _SCALARS.get(tp)
    if check is not None:
        return check
    if _is_message_class(tp):
        return _c_message(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        rest = tuple(a for a in args if a is not _NoneType)
        inner = (_compile(rest[0], where) if len(rest) == 1
                 else _c_union(tuple(_compile(a, where) for a in rest), str(tp)))
        return _c_optional(inner) if len(rest) < len(args) else inner
    if origin is list and len(args) == 1:
        return _c_list_int if args[0] is int else _c_list(_compile(args[0], where), str(tp))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _c_tuple(_compile(args[0], where), str(tp))
    raise TypeError(f"{where}: field type {tp!r} is not supported by the wire codec")


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


def _unpack(data: bytes | memoryview) -> Any:
    n = len(data)
    try:
        # Limits tied to the input size: a length prefix can never make msgpack allocate more
        # items than there are bytes.
        return _unpackb(data, raw=False, strict_map_key=True, use_list=True, timestamp=0,
                        max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=n,
                        max_ext_len=n)
    except Exception as e:  # noqa: BLE001 - msgpack raises ValueError subclasses, TypeError...
        raise ProtocolError(f"not valid msgpack: {type(e).__name__}: {e}") from None


def _split(obj: Any) -> tuple[int, Any]:
    if type(obj) is not list or len(obj) != 2:
        raise ProtocolError(f"message must be [tag, fields], got {_got(obj)}")
    tag, body = obj
    if type(tag) is not int:
        raise ProtocolError(f"message tag must be int, got {_got(tag)}")
    return tag, body


def _decode_body(spec: _Spec, body: Any, ctx: _Ctx) -> Any:
    cls = spec.cls
    if type(body) is not dict:
        raise ProtocolError(f"{cls.__name__} fields must be a map, got {_got(body)}")
    if body.keys() != spec.name_set:
        missing = sorted(spec.name_set - body.keys())
        unknown = sorted(repr(k) for k in body.keys() - spec.name_set)
        raise ProtocolError(f"{cls.__name__}: missing fields {missing}, unknown fields {unknown}")
    kwargs = {}
    for name, check in spec.checks:
        try:
            kwargs[name] = check(body[name], ctx)
        except ProtocolError as e:
            raise ProtocolError(f"{cls.__name__}.{name}: {e}") from None
    try:
        return cls(**kwargs)
    except Exception as e:  # noqa: BLE001 - __post_init__ validation of the dataclass
        raise ProtocolError(f"{cls.__name__} rejected its fields: {e}") from None


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
    obj = _unpack(header)
    request_id = None
    if type(obj) is list and len(obj) == 2 and type(obj[1]) is dict:
        request_id = obj[1].get("request_id")
        if type(request_id) is not str:
            request_id = None
    try:
        tag, body = _split(obj)
        cls = REGISTRY.get(tag)
        if cls is None:
            raise ProtocolError(f"unknown message tag {tag}")
        ctx = _Ctx(views)
        msg = _decode_body(_spec(cls), body, ctx)
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


def _fields_of(msg: Any, spec: _Spec) -> dict[str, Any]:
    return {name: getattr(msg, name) for name in spec.names}


def _buffer_ref(buf: Buffer, frames: list) -> _ExtType:
    itemsize = DTYPE_ITEMSIZE.get(buf.dtype) if type(buf.dtype) is str else None
    if itemsize is None:
        raise ValueError(f"Buffer has unknown dtype {buf.dtype!r}")
    shape = list(buf.shape)
    nbytes = itemsize
    for s in shape:
        if type(s) is not int or s < 0:
            raise ValueError(f"bad Buffer shape {buf.shape!r}")
        nbytes *= s
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
    spec = _spec(type(msg))
    frames: list = [b""]

    def default(obj: Any) -> _ExtType:
        if type(obj) is Buffer:
            return _buffer_ref(obj, frames)
        inner = _spec(type(obj))
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
