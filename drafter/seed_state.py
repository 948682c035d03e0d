"""Seed states on the drafter: the target hidden states a DraftSync / VerifyCommit carries,
checked against what the message and the proposer say they must be
(docs/architecture.md, 'Messages')."""

from __future__ import annotations

import torch

from specmesh.engine.frames import buffer_to_tensor
from specmesh.protocol.messages import Buffer


def hidden_rows(buf: Buffer, hidden_size: int | None, num_rows: int | None = None,
                min_rows: int = 1) -> torch.Tensor:
    """The rows of ``buf`` as a floating tensor [n, hidden]: exactly ``num_rows`` of them when
    given (a VerifyCommit: one per committed token), else at least ``min_rows`` (a DraftSync),
    ``hidden_size`` wide unless None.

    Raises:
        ValueError: the buffer does not decode, is not a floating matrix, or has the wrong
            number of rows or width.
    """
    if len(buf.shape) != 2:
        raise ValueError(f"seed state of shape {list(buf.shape)}: expected [rows, hidden]")
    rows, width = buf.shape
    if num_rows is not None and rows != num_rows:
        raise ValueError(f"seed state has {rows} rows for {num_rows} committed tokens")
    if rows < min_rows:
        raise ValueError(f"seed state has {rows} rows, at least {min_rows} expected")
    if hidden_size is not None and width != hidden_size:
        raise ValueError(f"seed state is {width} wide, the proposer expects {hidden_size}")
    hidden = buffer_to_tensor(buf)
    if not hidden.is_floating_point():
        raise ValueError(f"seed state of dtype {buf.dtype}: expected floating point")
    return hidden
