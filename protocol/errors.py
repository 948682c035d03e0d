"""Errors of the wire layer."""

from __future__ import annotations


class ProtocolError(ValueError):
    """A peer sent something that is not a valid specmesh message (or sent it out of turn).

    ``request_id`` is set when the bad message named a request, so only that request is
    quarantined; the role itself keeps running.
    """

    def __init__(self, message: str, *, request_id: str | None = None, peer: str | None = None):
        super().__init__(message)
        self.request_id = request_id
        self.peer = peer
