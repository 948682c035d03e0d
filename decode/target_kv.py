"""What a verifier that shares its KV pool (engine/shared_kv.py) tells the drafter of each
request: its block table and how many rows of it hold committed K/V
(protocol.messages.TargetKVRows), sent with every DraftSync and VerifyCommit. A frozen-KV MTP
drafter on the verifier's node reads those rows read-only and never others (docs/drafters.md,
'Frozen-KV MTP'). Without a shared pool nothing is added: the default path is unchanged."""

from __future__ import annotations

from specmesh.decode.request import Request, RequestStatus
from specmesh.protocol.messages import TargetKVRows


def target_kv_rows(req: Request, shared: bool) -> TargetKVRows | None:
    """``req``'s committed rows for its drafter when the pool is ``shared``: rows ``[0,
    kv_len)`` (prompt + committed output but the last token, whose K/V the next verify
    forward writes) with the blocks that hold them; None when the pool is not shared, or the
    request is not running (its prompt's K/V may still be arriving: nothing is readable)."""
    if not shared or req.status is not RequestStatus.RUNNING:
        return None
    return TargetKVRows(block_table=list(req.block_table), num_rows=max(req.kv_len, 0))
