"""Closed vocabularies of the protocol: role names, finish reasons, corpus operations and their
outcomes.

All are ``str`` enums, so a member equals its wire string (``Role.VERIFIER == "verifier"``)
and travels as that string; a decoder turns an unknown string into a ProtocolError where the
field matters.
"""

from __future__ import annotations

import enum


class Role(str, enum.Enum):
    """The processes of a specmesh cluster (docs/architecture.md, 'Roles'). The decode role is the
    verifier."""

    PREFILL = "prefill"
    VERIFIER = "verifier"
    DRAFTER = "drafter"
    GATEWAY = "gateway"

    def __str__(self) -> str:
        return self.value


class FinishReason(str, enum.Enum):
    """Why a request ended, as ``TokenStream.finish_reason`` and the OpenAI ``finish_reason``
    carry it. ``STOP``: EOS or a stop token / string; ``LENGTH``: ``max_tokens``; ``ABORT``:
    the client went away or asked; ``ERROR``: the cluster failed it (``error`` says why);
    ``INVALID``: refused at admission (HTTP 400); ``QUEUE_FULL``: refused, try later (HTTP 429).
    """

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    INVALID = "invalid"
    QUEUE_FULL = "queue_full"

    def __str__(self) -> str:
        return self.value

    @property
    def is_success(self) -> bool:
        """The request ran to its natural end (not aborted, failed or refused)."""
        return self in (FinishReason.STOP, FinishReason.LENGTH)


class CorpusOp(str, enum.Enum):
    """What a :class:`~protocol.messages.DrafterCorpus` asks of the drafters: ``LOAD`` a corpus
    under a name (replacing one of that name), ``DROP`` it, or ``CLEAR_HISTORY``: forget what
    earlier requests left in the drafters' cross-request memory (corpora stay)."""

    LOAD = "load"
    DROP = "drop"
    CLEAR_HISTORY = "clear_history"

    def __str__(self) -> str:
        return self.value


class CorpusStatus(str, enum.Enum):
    """How one drafter answered a corpus operation
    (:class:`~protocol.messages.DrafterCorpusResult`): ``APPLIED`` (loaded, dropped, history
    cleared), ``UNKNOWN`` (a drop of a name it does not hold), ``UNSUPPORTED`` (its drafting
    method keeps no corpora), ``SUPERSEDED`` (a newer operation on the same name reached it
    first: this one was not applied) or ``ERROR`` (``error`` says why)."""

    APPLIED = "applied"
    UNKNOWN = "unknown"
    UNSUPPORTED = "unsupported"
    SUPERSEDED = "superseded"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


class LoraOp(str, enum.Enum):
    """What a :class:`~protocol.messages.LoraAdapterOp` asks of a role: ``LOAD`` an adapter,
    ``UNLOAD`` one, or ``SYNC``: serve exactly the adapters it lists."""

    LOAD = "load"
    UNLOAD = "unload"
    SYNC = "sync"

    def __str__(self) -> str:
        return self.value


#: What DraftClose.reason says for each way a request ends.
DRAFT_CLOSE_FINISHED = "finished"
DRAFT_CLOSE_ABORT = "abort"
