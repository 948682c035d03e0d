"""Encode + decode time of every protocol message type (microseconds per round trip).

    python benchmarks/protocol_codec.py [--iterations 1000] [--repeats 15]

Small control messages (DraftTailStream, VerifyCommit) sit on the verifier's critical path once
per request per step, so their codec cost must stay far below a verify step (tens of ms on CPU).
One row per registered message type (its ``example()``), plus a 5-draft DraftTailStream. While
the previous hand-written codec is still importable (``specmesh.protocol._legacy``), each row
times both codecs in the same run, interleaved repeat by repeat, and prints their ratio. The
figure is the best (minimum) of the repeats: on a shared machine the other loads only ever add
time, so the minimum is the least noisy estimate of the codec's own cost.
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Callable
from typing import Any


def time_round_trip(msg: Any, encode: Callable, decode: Callable, iterations: int) -> float:
    """Mean encode+decode time of ``msg`` over ``iterations`` round trips, in microseconds."""
    t0 = time.perf_counter()
    for _ in range(iterations):
        decode(encode(msg))
    return (time.perf_counter() - t0) / iterations * 1e6


def _stack(package: str) -> tuple[Any, Any] | None:
    """(codec, messages) modules of ``package``, or None when it is not importable."""
    try:
        return (importlib.import_module(f"{package}.codec"),
                importlib.import_module(f"{package}.messages"))
    except ImportError:
        return None


def _messages(messages: Any) -> dict[str, Any]:
    """Row name -> message of the ``messages`` module (every registered type's example)."""
    rows = {"DraftTailStream (5 drafts)": messages.DraftTailStream(
        request_id="req-17", base_committed_len=40, start_pos=41,
        draft_token_ids=[1, 2, 3, 4, 5])}
    for tag in sorted(messages.REGISTRY):
        cls = messages.REGISTRY[tag]
        rows[cls.__name__] = cls.example()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=15,
                        help="best of this many timed loops per codec and row")
    args = parser.parse_args()
    stacks = {"msgspec": _stack("specmesh.protocol")}
    legacy = _stack("specmesh.protocol._legacy")
    if legacy is not None:
        stacks = {"hand-written": legacy, **stacks}
    rows = {name: _messages(messages) for name, (_, messages) in stacks.items()}
    names = list(rows["msgspec"])
    print(f"{'message':28s}" + "".join(f"{name + ' us':>16s}" for name in stacks)
          + ("   ratio" if legacy is not None else ""))
    for row in names:
        times: dict[str, list[float]] = {name: [] for name in stacks}
        for _ in range(args.repeats):  # interleaved: both codecs see the same machine load
            for name, (codec, _) in stacks.items():
                msg = rows[name][row]
                times[name].append(time_round_trip(msg, codec.encode, codec.decode,
                                                   args.iterations))
        best = {name: min(t) for name, t in times.items()}
        line = f"{row:28s}" + "".join(f"{best[name]:16.2f}" for name in stacks)
        if legacy is not None:
            line += f"{best['msgspec'] / best['hand-written']:8.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
