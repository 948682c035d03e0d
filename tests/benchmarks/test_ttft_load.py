"""benchmarks/ttft_load.py without a server: prompts, and the TTFT parts read from /metrics."""

from __future__ import annotations

import pytest

from specmesh.benchmarks.ttft_load import TOKEN_RANGE, phase_means, prompt_ids


def test_prompts_are_fixed_by_their_seed_and_differ_between_seeds():
    a = prompt_ids(7, 128)
    assert a == prompt_ids(7, 128) and len(a) == 128
    assert all(TOKEN_RANGE[0] <= t < TOKEN_RANGE[1] for t in a)
    assert a[:8] != prompt_ids(8, 128)[:8]  # no shared prefix for a prompt cache to reuse


def _series(role: str, phase: str, count: float, total_s: float) -> dict[str, float]:
    labels = f'{{instance="{role}-0",phase="{phase}",role="{role}"}}'
    return {f"specmesh:step_phase_seconds_count{labels}": count,
            f"specmesh:step_phase_seconds_sum{labels}": total_s}


def test_phase_means_are_the_run_s_deltas_per_role():
    before = {**_series("verifier", "ttft", 2, 1.0), **_series("prefill", "forward", 2, 0.6),
              **_series("verifier", "commit", 5, 0.1),
              'specmesh:time_to_first_token_seconds_count{model_name="m"}': 2,
              'specmesh:time_to_first_token_seconds_sum{model_name="m"}': 1.1}
    after = {**_series("verifier", "ttft", 6, 2.2), **_series("prefill", "forward", 6, 1.8),
             **_series("verifier", "commit", 9, 0.2), **_series("verifier", "kv_ingest", 4, 0.02),
             'specmesh:time_to_first_token_seconds_count{model_name="m"}': 6,
             'specmesh:time_to_first_token_seconds_sum{model_name="m"}': 2.5}
    got = phase_means(before, after)
    assert set(got) == {"verifier ttft", "prefill forward", "verifier kv_ingest", "gateway ttft"}
    assert got["verifier ttft"]["count"] == 4
    assert got["verifier ttft"]["mean_ms"] == pytest.approx(300.0)
    assert got["prefill forward"]["mean_ms"] == pytest.approx(300.0)
    assert got["verifier kv_ingest"]["mean_ms"] == pytest.approx(5.0)
    assert got["gateway ttft"]["mean_ms"] == pytest.approx(350.0)
