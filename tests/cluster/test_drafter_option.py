"""--drafter: the forms a user types, and the config they build."""

import pytest

from specmesh.cluster.cli import build_parser
from specmesh.cluster.drafter_option import parse_drafter
from specmesh.cluster.options import cluster_config


def test_forms():
    assert parse_drafter("ngram") == ("ngram", {})
    assert parse_drafter("eagle") == ("eagle", {})
    assert parse_drafter("eagle:/x/head") == ("eagle", {"head": "/x/head"})
    assert parse_drafter("draft-model:/m") == ("draft_model", {"model": "/m"})


def test_ngram_settings_form(tiny_model_dir):
    """``ngram:min=1+max=3+width=4`` sets the proposer's match lengths and tree width (any
    subset), and reaches the drafter's config and a built proposer."""
    from specmesh.drafter.registry import get_proposer

    assert parse_drafter("ngram:min=1") == ("ngram", {"min_ngram": 1})
    assert parse_drafter("ngram:width=4+max=3+min=1") == (
        "ngram", {"tree_width": 4, "max_ngram": 3, "min_ngram": 1})
    assert parse_drafter("ngram:min=1", None, {"ngram_tree_width": 3}) == (
        "ngram", {"min_ngram": 1, "tree_width": 3})
    args = build_parser().parse_args(["serve", "--model", tiny_model_dir,
                                      "--drafter", "ngram:min=1+width=1"])
    cfg = cluster_config(args)
    assert cfg.drafter.method_kwargs == {"min_ngram": 1, "tree_width": 1}
    prop = get_proposer(cfg.drafter.method)(**cfg.drafter.method_kwargs)
    assert (prop.min_ngram, prop.max_ngram, prop.tree_width) == (1, 4, 1)
    # a one-token match drafts only with min=1
    assert prop.propose_tree("r", [5, 6, 7, 5], 2) == ([6, 7], [-1, 0])
    assert get_proposer("ngram")().propose_tree("r", [5, 6, 7, 5], 2) == ([], [])


@pytest.mark.parametrize("bad", ["ngram:min=0", "ngram:min=x", "ngram:min=5", "ngram:max=1",
                                 "ngram:depth=2", "ngram:min", "ngram:", "ngram:min=1,width=2"])
def test_bad_ngram_settings_are_refused_naming_the_keys(bad):
    with pytest.raises(SystemExit, match=r"--drafter ngram:.*(min|max|KEY)"):
        parse_drafter(bad)


@pytest.mark.parametrize("bad", ["hydra", "eagle:", "draft-model", "draft-model:", "ngram:3"])
def test_malformed_forms_are_refused_naming_the_choices(bad):
    with pytest.raises(SystemExit, match="drafter"):
        parse_drafter(bad)


def test_auto_is_ngram_for_a_target_without_a_shipped_head(tiny_model_dir):
    assert parse_drafter("auto", tiny_model_dir) == ("ngram", {})


def test_the_option_reaches_verifier_and_drafter_configs(tiny_model_dir):
    args = build_parser().parse_args(["serve", "--model", tiny_model_dir,
                                      "--drafter", "eagle:/some/head"])
    cfg = cluster_config(args)
    assert cfg.verifier.draft_method == cfg.drafter.method == "eagle"
    assert cfg.drafter.method_kwargs == {"head": "/some/head"}


def test_ngram_tree_width_option(tiny_model_dir):
    width = {"ngram_tree_width": 3}
    assert parse_drafter("ngram", None, width) == ("ngram", {"tree_width": 3})
    assert parse_drafter("ngram:width=2", None, width) == ("ngram", {"tree_width": 2})  # key wins
    assert parse_drafter("eagle", None, width) == ("eagle", {})  # n-gram only
    with pytest.raises(SystemExit, match="tree-width"):
        parse_drafter("ngram", None, {"ngram_tree_width": 0})
    args = build_parser().parse_args(["serve", "--model", tiny_model_dir, "--drafter", "ngram",
                                      "--ngram-tree-width", "1"])
    assert cluster_config(args).drafter.method_kwargs == {"tree_width": 1}


def test_a_model_drafter_leaves_the_verifier_a_core_in_the_default_plan(tiny_model_dir,
                                                                       tiny_eagle_head):
    """Measured (docs/benchmarks.md, 'Threads and OpenMP'): served EAGLE is fastest with the
    verifier on n - 1 threads beside the drafter's one; the n-gram drafter (pure Python) leaves all
    n."""
    from specmesh.cluster.config import default_threads

    n = default_threads()["verifier"]
    ngram = cluster_config(build_parser().parse_args(["serve", "--model", tiny_model_dir,
                                                      "--drafter", "ngram"]))
    eagle = cluster_config(build_parser().parse_args(["serve", "--model", tiny_model_dir,
                                                      "--drafter", f"eagle:{tiny_eagle_head[0]}"]))
    assert ngram.threads["verifier"] == n
    assert eagle.threads["verifier"] == max(1, n - 1) and eagle.threads["drafter"] == 1
    assert eagle.threads["prefill"] == 1  # prefill runs beside the verifier on shared cores
    forced = cluster_config(build_parser().parse_args([
        "serve", "--model", tiny_model_dir, "--drafter", f"eagle:{tiny_eagle_head[0]}",
        "--thread-plan", "verifier=2"]))
    assert forced.threads["verifier"] == 2


def test_thread_plan_option_overrides_the_default_plan(tiny_model_dir):
    args = build_parser().parse_args(["serve", "--model", tiny_model_dir,
                                      "--thread-plan", "verifier=1,drafter=2"])
    threads = cluster_config(args).threads
    assert threads["verifier"] == 1 and threads["drafter"] == 2
    assert threads["gateway"] == 1 and threads["prefill"] >= 1  # the rest: the default plan
    for bad in ("verifier=0", "cook=2", "verifier", "drafter=x"):
        args = build_parser().parse_args(["serve", "--model", tiny_model_dir,
                                          "--thread-plan", bad])
        with pytest.raises(SystemExit, match="thread-plan"):
            cluster_config(args)


def test_the_cluster_learns_a_fused_heads_seed_state_from_its_config(tiny_model_dir,
                                                                      tiny_fused_eagle_head,
                                                                      tiny_eagle_head):
    """The prefill and verifier hosts configure their workers with the seed state of the head
    the drafters will load (read from its config.json, no weights): "hidden:1,0" for a fused
    head, "hidden" for an EAGLE-1 head, "" for n-gram."""
    from specmesh.cluster.hosts.drafter import cluster_seed_state

    for head, kind in ((tiny_fused_eagle_head[0], "hidden:1,0"), (tiny_eagle_head[0], "hidden")):
        args = build_parser().parse_args(["serve", "--model", tiny_model_dir,
                                          "--drafter", f"eagle:{head}"])
        assert cluster_seed_state(cluster_config(args)) == kind
    args = build_parser().parse_args(["serve", "--model", tiny_model_dir, "--drafter", "ngram"])
    assert cluster_seed_state(cluster_config(args)) == ""
