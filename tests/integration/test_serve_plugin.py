"""A drafting method from another distribution, end to end through the Ray cluster: the test
writes a distribution with a ``specmesh.drafters`` entry point into a temporary directory and
puts it on the driver's ``sys.path`` and on the PYTHONPATH of the role processes (as a
deployment installs a plugin on every node); ``specmesh serve --drafter copycat:span=1`` then
resolves the method in the driver (CLI parsing, thread plan) and in the prefill, verifier and
drafter processes (seed state, factory). Its drafts are accepted and the output token ids
equal plain greedy decoding's (kappa 0)."""

from __future__ import annotations

import os
from dataclasses import replace

import httpx
import pytest
from helpers.plugins import COPYCAT_SOURCE, forget_modules, write_dist

import specmesh.cluster.launcher as launcher
import specmesh.drafter.registry as registry
from specmesh.cluster.cli import build_parser
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.cluster.options import cluster_config
from specmesh.engine.loader import load_model
from specmesh.gateway.tokens import completion_prompt_ids
from specmesh.protocol.messages import SamplingParams

pytestmark = pytest.mark.ray

#: plain greedy on the tiny model repeats itself on these (the copied tail drafts well)
PROMPTS = ["1 2 3 4 5 6 7 8 9 10 11 12", "Count: 1, 2, 3, 4, 5,", "The capital of France is"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory):
    root = write_dist(tmp_path_factory.mktemp("plugin") / "site", "specmesh-copycat",
                      {"specmesh_copycat.method": COPYCAT_SOURCE},
                      {registry.ENTRY_POINT_GROUP: {
                          "copycat": "specmesh_copycat.method:CopycatProposer"}})
    yield str(root)
    forget_modules(("specmesh_copycat",))


@pytest.fixture(scope="module")
def plugin_cluster(ray_session, tiny_model_dir, plugin_dir):
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(plugin_dir)  # the driver
    registry.spellings()
    mp.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    path = os.pathsep.join(p for p in (plugin_dir, os.environ.get("PYTHONPATH")) if p)
    role_options = launcher.role_options

    def with_plugin(role, cfg, num_gpus=0):  # the role processes
        opts = role_options(role, cfg, num_gpus)
        opts["runtime_env"]["env_vars"]["PYTHONPATH"] = path
        return opts

    mp.setattr(launcher, "role_options", with_plugin)
    args = build_parser().parse_args([
        "serve", "--model", tiny_model_dir, "--dtype", "float32", "--device", "cpu",
        "--num-speculative-tokens", "3", "--kv-cache-mb", "32", "--max-model-len", "1024",
        "--port", "0", "--drafter", "copycat:span=1"])
    cfg = replace(cluster_config(args), namespace="specmesh-test-plugin")
    assert (cfg.drafter.method, cfg.drafter.method_kwargs) == ("copycat", {"span": 1})
    assert cfg.verifier.draft_method == "copycat"
    handle = launcher.start_cluster(cfg)
    yield handle
    handle.stop()
    mp.undo()


def test_an_entry_point_drafter_serves_plain_greedy_output_with_drafts_accepted(
        plugin_cluster, tiny_model_dir):
    lm = load_model(tiny_model_dir, "float32")
    plain = InProcessCluster(lm.model, lm.config, num_speculative_tokens=0,
                             eos_token_ids=lm.config.eos_token_ids)
    drafted = accepted = 0
    for prompt in PROMPTS:
        (want,) = plain.generate([completion_prompt_ids(lm.tokenizer, prompt)],
                                 SamplingParams(max_tokens=MAX_TOKENS))
        r = httpx.post(f"{plugin_cluster.url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["token_ids"] == list(want.token_ids), prompt
        drafted += body["spec_stats"]["num_draft_tokens"]
        accepted += body["spec_stats"]["num_accepted_tokens"]
        assert body["spec_stats"]["synthetic_acceptance"] is False
    assert drafted > 0 and accepted > 0, (drafted, accepted)
