"""Encode + decode time of every protocol message type (microseconds per round trip).

    python benchmarks/protocol_codec.py [--iterations 1000] [--repeats 15]

Small control messages (DraftTailStream, VerifyCommit) sit on the verifier's critical path once
per request per step, so their codec cost must stay far below a verify step (tens of ms on CPU).
One row per registered message type (its ``example()``), plus a 5-draft DraftTailStream. The
figure is the best (minimum) of the repeats: on a shared machine the other loads only ever add
time, so the minimum is the least noisy estimate of the codec's own cost. The A/B against the
previous hand-written codec (run at the commit that still had both) is in
docs/benchmarks.md, "Protocol codec: hand-written checker vs msgspec".
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from specmesh.protocol.codec import decode, encode
from specmesh.protocol.messages import REGISTRY, DraftTailStream


def time_round_trip(msg: Any, iterations: int) -> float:
    """Mean encode+decode time of ``msg`` over ``iterations`` round trips, in microseconds."""
    t0 = time.perf_counter()
    for _ in range(iterations):
        decode(encode(msg))
    return (time.perf_counter() - t0) / iterations * 1e6


def messages() -> dict[str, Any]:
    """Row name -> message: a 5-draft segment, then every registered type's example."""
    rows = {"DraftTailStream (5 drafts)": DraftTailStream(
        request_id="req-17", base_committed_len=40, start_pos=41,
        draft_token_ids=[1, 2, 3, 4, 5])}
    for tag in sorted(REGISTRY):
        rows[REGISTRY[tag].__name__] = REGISTRY[tag].example()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=15,
                        help="best of this many timed loops per row")
    args = parser.parse_args()
    print(f"{'message':28s}{'us per encode+decode':>22s}")
    for name, msg in messages().items():
        best = min(time_round_trip(msg, args.iterations) for _ in range(args.repeats))
        print(f"{name:28s}{best:22.2f}", flush=True)


if __name__ == "__main__":
    main()
