"""specmesh's OpenAI-compatible HTTP gateway (docs/architecture.md, 'Life of a request' steps 1 and
5).

- :func:`create_app` builds the FastAPI app over any backend with ``generate`` / ``abort``.
- :class:`MailboxBackend` is that backend over a protocol Mailbox (in-process hub or ZMQ).
- :func:`serve_gateway` runs the app with uvicorn in a background thread.
"""

from __future__ import annotations

from specmesh.gateway.app import create_app
from specmesh.gateway.backend import GenerationBackend, MailboxBackend
from specmesh.gateway.detokenize import IncrementalDetokenizer, StopStringMatcher
from specmesh.gateway.server import serve_gateway, stop

__all__ = ["create_app", "MailboxBackend", "GenerationBackend", "IncrementalDetokenizer",
           "StopStringMatcher", "serve_gateway", "stop"]
