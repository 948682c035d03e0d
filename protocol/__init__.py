"""specmesh wire layer: message dataclasses, errors and the msgpack codec (DESIGN.md §3).

Imports no torch / numpy: buffers travel as :class:`Buffer` (dtype name, shape, bytes).
"""

from __future__ import annotations

from protocol import codec, errors, messages, schema
from protocol.codec import (
    MAX_BUFFER_BYTES,
    MAX_DEPTH,
    MAX_FRAMES,
    MAX_HEADER_BYTES,
    decode,
    encode,
    encoded_size,
)
from protocol.enums import FinishReason, Role
from protocol.errors import ProtocolError
from protocol.messages import (
    DTYPE_ITEMSIZE,
    PLACEHOLDER_TOKEN_ID,
    PROTOCOL_VERSION,
    REGISTRY,
    Abort,
    Buffer,
    DraftBranches,
    DraftClose,
    DraftNeedSync,
    DraftSync,
    DraftTailStream,
    GenerateRequest,
    Hello,
    HelloAck,
    KVFrame,
    ModelIdentity,
    PrefillCancel,
    PrefillCancelAck,
    PrefillDone,
    PrefillRequest,
    SamplingParams,
    TokenStream,
    VerifyCommit,
    buffer_nbytes,
    register,
)
from protocol.spec_stats import SpecStats

__all__ = [
    "codec", "errors", "messages", "schema",
    "encode", "decode", "encoded_size",
    "MAX_HEADER_BYTES", "MAX_BUFFER_BYTES", "MAX_FRAMES", "MAX_DEPTH",
    "ProtocolError", "FinishReason", "Role", "SpecStats",
    "PROTOCOL_VERSION", "PLACEHOLDER_TOKEN_ID", "REGISTRY", "DTYPE_ITEMSIZE", "register",
    "buffer_nbytes",
    "Buffer", "ModelIdentity", "SamplingParams", "Hello", "HelloAck", "GenerateRequest",
    "TokenStream", "Abort", "PrefillRequest", "KVFrame", "PrefillDone", "PrefillCancel",
    "PrefillCancelAck", "DraftSync", "VerifyCommit", "DraftTailStream", "DraftBranches",
    "DraftClose",
    "DraftNeedSync",
]
