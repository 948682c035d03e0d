"""Synthetic acceptance, the ablation harness of ``--verify-rule synthetic`` (issue 8 item 6):
through the in-process workers the measured per-position acceptance follows the given curve
(binomial bounds) and the mean-accept-length form gives that mean, whatever the drafter
proposes (a garbage drafter); off by default; responses (spec_stats, a header), the gateway's
and the verifier's metrics say it was used; the CLI options build the curve."""

from __future__ import annotations

import math
import types

import httpx
import pytest
import torch
from helpers.models import tiny_llama
from helpers.proposers import GarbageProposer

from specmesh.cluster.inprocess import VERIFIER, InProcessCluster
from specmesh.cluster.metrics import RoleCollector
from specmesh.decode.config import VerifierConfig
from specmesh.decode.rules import outputs_exact
from specmesh.decode.synthetic import conditional_rates, curve_from_mean_accept_len, parse_curve
from specmesh.protocol.messages import SamplingParams

VOCAB = 96
PROMPTS = [[5 + i, 6, 7, 8, 9, 5, 6, 7 + i] for i in range(48)]


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(seed=1, dtype=torch.float64, vocab_size=VOCAB)


def _run(tiny, curve, k=4, max_tokens=64, sampling=None):
    """Every verify step's ``(num_draft_tokens, accept_len)`` and the completions."""
    _, model, cfg = tiny
    c = InProcessCluster(model, cfg, num_speculative_tokens=k, num_kv_blocks=1024,
                         block_size=4, proposer=GarbageProposer(VOCAB, seed=4),
                         adaptive_drafts=False, verify_rule="synthetic",
                         synthetic_acceptance=tuple(curve))
    c.verifier.verify_step.generator().manual_seed(0)
    steps = []
    run = c.verifier.verify_step.run

    def spy(plan, return_hidden=False):
        outs = run(plan, return_hidden)
        steps.extend((o.num_draft_tokens, o.accept_len) for o in outs if o.num_draft_tokens)
        return outs

    c.verifier.verify_step.run = spy  # type: ignore[method-assign]
    sp = sampling or SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return steps, c.generate(PROMPTS, sp), c


def _within_binomial(hits: int, n: int, p: float, sds: float = 4.5) -> bool:
    return abs(hits - n * p) <= sds * math.sqrt(n * p * (1 - p)) + 1


def test_per_position_acceptance_follows_the_curve(tiny):
    curve = (0.8, 0.6, 0.4)
    steps, res, _ = _run(tiny, curve)
    assert all(r.spec.synthetic_acceptance for r in res)
    assert len(steps) > 600
    # position 3 keeps the last conditional rate: 0.4 * (0.4 / 0.6)
    want = [0.8, 0.6, 0.4, 0.4 * 0.4 / 0.6]
    for j, p in enumerate(want):
        reached = [a for k, a in steps if k >= j + 1]
        hits = sum(a >= j + 1 for a in reached)
        assert len(reached) > 100 and _within_binomial(hits, len(reached), p), (j, hits,
                                                                                len(reached), p)


def test_mean_accept_len_form_gives_that_mean(tiny):
    curve = curve_from_mean_accept_len(2.0, 4)
    assert sum(curve) == pytest.approx(2.0)
    steps, _, _ = _run(tiny, curve)
    full = [a for k, a in steps if k == 4]
    mean = sum(full) / len(full)
    var = sum((a - mean) ** 2 for a in full) / len(full)
    assert len(full) > 300
    assert abs(mean - 2.0) <= 4.5 * math.sqrt(var / len(full)), (mean, len(full))


def test_zero_curve_is_plain_decoding_and_full_curve_accepts_every_draft(tiny):
    hf, _, _ = tiny
    from helpers.models import hf_greedy

    steps, res, _ = _run(tiny, (0.0,), max_tokens=12)
    assert steps and all(a == 0 for _, a in steps)
    assert [r.token_ids for r in res[:3]] == [hf_greedy(hf, p, 12) for p in PROMPTS[:3]]
    steps, res, _ = _run(tiny, (1.0,), max_tokens=12)
    assert steps and all(a == k for k, a in steps)


def test_off_by_default_and_curve_checked():
    assert VerifierConfig().verify_rule == "auto" and VerifierConfig().synthetic_acceptance == ()
    with pytest.raises(ValueError):
        VerifierConfig(verify_rule="synthetic")
    with pytest.raises(ValueError):
        VerifierConfig(synthetic_acceptance=(0.5,))
    for bad in [(0.4, 0.6), (1.2,), (-0.1,)]:
        with pytest.raises(ValueError):
            VerifierConfig(verify_rule="synthetic", synthetic_acceptance=bad)
    assert conditional_rates((0.8, 0.4, 0.0, 0.0)) == pytest.approx([0.8, 0.5, 0.0, 0.0])
    assert parse_curve("0.8, 0.6,0.4") == (0.8, 0.6, 0.4)
    with pytest.raises(ValueError):
        parse_curve("0.8,x")
    with pytest.raises(ValueError):
        curve_from_mean_accept_len(5.0, 4)


def test_cli_options_build_the_curve():
    from specmesh.cluster.cli import build_parser
    from specmesh.cluster.options import cluster_config

    parse = build_parser().parse_args
    cfg = cluster_config(parse(["serve", "--verify-rule", "synthetic",
                                "--synthetic-acceptance", "0.8,0.6,0.4"]))
    assert cfg.verifier.verify_rule == "synthetic"
    assert cfg.verifier.synthetic_acceptance == (0.8, 0.6, 0.4)
    assert cfg.drafter.draft_probs is False
    cfg = cluster_config(parse(["bench", "--verify-rule", "synthetic",
                                "--num-speculative-tokens", "3",
                                "--synthetic-mean-accept-len", "1.5"]))
    assert sum(cfg.verifier.synthetic_acceptance) == pytest.approx(1.5)
    assert len(cfg.verifier.synthetic_acceptance) == 3
    default = cluster_config(parse(["serve"]))
    assert default.verifier.verify_rule == "auto" and not default.verifier.synthetic_acceptance
    for argv in (["serve", "--verify-rule", "synthetic"],
                 ["serve", "--synthetic-acceptance", "0.5"],
                 ["demo", "--verify-rule", "synthetic", "--synthetic-acceptance", "0.5",
                  "--synthetic-mean-accept-len", "1"],
                 ["launch", "verifier", "--address", "x", "--verify-rule", "synthetic",
                  "--synthetic-acceptance", "0.5,0.9"]):
        with pytest.raises(SystemExit):
            cluster_config(parse(argv))


def test_responses_and_metrics_say_synthetic_acceptance_was_used(tiny_model_dir):
    """Through the real gateway app: spec_stats and a header flag it (streaming and not), the
    gateway counts it, the verifier's metrics carry a gauge and the curve; a default
    deployment's responses say false."""
    import threading
    import time

    from prometheus_client import CollectorRegistry, generate_latest

    from specmesh.gateway.app import create_app
    from specmesh.gateway.backend import MailboxBackend
    from specmesh.gateway.server import serve_gateway
    from specmesh.engine.loader import load_model

    loaded = load_model(tiny_model_dir, dtype="float32")
    for rule, curve in (("synthetic", (0.9, 0.5)), ("auto", ())):
        c = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=3,
                             proposer=GarbageProposer(loaded.config.vocab_size, seed=1),
                             verify_rule=rule, synthetic_acceptance=curve)
        stop = threading.Event()

        def drive(c=c, stop=stop):
            while not stop.is_set():
                c.drafter.step()
                c.prefill.step()
                c.verifier.step()
                time.sleep(0.001)

        thread = threading.Thread(target=drive, daemon=True)
        thread.start()
        backend = MailboxBackend(c.client, lambda: VERIFIER, recv_timeout_s=0.1)
        # the gateway flags responses from the cluster's configuration (no message says so)
        app = create_app(backend, loaded.tokenizer, "tiny", 1024, default_max_tokens=12,
                         synthetic_acceptance=not outputs_exact(rule))
        server, _, port = serve_gateway(app)
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
                r = client.post("/v1/completions", json={"prompt": "The sea is", "max_tokens": 12})
                assert r.status_code == 200, r.text
                stats = r.json()["spec_stats"]
                assert stats["synthetic_acceptance"] is (rule == "synthetic")
                assert stats["num_draft_tokens"] > 0
                assert (r.headers.get("x-specmesh-synthetic-acceptance") == "1") \
                    is (rule == "synthetic")
                with client.stream("POST", "/v1/completions", json={
                        "prompt": "The sea is", "max_tokens": 12, "stream": True}) as s:
                    lines = [ln for ln in s.iter_lines() if '"spec_stats"' in ln]
                assert lines and (('"synthetic_acceptance":true' in lines[-1].replace(" ", ""))
                                  is (rule == "synthetic"))
                metrics = client.get("/metrics").text
            line = next(ln for ln in metrics.splitlines() if ln.startswith(
                "specmesh:gateway_spec_decode_synthetic_acceptance_requests_total"))
            assert float(line.split()[-1]) == (2.0 if rule == "synthetic" else 0.0)
        finally:
            server.stop()
            backend.close()
            stop.set()
            thread.join(5)
        registry = CollectorRegistry()
        registry.register(RoleCollector(types.SimpleNamespace(
            role="verifier", instance_id="verifier-0", worker=c.verifier)))
        text = generate_latest(registry).decode()
        gauge = next(ln for ln in text.splitlines()
                     if ln.startswith("specmesh:spec_decode_synthetic_acceptance{"))
        assert float(gauge.split()[-1]) == (1.0 if rule == "synthetic" else 0.0)
        assert ('specmesh:spec_decode_synthetic_acceptance_rate{' in text) is bool(curve)


def test_bench_runs_synthetic_in_process_too_and_says_so(tiny):
    """``specmesh bench --verify-rule synthetic``: the in-process kappa > 0 systems judge
    drafts by the same curve as the served ones (kappa 0 stays plain), and the report's
    header says the outputs are not the target's."""
    from specmesh.benchmarks.harness.systems import InProcessSystems
    from specmesh.benchmarks.harness.render import markdown

    _, model, cfg = tiny
    loaded = types.SimpleNamespace(model=model, config=cfg)
    systems = InProcessSystems(loaded, 16, 8, verifier_options={
        "verify_rule": "synthetic", "synthetic_acceptance": (0.8, 0.5)})
    assert systems.cluster(3, 2).verifier.config.synthetic_acceptance == (0.8, 0.5)
    assert systems.cluster(0, 2).verifier.config.verify_rule == "auto"
    conf = {"model": "m", "dtype": "float32", "kappa": 3, "max_tokens": 8, "num_prompts": 1,
            "repeats": 1, "threads": {"verifier": 2}, "bench_threads": 2,
            "synthetic_acceptance": [0.8, 0.5]}
    text = markdown({"config": conf, "levels": {}, "mismatches": []})
    assert "SYNTHETIC ACCEPTANCE" in text and "[0.800, 0.500]" in text
    assert "SYNTHETIC" not in markdown({"config": {**conf, "synthetic_acceptance": []},
                                        "levels": {}, "mismatches": []})


def test_the_gateway_flag_comes_from_the_cluster_configuration_not_the_wire():
    """No message carries the flag; the gateway host derives it from the cluster's verifier
    configuration (the registered rule it picks is not exact)."""
    from specmesh.cluster.config import ClusterConfig
    from specmesh.cluster.hosts.gateway import synthetic_outputs
    from specmesh.protocol.messages import TokenStream

    assert "synthetic_acceptance" not in set(TokenStream.__struct_fields__)
    assert synthetic_outputs(ClusterConfig.create(verify_rule="synthetic",
                                                  synthetic_acceptance=(0.5,)))
    assert not synthetic_outputs(ClusterConfig.create(verify_rule="block"))
    assert not synthetic_outputs(ClusterConfig())
