"""``specmesh serve --corpus [NAME=]FILE ...`` (cluster/corpus_files.py): names from the option
or the file, checks before anything starts (unreadable files, a method without corpora, bad or
repeated names), and the files reaching the ClusterConfig the gateway reads them from."""

from __future__ import annotations

import pytest

from specmesh.cluster.cli import build_parser
from specmesh.cluster.corpus_files import check_corpus_option, corpus_specs, read_corpus_file
from specmesh.cluster.options import cluster_config


def test_names_come_from_the_option_or_the_file(tmp_path):
    a = tmp_path / "api docs.md"
    a.write_text("x")
    assert corpus_specs([str(a), f"code={a}"]) == [("api-docs.md", str(a)), ("code", str(a))]
    odd = tmp_path / "k=v.txt"  # a file whose name holds "=" is taken as a file
    odd.write_text("y")
    assert corpus_specs([str(odd)]) == [("k-v.txt", str(odd))]
    with pytest.raises(ValueError, match="two corpora are named 'api-docs.md'"):
        corpus_specs([str(a), str(a)])
    with pytest.raises(ValueError, match="may only hold"):
        corpus_specs([f"bad name={a}"])


def test_checks_before_anything_starts(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("corpus text")
    assert check_corpus_option([str(f)], "ngram", True) == [("c.txt", str(f))]
    assert check_corpus_option([], "eagle", False) == []
    with pytest.raises(SystemExit, match="'eagle' drafting method keeps no cross-request"):
        check_corpus_option([str(f)], "eagle", False)
    with pytest.raises(SystemExit, match="is not a readable file"):
        check_corpus_option([str(tmp_path / "missing.txt")], "ngram", True)
    with pytest.raises(SystemExit, match="is not a readable file"):
        check_corpus_option([f"d={tmp_path}"], "ngram", True)  # a directory


def test_serve_takes_corpora_into_the_cluster_config(tmp_path):
    f = tmp_path / "guide.txt"
    f.write_text("caf\u00e9 \xff")
    args = build_parser().parse_args(["serve", "--dtype", "float32", "--device", "cpu",
                                      "--drafter", "ngram", "--corpus", str(f), f"g2={f}"])
    assert cluster_config(args).corpus_files == (str(f), f"g2={f}")
    assert cluster_config(build_parser().parse_args(
        ["serve", "--dtype", "float32", "--device", "cpu"])).corpus_files == ()
    bad = build_parser().parse_args(["serve", "--dtype", "float32", "--device", "cpu",
                                     "--drafter", "eagle", "--corpus", str(f)])
    with pytest.raises(SystemExit, match="no cross-request memory"):
        cluster_config(bad)
    f.write_bytes(b"ok \xff end")
    assert read_corpus_file(str(f)) == "ok \ufffd end"
