"""The gateway-side state of one request in flight: the asyncio queue its TokenStreams go to
(on its event loop), its verifier, its latest stream (whose spec stats a locally made
terminal message keeps) and the output tokens delivered so far (the ``offset`` the next
TokenStream must carry, docs/architecture.md, 'Messages')."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from specmesh.protocol.messages import TokenStream


@dataclass
class Pending:
    """Gateway-side state of one in-flight request."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    verifier: str = ""
    last: TokenStream | None = None  # latest real stats, for a local terminal message
    closed: bool = field(default=False)
    num_tokens: int = 0  # output tokens delivered: the offset the next TokenStream must carry
