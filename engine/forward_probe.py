"""A short measurement of what one model's decode and verify forwards cost in each of several
dtypes on the machine at hand: what ``--dtype auto`` measures at first start
(``cluster/auto_resolve.py``).

Each dtype's model is loaded as the roles load it (:func:`engine.loader.load_model`: on CPU a
float32 GGUF model computes on its quantized blocks through the compiled stack, bf16 on
prepacked oneDNN weights), a random context is prefilled, then the forwards of one token and
of ``num_verify_tokens`` tokens after it are timed, the dtypes taking turns round by round so
that load from other processes falls on every candidate alike; each forward's fastest round is
kept (the one least disturbed by other processes: on shared cores an OpenMP team whose threads
are descheduled waits at every barrier, and a median can be many times the forward's cost).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from specmesh.engine.devices import resolve_device

#: prompt tokens cached before the timed forwards (a short chat turn)
PROBE_CONTEXT_LEN = 128
#: the tokens of the timed verify forward: a request's token and kappa = 4 drafts
PROBE_VERIFY_TOKENS = 5
#: timed rounds per dtype, after one untimed warm-up round
PROBE_ROUNDS = 5
#: what a timing is of the rounds (a cached measurement of another statistic is not reused)
PROBE_STATISTIC = "min"


@dataclass(frozen=True)
class ForwardTiming:
    """Milliseconds of a one-token (decode) forward and of a ``num_verify_tokens`` forward
    (verify) of one request after ``context_len`` cached tokens: the fastest of the rounds.
    ``load_avg``: the machine's one-minute load average when they were taken (-1: unknown),
    ``num_cpus`` its CPUs: a load above them says other processes shared the cores, and the
    times are higher than the forwards cost on an idle machine."""

    decode_ms: float
    verify_ms: float
    context_len: int = PROBE_CONTEXT_LEN
    num_verify_tokens: int = PROBE_VERIFY_TOKENS
    load_avg: float = -1.0
    num_cpus: int = 0

    def as_dict(self) -> dict:
        """The timing as ``cluster.auto`` compares and caches it (JSON)."""
        return {"decode_ms": self.decode_ms, "verify_ms": self.verify_ms,
                "context_len": self.context_len, "num_verify_tokens": self.num_verify_tokens,
                "load_avg": self.load_avg, "num_cpus": self.num_cpus}


def measure_dtypes(model: str | None, dtypes: list[str] | tuple[str, ...], num_threads: int,
                   device: str = "cpu", context_len: int = PROBE_CONTEXT_LEN,
                   num_verify_tokens: int = PROBE_VERIFY_TOKENS,
                   rounds: int = PROBE_ROUNDS) -> dict[str, ForwardTiming | str]:
    """Time ``model``'s forwards in each of ``dtypes`` on ``num_threads`` torch threads (the
    verifier's; restored afterwards). A dtype whose model cannot be loaded or prefilled maps to
    why (a string), so one failing candidate leaves the others measured.

    Raises:
        ValueError: ``rounds < 1``, ``num_threads < 1`` or ``num_verify_tokens < 2``.
        FileNotFoundError: the model cannot be found.
    """
    # torch and the model (triton kernels) only when measuring: a cached ForwardTiming is read
    # without them (cluster/auto_resolve.py)
    import torch

    from specmesh.engine.runner import SeqChunk

    if rounds < 1 or num_threads < 1 or num_verify_tokens < 2:
        raise ValueError("rounds and num_threads must be >= 1, num_verify_tokens >= 2")
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        runners: dict[str, tuple] = {}
        out: dict[str, ForwardTiming | str] = {}
        for dtype in dtypes:
            try:
                runners[dtype] = _prefilled(model, dtype, device, context_len,
                                            num_verify_tokens)
            except FileNotFoundError:
                raise
            except Exception as err:  # noqa: BLE001 - one candidate failing is a result
                out[dtype] = f"cannot run in {dtype}: {err}"

        def timed(dtype: str, n: int) -> float:
            runner, ids, ctx, table = runners[dtype]
            chunk = SeqChunk(ids[ctx:ctx + n], ctx, table)
            t0 = time.perf_counter()
            runner.forward([chunk], logits="all")
            return (time.perf_counter() - t0) * 1e3

        samples: dict[str, tuple[list[float], list[float]]] = {d: ([], []) for d in runners}
        for r in range(rounds + 1):  # round 0 warms up (first packs, page faults)
            for dtype in runners:
                one, many = timed(dtype, 1), timed(dtype, num_verify_tokens)
                if r:
                    samples[dtype][0].append(one)
                    samples[dtype][1].append(many)
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = -1.0
        for dtype, (one, many) in samples.items():
            out[dtype] = ForwardTiming(min(one), min(many), runners[dtype][2],
                                       num_verify_tokens, load, os.cpu_count() or 0)
        return {d: out[d] for d in dtypes if d in out}
    finally:
        torch.set_num_threads(before)


def _prefilled(model: str | None, dtype: str, device: str, context_len: int,
               num_verify_tokens: int) -> tuple:
    """(runner, token ids, context length, block table) of ``model`` loaded in ``dtype``, a
    random context of up to ``context_len`` tokens prefilled, room for ``num_verify_tokens``
    more."""
    # torch and the model (triton kernels) only when measuring, as in measure_dtypes
    import torch

    from specmesh.engine.kv_cache import KVCache
    from specmesh.engine.loader import load_model
    from specmesh.engine.runner import ModelRunner

    loaded = load_model(model, dtype=dtype, device=resolve_device(device))
    cfg, block_size = loaded.config, 16
    ctx = min(context_len, cfg.max_position_embeddings - num_verify_tokens)
    blocks = -(-(ctx + num_verify_tokens) // block_size)
    runner = ModelRunner(loaded.model, cfg, KVCache(cfg, blocks, block_size, loaded.model.dtype,
                                                    loaded.model.device))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (ctx + num_verify_tokens,), generator=gen).tolist()
    table = list(range(blocks))
    runner.prefill(ids[:ctx], table)
    return runner, ids, ctx, table
