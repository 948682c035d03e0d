"""``--enable-prefix-caching`` reaches the prefill config; prefix caching through the
in-process workers (real messages and KV frames) on a float32 tiny Llama: a prompt seen before
and prompts sharing a long prefix hit the prefill's cache, and every output equals plain decode
of the same prompt by a cluster whose cache is cold; the prefill role's metrics count the tokens
looked up and hit."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from helpers.models import tiny_llama
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specmesh.cluster.cli import build_parser
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.cluster.metrics import RoleCollector
from specmesh.cluster.options import cluster_config
from specmesh.protocol.messages import SamplingParams

VOCAB = 96
BLOCK = 4


@pytest.fixture(scope="module")
def tiny():
    _, model, cfg = tiny_llama(seed=2, dtype=torch.float32, vocab_size=VOCAB)
    rng = random.Random(7)
    shared = [rng.randrange(3, VOCAB) for _ in range(26)]
    prompts = [shared + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 2, 9)]
    return model, cfg, prompts


def _cluster(model, cfg, k):
    return InProcessCluster(model, cfg, num_speculative_tokens=k, num_kv_blocks=128,
                            block_size=BLOCK, prefill_options={"enable_prefix_caching": True})


@pytest.mark.parametrize("sampling", [SamplingParams(max_tokens=16),
                                      SamplingParams(max_tokens=16, temperature=0.8, seed=11)])
def test_cached_prefixes_give_the_outputs_of_plain_decode(tiny, sampling):
    model, cfg, prompts = tiny
    # plain decode, each prompt by a cluster of its own: nothing cached before it
    want = [_cluster(model, cfg, 0).generate([p], sampling)[0].token_ids for p in prompts]
    c = _cluster(model, cfg, 3)
    st = c.prefill.stats
    (first,) = c.generate(prompts[:1], sampling)
    assert first.token_ids == want[0] and st.prefix_cache_hits == 0
    again = c.generate(prompts, sampling)  # the same prompt again, and two sharing its prefix
    assert [r.token_ids for r in again] == want
    assert st.prefix_cache_hits >= 24 * 3  # 6 full blocks of the shared 26 tokens, each
    assert st.num_computed_tokens == st.num_prompt_tokens - st.prefix_cache_hits
    assert st.prefix_cache_queries == st.num_prompt_tokens
    # vLLM's counters in the prefill role's metrics
    registry = CollectorRegistry()
    registry.register(RoleCollector(SimpleNamespace(role="prefill", instance_id="prefill-0",
                                                    worker=c.prefill)))
    text = generate_latest(registry).decode()
    got = {s.name: s.value for fam in text_string_to_metric_families(text)
           for s in fam.samples if s.name.startswith("specmesh:prefix_cache")}
    assert got == {"specmesh:prefix_cache_queries_total": st.prefix_cache_queries,
                   "specmesh:prefix_cache_hits_total": st.prefix_cache_hits}


@pytest.mark.parametrize("flag, want", [([], True), (["--enable-prefix-caching"], True),
                                        (["--no-enable-prefix-caching"], False)])
def test_the_option_reaches_the_prefill_config(flag, want):
    args = build_parser().parse_args(["serve", "--dtype", "float32", "--device", "cpu",
                                      "--drafter", "ngram", *flag])
    assert cluster_config(args).prefill.enable_prefix_caching is want
