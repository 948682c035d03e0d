"""Tests of protocol/codec.py: round trips of every registered message, the ``Meta`` bounds of
the message fields, and rejection of every kind of malformed input with ProtocolError (and
nothing else)."""

from __future__ import annotations

import types
import typing
from typing import ClassVar

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec.msgpack import Ext

from specmesh.protocol import codec
from specmesh.protocol.codec import EXT_BUFFER, decode, encode, encoded_size
from specmesh.protocol.errors import ProtocolError
from specmesh.protocol.messages import (
    DTYPE_ITEMSIZE,
    REGISTRY,
    Abort,
    Buffer,
    DraftBranches,
    DraftClose,
    DraftSync,
    DraftTailStream,
    GenerateRequest,
    Hello,
    KVFrame,
    Message,
    ModelIdentity,
    SamplingParams,
    TokenStream,
    VerifyCommit,
    register,
)

ALL_CLASSES = sorted(REGISTRY.values(), key=lambda c: c.TAG)


def _ids(cls: type) -> str:
    return cls.__name__


def _header(frames: list) -> dict:
    """The header of encoded ``frames`` as python objects ({"tag": tag, field: value})."""
    return msgspec.msgpack.decode(frames[0])


def _frames_with(header: object, frames: list) -> list:
    """``frames`` with the header replaced by msgpack of ``header``."""
    return [msgspec.msgpack.encode(header)] + list(frames[1:])


def _rejects(frames: object) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(frames)  # type: ignore[arg-type]
    return info.value


# --------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=_ids)
def test_every_registered_message_has_an_example_and_round_trips(cls: type) -> None:
    assert issubclass(cls, Message) and cls.__struct_config__.tag == cls.TAG
    assert cls.__struct_config__.frozen and cls.__struct_config__.forbid_unknown_fields
    assert hasattr(cls, "example"), f"{cls.__name__} needs an example() classmethod"
    msg = cls.example()
    assert type(msg) is cls
    frames = encode(msg)
    assert isinstance(frames[0], bytes)
    back = decode(frames)
    assert type(back) is cls
    assert back == msg
    # zmq hands frames back as zmq.Frame objects (with .buffer) or bytes copies
    assert decode([zmq.Frame(bytes(f)) for f in frames]) == msg
    assert decode([memoryview(bytes(f)) for f in frames]) == msg


def test_tuples_travel_as_lists_and_int_is_accepted_for_float() -> None:
    params = SamplingParams(stop_token_ids=(2, 3), temperature=1)  # type: ignore[arg-type]
    back = decode(encode(params))
    assert back.stop_token_ids == [2, 3]
    assert type(back.temperature) is float and back.temperature == 1.0


def test_buffer_data_is_not_copied() -> None:
    raw = bytearray(range(24))
    msg = VerifyCommit(request_id="r", pre_commit_len=0, committed_token_ids=[1, 2, 3],
                       seed_state=Buffer("float32", (3, 2), memoryview(raw)))
    frames = encode(msg)
    assert len(frames) == 2 and frames[1] is msg.seed_state.data
    back = decode(frames)
    raw[0] = 99  # the decoded buffer is a view of the same memory
    assert bytes(back.seed_state.data)[0] == 99
    assert back.seed_state.shape == (3, 2) and back.seed_state.dtype == "float32"


def test_buffer_accepts_multibyte_memoryviews() -> None:
    import array

    arr = array.array("f", [1.0, 2.0, 3.0, 4.0])
    msg = VerifyCommit(request_id="r", pre_commit_len=0, committed_token_ids=[1, 2],
                       seed_state=Buffer("float32", (2, 2), memoryview(arr)))
    frames = encode(msg)
    assert decode(frames) == msg
    assert decode([frames[0], memoryview(arr)]).seed_state.data.nbytes == 16


def test_encoded_size() -> None:
    msg = KVFrame.example()
    frames = encode(msg)
    assert encoded_size(frames) == len(frames[0]) + msg.kv.nbytes
    assert encoded_size([zmq.Frame(b"abc"), memoryview(b"de")]) == 5


_token = st.integers(min_value=0, max_value=2**31 - 1)
_small_int = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_count = st.integers(min_value=0, max_value=2**63 - 1)
_text = st.text(max_size=20)


@st.composite
def _buffers(draw: st.DrawFn) -> Buffer:
    dtype = draw(st.sampled_from(sorted(DTYPE_ITEMSIZE)))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    n = DTYPE_ITEMSIZE[dtype]
    for s in shape:
        n *= s
    data = draw(st.binary(min_size=n, max_size=n))
    return Buffer(dtype, shape, draw(st.sampled_from([data, memoryview(data)])))


@st.composite
def _tails(draw: st.DrawFn) -> DraftTailStream:
    """Valid segments: positions >= 0, start_pos >= base, parents one per draft (earlier
    tokens or -1), draft_probs [n, vocab]; from the prediction only as a chain without
    draft_probs."""
    drafts = draw(st.lists(_token, max_size=16))
    n = len(drafts)
    base = draw(st.integers(0, 2**62))
    parents = draw(st.none() | st.just([draw(st.integers(-1, i - 1)) for i in range(n)]))
    probs = draw(st.none() | st.integers(0, 3).map(
        lambda v: Buffer("float32", (n, v), bytes(4 * n * v))))
    predicted = parents is None and probs is None and draw(st.booleans())
    return DraftTailStream(request_id=draw(_text), base_committed_len=base,
                           start_pos=base + draw(st.integers(0, 2**62)),
                           draft_token_ids=drafts, draft_probs=probs, parents=parents,
                           from_prediction=predicted)


_messages = st.one_of(
    _tails(),
    st.builds(VerifyCommit, request_id=_text, pre_commit_len=_small_int,
              committed_token_ids=st.lists(_token, max_size=16),
              seed_state=st.none() | _buffers()),
    st.builds(TokenStream, request_id=_text, token_ids=st.lists(_token), finished=st.booleans(),
              finish_reason=st.none() | st.sampled_from(["stop", "length", "abort", "error"]),
              num_prompt_tokens=_count, num_draft_tokens=_count,
              num_accepted_tokens=_count, num_verify_steps=_count, error=_text,
              num_accepted_prediction_tokens=_count, num_rejected_prediction_tokens=_count),
    st.builds(Abort, request_id=_text, reason=_text, num_output_tokens=st.none() | _count),
)


@settings(max_examples=200, deadline=None)
@given(_messages)
def test_property_round_trip(msg: object) -> None:
    assert decode(encode(msg)) == msg


# --------------------------------------------------------------------------------------------
# Encoding errors
# --------------------------------------------------------------------------------------------


class _Unregistered(Message, tag=9_997):
    x: int = 0


class _Opaque:
    """Neither a message, a Buffer nor a msgpack-native value."""


def test_encode_rejects_unregistered_objects() -> None:
    for obj in (object(), _Unregistered(), _Opaque(), Buffer("uint8", (1,), b"x"), {"a": 1}, 3):
        with pytest.raises(TypeError):
            encode(obj)
    with pytest.raises(TypeError):  # nested value that msgpack cannot carry
        encode(DraftTailStream(request_id="r", base_committed_len=0, start_pos=0,
                               draft_token_ids=[_Opaque()]))  # type: ignore[list-item]
    with pytest.raises(TypeError):  # a Buffer in a message that has no field typed Buffer
        encode(TokenStream(request_id="r", token_ids=[Buffer("uint8", (1,), b"x")]))  # type: ignore


def test_messages_are_frozen_keyword_only_and_picklable() -> None:
    import pickle

    msg = VerifyCommit.example()
    with pytest.raises(AttributeError):
        msg.pre_commit_len = 2  # type: ignore[misc]
    with pytest.raises(AttributeError):
        msg.seed_state.dtype = "int8"  # type: ignore[misc]
    with pytest.raises(TypeError):
        VerifyCommit("r", 1, [5])  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(msg)) == msg  # Ray may pickle messages
    assert msgspec.structs.replace(msg, pre_commit_len=2).pre_commit_len == 2
    assert SamplingParams().stop_token_ids == [] and SamplingParams().stop_token_ids is not \
        SamplingParams().stop_token_ids  # a fresh list per instance


@pytest.mark.parametrize("buf", [
    Buffer("float32", (2,), b"abc"),
    Buffer("float31", (1,), b"abcd"),
    Buffer("uint8", (-1,), b""),
], ids=["size", "dtype", "negative-dim"])
def test_encode_rejects_bad_buffers(buf: Buffer) -> None:
    with pytest.raises(ValueError):
        encode(VerifyCommit(request_id="r", pre_commit_len=0, committed_token_ids=[],
                            seed_state=buf))


# --------------------------------------------------------------------------------------------
# Malformed input: ProtocolError, always
# --------------------------------------------------------------------------------------------


_CANDIDATES = [True, False, 0, -5, 1.5, "s", b"b", None, [1, 2], [True], ["x"], {"a": 1},
               [[1]], {"tag": ModelIdentity.TAG},
               Ext(EXT_BUFFER, msgspec.msgpack.encode([1, "uint8", [0]])), Ext(7, b"zz")]


def _valid_for(hint: object, value: object) -> bool:
    """Independent statement of which plain wire values a field annotation accepts
    (``Annotated[int, Meta(ge=0)]``: an int >= 0)."""
    if typing.get_origin(hint) is typing.Annotated:
        inner, *meta = typing.get_args(hint)
        bounds = [m.ge for m in meta if isinstance(m, msgspec.Meta) and m.ge is not None]
        return _valid_for(inner, value) and all(value >= lo for lo in bounds)
    if hint is int:
        return type(value) is int
    if hint is float:
        return type(value) in (int, float)
    if hint in (str, bytes, bool):
        return type(value) is hint
    if hint is type(None):
        return value is None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_valid_for(a, value) for a in args)
    if origin is list:
        return type(value) is list and all(_valid_for(args[0], v) for v in value)
    return False  # nested messages and Buffers: no plain candidate is valid (ExtTypes aside)


def _wrong_type_cases() -> list:
    cases = []
    for cls in ALL_CLASSES:
        for f in msgspec.structs.fields(cls):
            for i, cand in enumerate(_CANDIDATES):
                if not _valid_for(f.type, cand):
                    cases.append(pytest.param(cls, f.name, cand, id=f"{cls.__name__}.{f.name}-{i}"))
    return cases


@pytest.mark.parametrize("cls,field_name,value", _wrong_type_cases())
def test_wrong_field_type_is_rejected(cls: type, field_name: str, value: object) -> None:
    frames = encode(cls.example())
    body = _header(frames)
    body[field_name] = value
    err = _rejects(_frames_with(body, frames))
    assert f"{cls.__name__}.{field_name}" in str(err)
    if "request_id" in body and type(body["request_id"]) is str:
        assert err.request_id == body["request_id"]


def _bounded_fields() -> list:
    """(class, field, how the value is placed) of every field whose type carries a ``Meta(ge=0)``
    bound, directly, in a list, in a list of lists, or behind ``| None``."""
    def bounded(tp: object) -> bool:
        return typing.get_origin(tp) is typing.Annotated and any(
            isinstance(m, msgspec.Meta) and m.ge == 0 for m in typing.get_args(tp)[1:])

    cases = []
    for cls in ALL_CLASSES:
        for f in msgspec.structs.fields(cls):
            tp = f.type
            if typing.get_origin(tp) in (typing.Union, types.UnionType):
                tp = next(a for a in typing.get_args(tp) if a is not type(None))
            depth = 0
            while typing.get_origin(tp) is list:
                tp, depth = typing.get_args(tp)[0], depth + 1
            if bounded(tp):
                cases.append(pytest.param(cls, f.name, depth, id=f"{cls.__name__}.{f.name}"))
    return cases


BOUNDED = _bounded_fields()


def test_the_meta_bounds_are_the_ones_the_glossary_names() -> None:
    names = {p.id for p in BOUNDED}
    assert {"TokenStream.token_ids", "TokenStream.offset", "TokenStream.num_accepted_tokens",
            "Abort.num_output_tokens", "VerifyCommit.num_drafts_wanted",
            "DraftTailStream.start_pos", "DraftTailStream.base_committed_len",
            "DraftTailStream.draft_token_ids", "DraftBranches.continuations",
            "DraftBranches.token_ids"} <= names


@pytest.mark.parametrize("cls,field_name,depth", BOUNDED)
def test_meta_bounds_refuse_minus_one_and_accept_zero(cls: type, field_name: str,
                                                       depth: int) -> None:
    """Every ``NonNegInt`` / ``TokenId`` field (or element) refuses -1 and -2**63 on the wire
    with a ProtocolError naming the field, and takes 0. Cross-field checks are kept satisfied
    by moving the fields they relate together."""
    frames = encode(cls.example())
    body = _header(frames)

    def placed(v: int) -> object:
        if depth == 0:
            return v
        old = body[field_name]
        if depth == 1:
            return [v] + old[1:]
        return [[v] + old[0][1:]] + old[1:]

    for bad in (-1, -(2**63)):
        err = _rejects(_frames_with({**body, field_name: placed(bad)}, frames))
        assert f"{cls.__name__}.{field_name}" in str(err) and ">= 0" in str(err), str(err)
        assert err.request_id == body.get("request_id")  # (control messages name none)
    zero = {**body, field_name: placed(0)}
    if cls in (DraftTailStream, DraftBranches) and depth == 0:
        zero.update({k: 0 for k in ("base_committed_len", "start_pos", "position") if k in body})
    assert getattr(decode(_frames_with(zero, frames)), field_name) == zero[field_name]


@pytest.mark.parametrize("cls,fields,what", [
    (DraftTailStream, {"start_pos": -1}, "start_pos"),
    (DraftTailStream, {"base_committed_len": -1, "start_pos": 0}, "base_committed_len"),
    (DraftTailStream, {"base_committed_len": 5, "start_pos": 4}, "start_pos 4 < base"),
    (DraftTailStream, {"draft_token_ids": [8, -2, 10]}, "draft_token_ids"),
    (DraftTailStream, {"parents": [-1, 0]}, "2 parents for 3"),
    (DraftTailStream, {"parents": [-1, 0, 2]}, "parents[2]"),
    (DraftTailStream, {"parents": [-2, 0, 1]}, "parents[0]"),
    (DraftTailStream, {"from_prediction": True}, "a prediction segment with"),  # a tree
    (DraftTailStream, {"from_prediction": 1}, "from_prediction"),
    (GenerateRequest, {"prediction_token_ids": [5, -1]}, "prediction_token_ids"),
    (DraftSync, {"prediction_token_ids": [-7]}, "prediction_token_ids"),
    (TokenStream, {"num_rejected_prediction_tokens": -1}, "num_rejected_prediction_tokens"),
    (DraftBranches, {"position": 3}, "position 3 < base"),
    (DraftBranches, {"continuations": [[13]]}, "1 continuations for 2"),
    (DraftBranches, {"continuations": [[13], []]}, "an empty continuation"),
    (DraftBranches, {"token_ids": [11, 11]}, "repeated candidate"),
    (DraftBranches, {"continuations": [[13], [-1]]}, "continuations"),
    (TokenStream, {"token_ids": [1, -1]}, "token_ids"),
    (TokenStream, {"num_accepted_tokens": -3}, "num_accepted_tokens"),
    (Abort, {"num_output_tokens": -1}, "num_output_tokens"),
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_out_of_range_values_are_protocol_errors(cls: type, fields: dict, what: str) -> None:
    frames = encode(cls.example())
    body = _header(frames)
    err = _rejects(_frames_with({**body, **fields}, frames))
    assert what in str(err)
    assert err.request_id == body["request_id"]  # names the request: only it is quarantined


def test_draft_probs_must_have_one_row_per_draft() -> None:
    msg = DraftTailStream(request_id="r", base_committed_len=1, start_pos=1,
                          draft_token_ids=[3, 4], draft_probs=Buffer("float32", (3, 2),
                                                                     bytes(24)))
    err = _rejects(encode(msg))
    assert "draft_probs" in str(err) and err.request_id == "r"


def test_bool_is_not_int_and_int_is_not_bool() -> None:
    frames = encode(DraftTailStream.example())
    body = _header(frames)
    assert "start_pos" in str(_rejects(_frames_with({**body, "start_pos": True}, frames)))
    _rejects(_frames_with({**body, "draft_token_ids": [1, False]}, frames))
    frames = encode(TokenStream.example())
    body = _header(frames)
    err = _rejects(_frames_with({**body, "finished": 1}, frames))
    assert err.request_id == "req-1"
    _rejects(_frames_with({**body, "finished": 0}, frames))


def test_wrong_type_inside_a_nested_message() -> None:
    inner = _header(encode(SamplingParams.example()))
    frames = encode(GenerateRequest.example())
    body = _header(frames)
    assert body["sampling"] == inner  # nested messages travel inline, tag included
    for field_name, bad in [("temperature", True), ("max_tokens", 2.0), ("seed", "7"),
                            ("stop_token_ids", [1.0]), ("bogus", 1)]:
        body["sampling"] = {**inner, field_name: bad}
        err = _rejects(_frames_with(body, frames))
        assert err.request_id == "req-1" and "GenerateRequest.sampling" in str(err)
        assert field_name in str(err)
    # a nested message of the wrong class, or its tag alone
    body["sampling"] = _header(encode(ModelIdentity.example()))
    _rejects(_frames_with(body, frames))
    body["sampling"] = {"tag": ModelIdentity.TAG}
    _rejects(_frames_with(body, frames))
    # a nested payload that is not a map
    for bad in (Ext(7, b"\xc1"), [inner], b"\xc1"):
        body["sampling"] = bad
        _rejects(_frames_with(body, frames))
    # the nested tag may be left out: the field's type says the class
    body["sampling"] = {k: v for k, v in inner.items() if k != "tag"}
    assert decode(_frames_with(body, frames)) == GenerateRequest.example()


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=_ids)
def test_missing_fields(cls: type) -> None:
    """A field without a default must be there; one with a default may be left out (the
    sender's msgspec writes every field: only a hand-made header leaves one out)."""
    msg = cls.example()
    frames = encode(msg)
    body = _header(frames)
    for f in msgspec.structs.fields(cls):
        rest = {k: v for k, v in body.items() if k != f.name}
        if f.required:
            err = _rejects(_frames_with(rest, frames))
            assert f.name in str(err)
            if f.name != "request_id" and "request_id" in body:
                assert err.request_id == body["request_id"]
        else:
            if isinstance(getattr(msg, f.name), Buffer):  # its frame goes too (the only one)
                assert len(frames) == 2
                back = decode(_frames_with(rest, frames[:1]))
            else:
                back = decode(_frames_with(rest, frames))
            want = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
            assert getattr(back, f.name) == want


def test_extra_and_unknown() -> None:
    frames = encode(TokenStream.example())
    body = _header(frames)
    assert body["tag"] == TokenStream.TAG
    assert "bogus" in str(_rejects(_frames_with({**body, "bogus": 1}, frames)))
    _rejects(_frames_with({**body, b"raw-key": 1}, frames))
    _rejects(_frames_with({**body, 5: 1}, frames))
    err = _rejects(_frames_with({**body, "tag": 9999}, frames))
    assert "unknown message tag 9999" in str(err) and err.request_id == "req-1"
    _rejects(_frames_with({**body, "tag": "21"}, frames))
    _rejects(_frames_with({**body, "tag": True}, frames))
    _rejects(_frames_with({**body, "tag": None}, frames))
    err = _rejects(_frames_with({k: v for k, v in body.items() if k != "tag"}, frames))
    assert "tag" in str(err) and err.request_id == "req-1"
    _rejects(_frames_with([body["tag"], body], frames))
    _rejects(_frames_with([body], frames))
    _rejects(_frames_with(Ext(1, frames[0]), frames))


@pytest.mark.parametrize("header", [0, 7, -1, 2**63, "x", b"x", None, 1.5, {}, []])
def test_header_that_is_not_a_list(header: object) -> None:
    _rejects([msgspec.msgpack.encode(header)])


def test_not_msgpack_and_truncated() -> None:
    _rejects([b""])
    _rejects([b"\xc1"])  # never-used msgpack byte
    _rejects([b"\x92\x15\x81\xa1"])
    _rejects([b"\x83\xa3tag\x15"])
    _rejects([encode(DraftClose.example())[0] + b"\x00"])  # trailing bytes
    _rejects([b"\x82\xa3tag\x2b\xaarequest_id\xa2\xff\xfe"])  # a str that is not UTF-8
    for cls in ALL_CLASSES:
        frames = encode(cls.example())
        for cut in range(len(frames[0])):
            _rejects([frames[0][:cut], *frames[1:]])


def test_zero_frames_and_non_frames() -> None:
    _rejects([])
    _rejects(())
    _rejects(encode(DraftTailStream.example())[0])  # a bare buffer, not a list of frames
    _rejects(None)
    _rejects(42)
    _rejects(["not bytes"])
    _rejects([object()])
    _rejects(iter([b"x"]))


def _verify_commit_frames() -> tuple[list, dict]:
    frames = encode(VerifyCommit.example())
    assert len(frames) == 2
    return frames, _header(frames)


def _with_ref(ref: object) -> list:
    frames, body = _verify_commit_frames()
    body["seed_state"] = Ext(EXT_BUFFER, msgspec.msgpack.encode(ref))
    return _frames_with(body, frames)


def test_buffer_frame_errors() -> None:
    frames, body = _verify_commit_frames()
    err = _rejects(frames[:1])  # missing frame
    assert err.request_id == "req-1"
    _rejects(frames + [b"extra"])  # extra frame
    _rejects([frames[0], bytes(frames[1])[:-1]])  # wrong size
    _rejects([frames[0], bytes(frames[1]) + b"\x00"])
    _rejects(_with_ref([1, "float31", [3, 2]]))  # unknown dtype
    _rejects(_with_ref([1, 5, [3, 2]]))
    _rejects(_with_ref([1, "float32", [-3, -2]]))  # negative dims (product matches size)
    _rejects(_with_ref([1, "float32", [3, True]]))
    _rejects(_with_ref([1, "float32", [3.0, 2]]))
    _rejects(_with_ref([1, "float32", 6]))
    _rejects(_with_ref([0, "float32", [3, 2]]))  # the header is not a buffer
    _rejects(_with_ref([2, "float32", [3, 2]]))  # out of range
    _rejects(_with_ref([True, "float32", [3, 2]]))
    _rejects(_with_ref([1, "float32"]))
    _rejects(_with_ref({"idx": 1}))
    _rejects(_with_ref([1, "float32", [1] * 100 + [6]]))  # too many dims
    err = _rejects(_with_ref([1, "float32", [1] * (codec.MAX_NDIM + 1)]))  # Meta(max_length)
    assert "length <= 16" in str(err) and err.request_id == "req-1"
    _rejects(_with_ref([1, "float32", [3, 2], 0]))  # a fourth item
    assert decode(_with_ref([1, "uint8", [24]])).seed_state.shape == (24,)
    assert decode(_with_ref([1, "float32", [1] * 14 + [3, 2]])).seed_state.shape[-2:] == (3, 2)
    # a buffer where a list is expected, and a list where a buffer is expected
    body2 = {**body, "committed_token_ids": body["seed_state"], "seed_state": None}
    _rejects(_frames_with(body2, frames))
    _rejects(_frames_with({**body, "seed_state": [1, "float32", [3, 2]]}, frames))
    # another extension code where a buffer is expected, with and without buffer frames
    _rejects(_frames_with({**body, "seed_state": Ext(7, body["seed_state"].data)}, frames))
    _rejects(_frames_with({**body, "seed_state": Ext(7, b"")}, frames[:1]))


class _TwoBuffers(Message, tag=9_998):
    """A message with two buffers (registered only inside the test)."""

    request_id: str
    first: Buffer
    second: Buffer | None
    TAG: ClassVar[int] = 9_998


def test_buffer_frames_with_two_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(REGISTRY, _TwoBuffers.TAG, _TwoBuffers)
    msg = _TwoBuffers(request_id="q", first=Buffer("uint8", (1,), b"x"),
                      second=Buffer("int16", (2,), b"abcd"))
    frames = encode(msg)
    assert len(frames) == 3 and decode(frames) == msg
    body = _header(frames)
    first_ref = body["first"]
    err = _rejects(_frames_with({**body, "second": first_ref}, frames))  # used twice
    assert "twice" in str(err) and err.request_id == "q"
    _rejects(frames[:2])  # second frame missing
    _rejects([frames[0], frames[2], frames[1]])  # frames swapped: sizes do not match
    one = _TwoBuffers(request_id="q", first=Buffer("uint8", (1,), b"x"), second=None)
    _rejects(encode(one) + [b"y"])  # extra frame


def test_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = encode(KVFrame.example())
    msg = decode(kv)
    monkeypatch.setattr(codec, "MAX_HEADER_BYTES", len(kv[0]) - 1)
    assert "MAX_HEADER_BYTES" in str(_rejects(kv))
    monkeypatch.setattr(codec, "MAX_HEADER_BYTES", len(kv[0]))
    assert decode(kv) == msg
    monkeypatch.setattr(codec, "MAX_BUFFER_BYTES", len(kv[1]) - 1)
    _rejects(kv)
    monkeypatch.setattr(codec, "MAX_BUFFER_BYTES", len(kv[1]))
    assert decode(kv) == msg
    monkeypatch.setattr(codec, "MAX_FRAMES", 1)
    _rejects(kv)


def test_huge_length_prefixes_do_not_allocate() -> None:
    _rejects([b"\xdd\xff\xff\xff\xff"])  # array32 of 4G items
    _rejects([b"\xdf\xff\xff\xff\xff"])  # map32
    _rejects([b"\xc6\xff\xff\xff\xff"])  # bin32
    _rejects([b"\xdb\xff\xff\xff\xff"])  # str32
    _rejects([b"\xc9\xff\xff\xff\xff\x01"])  # ext32


def test_too_deep_nesting() -> None:
    _rejects([b"\x91" * 100_000 + b"\x01"])
    _rejects([b"\x81\xa1a" * 50_000 + b"\x01"])
    tag = b"\xa3tag" + msgspec.msgpack.encode(TokenStream.TAG)
    err = _rejects([b"\x82" + tag + b"\xa9token_ids" + b"\x91" * 100_000 + b"\x01"])
    assert "token_ids" in str(err)
    deep_map = b"\x81\xa1a" * 50_000 + b"\x01"
    _rejects([b"\x82" + tag + b"\xa3zzz" + deep_map])  # an unknown field
    _rejects([b"\x82\xa3zzz" + deep_map + tag])  # ... before the tag


def _nesting(tp: object, stack: tuple = ()) -> int:
    """Deepest nesting of messages inside a value of type ``tp`` (a message class: 0)."""
    if isinstance(tp, type) and issubclass(tp, Message):
        assert tp not in stack, f"{tp.__name__} contains itself: nesting would be unbounded"
        inner = [_nesting(f.type, stack + (tp,)) for f in msgspec.structs.fields(tp)]
        return max([i + 1 for i in inner if i >= 0], default=0)
    return max([_nesting(a, stack) for a in typing.get_args(tp)], default=-1)


def test_message_nesting_is_bounded_by_the_classes() -> None:
    """No message contains itself, so the types bound the nesting a header can carry."""
    depths = {cls.__name__: _nesting(cls) for cls in ALL_CLASSES}
    # GenerateRequest > SamplingParams > GrammarSpec (structured output)
    assert depths["Hello"] == 1 and depths["GenerateRequest"] == 2
    assert max(depths.values()) <= 2, depths


class _Checked(Message, tag=9_999):
    """A message whose __post_init__ validates (registered only inside the test)."""

    request_id: str
    count: int
    TAG: ClassVar[int] = 9_999

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError("count must be >= 0")


def test_post_init_errors_become_protocol_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(REGISTRY, _Checked.TAG, _Checked)
    ok = _Checked(request_id="q", count=1)
    assert decode(encode(ok)) == ok
    err = _rejects([msgspec.msgpack.encode({"tag": _Checked.TAG, "request_id": "q",
                                            "count": -1})])
    assert err.request_id == "q" and "count" in str(err)


def test_registry_changes_reach_the_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    header = msgspec.msgpack.encode({"tag": _Checked.TAG, "request_id": "q", "count": 1})
    assert "unknown message tag" in str(_rejects([header]))
    monkeypatch.setitem(REGISTRY, _Checked.TAG, _Checked)
    assert decode([header]) == _Checked(request_id="q", count=1)
    monkeypatch.delitem(REGISTRY, _Checked.TAG)
    assert "unknown message tag" in str(_rejects([header]))
    with pytest.raises(TypeError):
        REGISTRY.update({_Checked.TAG: _Checked})  # changes go one tag at a time


def test_the_error_is_a_protocol_error_with_request_id() -> None:
    frames = encode(DraftTailStream.example())
    body = _header(frames)
    err = _rejects(_frames_with({**body, "start_pos": "4"}, frames))
    assert err.request_id == "req-1" and "DraftTailStream.start_pos" in str(err)
    assert "Expected `int`, got `str`" in str(err)
    err = _rejects(_frames_with({**body, "request_id": 5}, frames))
    assert err.request_id is None


# --------------------------------------------------------------------------------------------
# Fuzz: decode never raises anything but ProtocolError
# --------------------------------------------------------------------------------------------


def _decode_or_protocol_error(frames: list) -> None:
    try:
        decode(frames)
    except ProtocolError:
        pass


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=256))
def test_fuzz_arbitrary_header_bytes(data: bytes) -> None:
    _decode_or_protocol_error([data])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=5))
def test_fuzz_arbitrary_frames(frames: list) -> None:
    _decode_or_protocol_error(frames)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(ALL_CLASSES), st.data())
def test_fuzz_mutated_valid_messages(cls: type, data: st.DataObject) -> None:
    frames = encode(cls.example())
    header = bytearray(frames[0])
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(header) - 1))
        header[pos] = data.draw(st.integers(0, 255))
    _decode_or_protocol_error([bytes(header), *frames[1:]])


@settings(max_examples=200, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers() .filter(lambda i: -(2**63) <= i < 2**64)
    | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=20,
), st.sampled_from(sorted(REGISTRY)))
def test_fuzz_structured_headers(body: object, tag: int) -> None:
    _decode_or_protocol_error([msgspec.msgpack.encode([tag, body])])
    _decode_or_protocol_error([msgspec.msgpack.encode(body)])
    if isinstance(body, dict):
        _decode_or_protocol_error([msgspec.msgpack.encode({**body, "tag": tag})])


def test_register_refuses_what_the_codec_cannot_carry() -> None:
    before = dict(REGISTRY)

    class Positional(Message, tag=9_996):  # kw_only not repeated: msgspec does not inherit it
        x: int = 0

    class Taken(Message, tag=TokenStream.TAG, kw_only=True):
        x: int = 0

    class Untagged(Message, kw_only=True):
        x: int = 0

    with pytest.raises(TypeError, match="kw_only"):
        register(Positional)
    with pytest.raises(ValueError, match="TokenStream"):
        register(Taken)
    for cls in (Untagged, _Opaque, int):
        with pytest.raises(TypeError):
            register(cls)
    assert dict(REGISTRY) == before
