"""StepProfile: bucket placement, quantiles, counters, and its Prometheus export."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from specmesh.cluster.metrics import profile_families
from specmesh.protocol.step_profile import BUCKETS_S, PhaseStats, StepProfile


def test_buckets_sum_and_quantiles():
    st = PhaseStats()
    for s in (0.0004, 0.0004, 0.003, 0.02, 9.0):
        st.observe(s)
    assert st.count == 5 and st.sum_s == pytest.approx(9.0238)
    assert st.bucket_counts[BUCKETS_S.index(0.0005)] == 2
    assert st.bucket_counts[BUCKETS_S.index(0.005)] == 1
    assert st.bucket_counts[-1] == 1  # above every bound
    assert st.quantile(0.4) == 0.0005
    assert st.quantile(0.6) == 0.005
    assert math.isinf(st.quantile(1.0))
    d = st.as_dict()
    assert d["p50_ms"] == pytest.approx(5.0) and d["mean_ms"] == pytest.approx(9023.8 / 5)
    assert PhaseStats().quantile(0.5) == 0.0


def test_phase_context_manager_and_counters():
    prof = StepProfile()
    with prof.phase("forward"):
        pass
    with pytest.raises(RuntimeError):
        with prof.phase("forward"):
            raise RuntimeError("still recorded")
    prof.count("num_steps")
    prof.count("num_steps", 2)
    d = prof.as_dict()
    assert d["phases"]["forward"]["count"] == 2
    assert d["counters"] == {"num_steps": 3}


def test_prometheus_export_is_a_cumulative_histogram():
    prof = StepProfile()
    prof.observe("forward", 0.03)
    prof.observe("forward", 0.07)
    prof.count("num_steps_with_drafts", 4)

    class Collector:
        def collect(self):
            yield from profile_families(prof, {"role": "verifier", "instance": "v0"})

    reg = CollectorRegistry()
    reg.register(Collector())
    text = generate_latest(reg).decode()
    line = ('specmesh:step_phase_seconds_bucket{instance="v0",le="0.05",phase="forward",'
            'role="verifier"} 1.0')
    assert line in text
    assert 'le="+Inf",phase="forward",role="verifier"} 2.0' in text
    assert 'specmesh:step_phase_seconds_sum{instance="v0",phase="forward",role="verifier"} 0.1' \
        in text
    assert ('specmesh:step_profile_count_total{instance="v0",name="num_steps_with_drafts",'
            'role="verifier"} 4.0') in text
