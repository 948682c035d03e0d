"""--drafter: the forms a user types, and the config they build."""

import pytest

from cluster.cli import build_parser
from cluster.drafter_option import parse_drafter
from cluster.options import cluster_config


def test_forms():
    assert parse_drafter("ngram") == ("ngram", {})
    assert parse_drafter("eagle") == ("eagle", {})
    assert parse_drafter("eagle:/x/head") == ("eagle", {"head": "/x/head"})
    assert parse_drafter("draft-model:/m") == ("draft_model", {"model": "/m"})


@pytest.mark.parametrize("bad", ["medusa", "eagle:", "draft-model", "draft-model:", "ngram:3"])
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
    assert parse_drafter("ngram", None, 3) == ("ngram", {"tree_width": 3})
    assert parse_drafter("eagle", None, 3) == ("eagle", {})  # n-gram only
    with pytest.raises(SystemExit, match="tree-width"):
        parse_drafter("ngram", None, 0)
    args = build_parser().parse_args(["serve", "--model", tiny_model_dir, "--drafter", "ngram",
                                      "--ngram-tree-width", "1"])
    assert cluster_config(args).drafter.method_kwargs == {"tree_width": 1}
