"""The goodput policy's profiled verify-cost table at a verifier's start: read from
``--verify-cost-table FILE``, or measured on the verifier's runner (engine/verify_cost_probe.py)
and cached per model, dtype, KV-cache dtype, CPU, torch version and threads in the weights
cache's ``auto/`` (as ``--dtype auto`` caches its measurement, cluster/auto_resolve.py), so a
restart or a second verifier of the same deployment on the same CPU measures nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from specmesh.cluster.auto import AutoCache
from specmesh.decode.config import VerifierConfig
from specmesh.decode.cost_table import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_WIDTHS,
    VerifyCostTable,
    table_from_dict,
)

log = logging.getLogger(__name__)


def cost_key(model: Mapping, dtype: str, kv_cache_dtype: str, cpu: Mapping, torch_version: str,
             threads: int, batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
             widths: tuple[int, ...] = DEFAULT_WIDTHS) -> dict:
    """What a measured table is valid for: the model's files (its fingerprint), the model and
    KV-cache dtypes, this CPU (engine.devices.cpu_identity), torch, the verifier's threads
    and the buckets measured. A change in any of them measures again."""
    return {"what": "verify_cost", "model": dict(model), "dtype": dtype,
            "kv_cache_dtype": kv_cache_dtype, "cpu": dict(cpu), "torch": torch_version,
            "threads": int(threads), "batch_sizes": list(batch_sizes), "widths": list(widths)}


def cached_or_measured(key: Mapping, measure: Callable[[], dict[tuple[int, int], float]],
                       cache: AutoCache | None) -> VerifyCostTable:
    """The table stored under ``key`` in ``cache`` (``source`` ``cached``), else
    ``measure()`` made into a table (``source`` ``measured``) and stored. A malformed stored
    entry is measured again."""
    batch_sizes, widths = tuple(key["batch_sizes"]), tuple(key["widths"])
    stored = cache.get(key) if cache is not None else None
    if stored is not None:
        try:
            return table_from_dict(stored, "cached")
        except ValueError as err:
            log.warning("verify cost cache entry unusable (%s): measuring again", err)
    table = VerifyCostTable(batch_sizes, widths, measure(), source="measured")
    if cache is not None:
        cache.put(key, table.as_dict())
    return table


def verifier_cost_table(config: VerifierConfig, runner, model: str | None, dtype: str,
                        kv_cache_dtype: str, threads: int,
                        cache: AutoCache | None = None) -> VerifyCostTable | None:
    """The table the verifier of ``config`` runs its goodput or confidence policy on (None:
    none asked for, or another policy): the file's, or measured on ``runner`` / cached.

    Raises:
        ValueError: a malformed file table (checked where the command ran already).
    """
    if not config.uses_cost_table or not config.verify_cost_table:
        return None
    if config.verify_cost_table_data is not None:
        return table_from_dict(config.verify_cost_table_data, config.verify_cost_table)
    # the measurement runs the engine's model (torch, triton kernels): in the verifier's
    # process only
    import torch

    from specmesh.cluster.auto_resolve import auto_cache
    from specmesh.engine.devices import cpu_identity
    from specmesh.engine.loader import model_fingerprint
    from specmesh.engine.verify_cost_probe import PROBE_CONTEXT_LEN, measure_verify_costs

    key = cost_key(model_fingerprint(model), dtype, kv_cache_dtype, cpu_identity(),
                   torch.__version__, threads)
    blocks_per_request = -(-(PROBE_CONTEXT_LEN + max(DEFAULT_WIDTHS)) // runner.block_size)
    batch_sizes = tuple(b for b in DEFAULT_BATCH_SIZES
                        if b * blocks_per_request <= runner.kv_cache.num_blocks)
    if batch_sizes != DEFAULT_BATCH_SIZES:
        log.warning("verify cost table: the KV cache holds too few blocks to measure every "
                    "batch size; online EMA only")
        return None

    def measure() -> dict[tuple[int, int], float]:
        log.info("measuring the verify cost table (first start on this model and CPU; cached)")
        return measure_verify_costs(runner, DEFAULT_BATCH_SIZES, DEFAULT_WIDTHS)

    return cached_or_measured(key, measure, auto_cache() if cache is None else cache)


__all__ = ["cached_or_measured", "cost_key", "verifier_cost_table"]
