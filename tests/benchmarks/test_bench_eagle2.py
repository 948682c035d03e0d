"""``specmesh bench --drafters eagle,eagle:topk=4+nodes=12``: EAGLE chains and EAGLE-2 trees
compared in one run, each a method of its own (label, namespace and cluster config carrying
the tree options), and ``--eagle-topk`` / ``--eagle-tree-nodes`` as the CLI's flags."""

from specmesh.benchmarks.harness.options import namespace_for, parse_drafters, with_drafter
from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.drafter_option import parse_drafter


def test_chains_and_trees_are_two_methods_of_one_run(tiny_model_dir):
    chain, tree = parse_drafters("eagle,eagle:topk=4+nodes=12", tiny_model_dir)
    assert (chain.label, chain.method_kwargs) == ("eagle", {})
    assert tree.label == "eagle:topk=4+nodes=12"
    assert tree.method_kwargs == {"topk": 4, "tree_nodes": 12}
    cfg = ClusterConfig.create(model=tiny_model_dir, dtype="float32", port=0)
    a = with_drafter(cfg, chain, namespace_for(chain, 0))
    b = with_drafter(cfg, tree, namespace_for(tree, 1))
    assert a.namespace != b.namespace
    assert b.drafter.method == "eagle" and b.drafter.method_kwargs["topk"] == 4


def test_flags_set_the_tree_options_unless_the_form_does():
    _, kwargs = parse_drafter("eagle", None, {"eagle_topk": 3, "eagle_tree_nodes": 9})
    assert kwargs == {"topk": 3, "tree_nodes": 9}
    _, kwargs = parse_drafter("eagle:topk=2", None, {"eagle_topk": 3})
    assert kwargs == {"topk": 2}


def test_profile_reports_seed_bytes_per_request_and_nodes_per_tree():
    from specmesh.benchmarks.harness.render import profile_markdown
    from specmesh.benchmarks.harness.report import profile_summary

    chain = profile_summary({"phases": {}, "counters": {
        "seed_state_bytes": 2304, "num_seed_states": 2}})
    tree = profile_summary({"phases": {}, "counters": {
        "seed_state_bytes": 2304, "num_seed_states": 2,
        "drafter tree_nodes": 24, "drafter tree_segments": 3}})
    assert chain["seed_state_bytes_per_request"] == 1152
    assert chain["tree_nodes_per_tree"] is None and tree["tree_nodes_per_tree"] == 8
    lines = profile_markdown({"concurrency": 1, "systems": {
        "served k=4 eagle": {"profile": chain},
        "served k=4 eagle:topk=4": {"profile": tree}}})
    assert "| seed-state bytes per request (prefill -> decode) | 1152 | 1152 |" in lines
    assert "| nodes per draft tree sent |  | 8.0 |" in lines
