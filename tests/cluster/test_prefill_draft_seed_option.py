"""`--prefill-draft-seed on|off` (ClusterConfig.prefill_draft_seed, on by default) and the
prefill's seeders it builds (cluster/prefill_seeder.py): one for a method that makes prefill
seeds (EAGLE), none when off or for a method that does not (n-gram); the seeder reports the
drafter's topk capped at 16."""

from __future__ import annotations

import pytest
import torch

from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.prefill_seeder import prefill_seeders, seeder_of


def _serve_config(*argv: str):
    from specmesh.cluster.cli import build_parser
    from specmesh.cluster.options import cluster_config

    return cluster_config(build_parser().parse_args(["serve", "--drafter", "ngram", *argv]))


def test_the_option_defaults_on_and_turns_off():
    assert ClusterConfig.create(model="m").prefill_draft_seed
    assert _serve_config().prefill_draft_seed
    assert not _serve_config("--prefill-draft-seed", "off").prefill_draft_seed
    with pytest.raises(SystemExit):
        _serve_config("--prefill-draft-seed", "maybe")


def test_no_seeders_when_off_or_for_a_method_without_seeds():
    assert prefill_seeders(ClusterConfig.create(model="m", draft_method="ngram")) == {}
    assert prefill_seeders(ClusterConfig.create(model="m", draft_method="eagle",
                                                prefill_draft_seed=False)) == {}


class _Topk:
    def __init__(self, topk):
        self.topk, self.calls = topk, []

    def make_prefill_seed(self, rid, ctx, hidden, topk):
        self.calls.append(topk)


@pytest.mark.parametrize("topk,want", [(1, 1), (4, 4), (20, 16)])
def test_the_seeder_reports_the_drafters_topk_capped(topk, want):
    p = _Topk(topk)
    seeder_of(p)("r", [1, 2], torch.zeros(1, 4))
    assert p.calls == [want]


def test_a_proposer_the_prefill_cannot_build_costs_the_seed_not_the_role(tmp_path, caplog):
    """A head path that exists only on the drafter's node: the prefill gets no seeder (logged)
    and starts; the drafter runs the first draft step itself."""
    cfg = ClusterConfig.create(model="m", draft_method="eagle", method_kwargs={
        "head": str(tmp_path / "only-on-the-drafter-node")})
    with caplog.at_level("WARNING"):
        assert prefill_seeders(cfg) == {}
    assert "no eagle proposer at the prefill" in caplog.text
