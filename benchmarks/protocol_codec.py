"""Encode + decode time of protocol messages (microseconds per round trip).

    python benchmarks/protocol_codec.py [--iterations 20000]

Small control messages (DraftTailStream, VerifyCommit) sit on the verifier's critical path once
per request per step, so their codec cost must stay far below a verify step (tens of ms on CPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

from specmesh.protocol.codec import decode, encode
from specmesh.protocol.messages import DraftTailStream, VerifyCommit


def time_round_trip(msg, iterations: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean encode+decode time of ``msg``, in microseconds."""
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iterations):
            decode(encode(msg))
        per_call.append((time.perf_counter() - t0) / iterations * 1e6)
    return statistics.median(per_call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20000)
    args = parser.parse_args()
    messages = {
        "DraftTailStream (5 drafts)": DraftTailStream(
            request_id="req-17", base_committed_len=40, start_pos=41,
            draft_token_ids=[1, 2, 3, 4, 5]),
        "VerifyCommit example": VerifyCommit.example(),
    }
    for name, msg in messages.items():
        print(f"{name:32s} {time_round_trip(msg, args.iterations):8.1f} us per encode+decode")


if __name__ == "__main__":
    main()
