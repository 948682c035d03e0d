"""Decoding schemas of the wire messages: per registered class, one check per field compiled
from its type hints (DESIGN.md §3). A check takes the value read off the wire and returns the
Python value, or raises :class:`ProtocolError`: decoding never trusts a peer.

Supported field types: int, float, str, bytes, bool, None, :class:`Buffer`, a registered message
(nested), ``X | None``, unions, ``list[X]``, ``tuple[X, ...]`` and ``Annotated[int, Range(lo,
hi)]`` (a bounded int: a value out of range is a ProtocolError). Checks that span fields (a
segment's ``parents`` one per draft, ``start_pos >= base_committed_len``, ...) live in
:data:`CROSS_FIELD_CHECKS`, run on the decoded message. Limits are module attributes, read at
every call (tests may monkeypatch them).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

import msgpack

from specmesh.protocol.errors import ProtocolError
from specmesh.protocol._legacy.messages import REGISTRY, Buffer, DraftBranches, DraftTailStream, Range, buffer_nbytes

#: Deepest nesting of registered messages inside one message (the top level is depth 0).
MAX_DEPTH = 8
#: Most dimensions of a Buffer shape.
MAX_NDIM = 16

#: msgpack extension codes of the header.
EXT_MESSAGE = 1
EXT_BUFFER = 2

_ExtType = msgpack.ExtType
_unpackb = msgpack.unpackb
_NoneType = type(None)
_Check = Callable[[Any, "Ctx"], Any]


class Spec:
    """What the codec needs to know about one registered message class."""

    __slots__ = ("cls", "tag", "names", "name_set", "checks")

    def __init__(self, cls: type, tag: int, names: tuple[str, ...], checks: tuple) -> None:
        self.cls = cls
        self.tag = tag
        self.names = names
        self.name_set = frozenset(names)
        self.checks = checks  # ((field_name, check), ...) in field order


_SPECS: dict[type, Spec] = {}


def spec_of(cls: type) -> Spec:
    """The cached spec of registered message class ``cls``.

    Raises:
        TypeError: ``cls`` is not a registered message dataclass, or a field has a type the
            codec does not support.
    """
    spec = _SPECS.get(cls)
    if spec is None:
        spec = _buildspec_of(cls)
    return spec


def _buildspec_of(cls: type) -> Spec:
    tag = getattr(cls, "TAG", None)
    if (not isinstance(cls, type) or not dataclasses.is_dataclass(cls)
            or type(tag) is not int or REGISTRY.get(tag) is not cls):
        raise TypeError(f"{getattr(cls, '__name__', cls)!r} is not a registered message class")
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = dataclasses.fields(cls)
    names = tuple(f.name for f in fields)
    checks = tuple((n, _compile(hints[n], f"{cls.__name__}.{n}")) for n in names)
    spec = Spec(cls, tag, names, checks)
    _SPECS[cls] = spec
    return spec


def _is_message_class(tp: Any) -> bool:
    return isinstance(tp, type) and REGISTRY.get(getattr(tp, "TAG", None)) is tp


class Ctx:
    """Decoding state of one message: its frames, the buffer frames used so far, the depth."""

    __slots__ = ("frames", "used", "depth")

    def __init__(self, frames: list) -> None:
        self.frames = frames
        self.used: set[int] = set()
        self.depth = 0


def _got(v: Any) -> str:
    return type(v).__name__


def _c_int(v: Any, ctx: Ctx) -> int:
    if type(v) is int:
        return v
    raise ProtocolError(f"expected int, got {_got(v)}")


def _c_float(v: Any, ctx: Ctx) -> float:
    t = type(v)
    if t is float:
        return v
    if t is int:
        return float(v)
    raise ProtocolError(f"expected float, got {_got(v)}")


def _c_str(v: Any, ctx: Ctx) -> str:
    if type(v) is str:
        return v
    raise ProtocolError(f"expected str, got {_got(v)}")


def _c_bytes(v: Any, ctx: Ctx) -> bytes:
    if type(v) is bytes:
        return v
    raise ProtocolError(f"expected bytes, got {_got(v)}")


def _c_bool(v: Any, ctx: Ctx) -> bool:
    if type(v) is bool:
        return v
    raise ProtocolError(f"expected bool, got {_got(v)}")


def _c_none(v: Any, ctx: Ctx) -> None:
    if v is None:
        return None
    raise ProtocolError(f"expected None, got {_got(v)}")


def _c_list_int(v: Any, ctx: Ctx) -> list[int]:
    if type(v) is not list:
        raise ProtocolError(f"expected list[int], got {_got(v)}")
    for x in v:
        if type(x) is not int:
            raise ProtocolError(f"expected list[int], got an element of type {_got(x)}")
    return v


def _c_buffer(v: Any, ctx: Ctx) -> Buffer:
    if type(v) is not _ExtType or v.code != EXT_BUFFER:
        raise ProtocolError(f"expected a Buffer reference, got {_got(v)}")
    ref = unpack(v.data)
    if type(ref) is not list or len(ref) != 3:
        raise ProtocolError("malformed Buffer reference")
    idx, dtype, shape = ref
    if type(idx) is not int or not 1 <= idx < len(ctx.frames):
        raise ProtocolError(f"Buffer references frame {idx!r} of {len(ctx.frames)}")
    if idx in ctx.used:
        raise ProtocolError(f"frame {idx} referenced twice")
    if type(shape) is not list or len(shape) > MAX_NDIM:
        raise ProtocolError(f"bad Buffer shape {shape!r}")
    try:
        nbytes = buffer_nbytes(dtype, shape)
    except ValueError as e:
        raise ProtocolError(str(e)) from None
    data = ctx.frames[idx]
    if nbytes != len(data):  # frames are bytes or 1-D 'B' memoryviews: len() is the byte size
        raise ProtocolError(
            f"Buffer {dtype}{shape} needs {nbytes} bytes, frame {idx} has {len(data)}")
    ctx.used.add(idx)
    return Buffer(dtype, tuple(shape), data)


def _c_message(cls: type) -> _Check:
    def check(v: Any, ctx: Ctx) -> Any:
        if type(v) is not _ExtType or v.code != EXT_MESSAGE:
            raise ProtocolError(f"expected a nested {cls.__name__}, got {_got(v)}")
        if ctx.depth >= MAX_DEPTH:
            raise ProtocolError("messages nested too deep")
        tag, body = split(unpack(v.data))
        if tag != cls.TAG:
            got = REGISTRY.get(tag)
            raise ProtocolError(
                f"expected a nested {cls.__name__}, got tag {tag} "
                f"({got.__name__ if got else 'unknown'})")
        ctx.depth += 1
        try:
            return decode_body(spec_of(cls), body, ctx)
        finally:
            ctx.depth -= 1

    return check


def _c_range(inner: _Check, bounds: tuple[Range, ...]) -> _Check:
    def check(v: Any, ctx: Ctx) -> Any:
        v = inner(v, ctx)
        for r in bounds:
            if (r.lo is not None and v < r.lo) or (r.hi is not None and v > r.hi):
                lo = "-inf" if r.lo is None else r.lo
                hi = "inf" if r.hi is None else r.hi
                raise ProtocolError(f"{v} is out of range [{lo}, {hi}]")
        return v

    return check


def _c_list_range(bounds: tuple[Range, ...], what: str) -> _Check:
    item = _c_range(_c_int, bounds)

    def check(v: Any, ctx: Ctx) -> list[int]:
        v = _c_list_int(v, ctx)
        for x in v:
            item(x, ctx)
        return v

    return check


def _c_optional(inner: _Check) -> _Check:
    def check(v: Any, ctx: Ctx) -> Any:
        return None if v is None else inner(v, ctx)

    return check


def _c_union(options: tuple[_Check, ...], what: str) -> _Check:
    def check(v: Any, ctx: Ctx) -> Any:
        for option in options:
            try:
                return option(v, ctx)
            except ProtocolError:
                pass
        raise ProtocolError(f"expected {what}, got {_got(v)}")

    return check


def _c_list(inner: _Check, what: str) -> _Check:
    def check(v: Any, ctx: Ctx) -> list:
        if type(v) is not list:
            raise ProtocolError(f"expected {what}, got {_got(v)}")
        return [inner(x, ctx) for x in v]

    return check


def _c_tuple(inner: _Check, what: str) -> _Check:
    def check(v: Any, ctx: Ctx) -> tuple:
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
    if origin is typing.Annotated:
        bounds = tuple(m for m in tp.__metadata__ if isinstance(m, Range))
        inner = _compile(args[0], where)
        return _c_range(inner, bounds) if bounds else inner
    if origin is typing.Union or origin is types.UnionType:
        rest = tuple(a for a in args if a is not _NoneType)
        inner = (_compile(rest[0], where) if len(rest) == 1
                 else _c_union(tuple(_compile(a, where) for a in rest), str(tp)))
        return _c_optional(inner) if len(rest) < len(args) else inner
    if origin is list and len(args) == 1:
        if args[0] is int:
            return _c_list_int
        item = args[0]
        if typing.get_origin(item) is typing.Annotated and typing.get_args(item)[0] is int:
            bounds = tuple(m for m in item.__metadata__ if isinstance(m, Range))
            return _c_list_range(bounds, str(tp))  # the fast path of list[int], bounded
        return _c_list(_compile(item, where), str(tp))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _c_tuple(_compile(args[0], where), str(tp))
    raise TypeError(f"{where}: field type {tp!r} is not supported by the wire codec")


def unpack(data: bytes | memoryview) -> Any:
    n = len(data)
    try:
        # Limits tied to the input size: a length prefix can never make msgpack allocate more
        # items than there are bytes.
        return _unpackb(data, raw=False, strict_map_key=True, use_list=True, timestamp=0,
                        max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=n,
                        max_ext_len=n)
    except Exception as e:  # noqa: BLE001 - msgpack raises ValueError subclasses, TypeError...
        raise ProtocolError(f"not valid msgpack: {type(e).__name__}: {e}") from None


def split(obj: Any) -> tuple[int, Any]:
    if type(obj) is not list or len(obj) != 2:
        raise ProtocolError(f"message must be [tag, fields], got {_got(obj)}")
    tag, body = obj
    if type(tag) is not int:
        raise ProtocolError(f"message tag must be int, got {_got(tag)}")
    return tag, body


def decode_body(spec: Spec, body: Any, ctx: Ctx) -> Any:
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
        msg = cls(**kwargs)
    except Exception as e:  # noqa: BLE001 - __post_init__ validation of the dataclass
        raise ProtocolError(f"{cls.__name__} rejected its fields: {e}") from None
    cross = CROSS_FIELD_CHECKS.get(cls)
    if cross is not None:
        error = cross(msg)
        if error:
            raise ProtocolError(f"{cls.__name__}: {error}")
    return msg


# --------------------------------------------------------------------------------------------
# Checks that span fields (run on the decoded message; "" when it is fine)
# --------------------------------------------------------------------------------------------


def _check_draft_tail(m: DraftTailStream) -> str:
    n = len(m.draft_token_ids)
    if m.start_pos < m.base_committed_len:
        return (f"start_pos {m.start_pos} < base_committed_len {m.base_committed_len} (a "
                "segment starts at or after the drafter's committed prefix)")
    if m.parents is not None:
        if len(m.parents) != n:
            return f"{len(m.parents)} parents for {n} draft tokens"
        for i, p in enumerate(m.parents):
            if not -1 <= p < i:
                return f"parents[{i}] = {p} is not -1 or an earlier token of the segment"
    if m.draft_probs is not None:
        shape = tuple(m.draft_probs.shape)
        if len(shape) != 2 or shape[0] != n:
            return f"draft_probs of shape {list(shape)} for {n} draft tokens (want [{n}, vocab])"
    return ""


def _check_draft_branches(m: DraftBranches) -> str:
    if m.position < m.base_committed_len:
        return (f"position {m.position} < base_committed_len {m.base_committed_len} (a branch "
                "hangs at or after the drafter's committed prefix)")
    if len(m.continuations) != len(m.token_ids):
        return f"{len(m.continuations)} continuations for {len(m.token_ids)} candidates"
    if any(not c for c in m.continuations):
        return "an empty continuation"
    if len(set(m.token_ids)) != len(m.token_ids):
        return "repeated candidate tokens"
    return ""


#: message class -> check of the decoded message returning an error ("" when valid)
CROSS_FIELD_CHECKS: dict[type, Callable[[Any], str]] = {
    DraftTailStream: _check_draft_tail,
    DraftBranches: _check_draft_branches,
}
