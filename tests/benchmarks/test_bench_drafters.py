"""``specmesh bench --drafters`` and ``specmesh generate --drafter``: the methods' forms and
labels, the schedule and report with a row per method (per-position acceptance, share of
steps with drafts, exactness vs kappa = 0, flagged loudly when not), the per-method cluster
configs (own Ray namespace), the in-process systems per method and ``generate`` on the tiny
model (n-gram and a random EAGLE head: the output is the plain-decode output)."""

import pytest

from specmesh.benchmarks.harness.bench import _schedule
from specmesh.benchmarks.harness.options import (
    cluster_drafter,
    namespace_for,
    parse_drafters,
    with_drafter,
)
from specmesh.benchmarks.harness.render import markdown
from specmesh.benchmarks.harness.report import HF_BASELINE, summarize, systems_for
from specmesh.cluster.cli import main
from specmesh.cluster.config import ClusterConfig, default_threads
from specmesh.cluster.runs import RunResult
from specmesh.protocol.spec_stats import SpecStats
from specmesh.protocol.step_profile import StepProfile


# -- the --drafters forms ----------------------------------------------------------------------


def test_drafters_forms_and_labels(tiny_model_dir):
    ds = parse_drafters("ngram, eagle:/x/tiny-head ,draft-model:/m/draft", tiny_model_dir)
    assert [d.label for d in ds] == ["ngram", "eagle:tiny-head", "draft-model:draft"]
    assert [(d.method, d.method_kwargs) for d in ds] == [
        ("ngram", {}), ("eagle", {"head": "/x/tiny-head"}), ("draft_model", {"model": "/m/draft"})]
    assert [d.label for d in parse_drafters("auto", tiny_model_dir)] == ["ngram"]  # no head
    # two heads in directories of one name: labelled as typed
    assert [d.label for d in parse_drafters("eagle:/a/h,eagle:/b/h")] == ["eagle:h", "eagle:/b/h"]


@pytest.mark.parametrize("text,match", [
    ("ngram,hydra",
     r"--drafters: --drafter 'hydra': unknown drafting method 'hydra'; known: "
     r"dflash, draft-model, dspark, eagle, frozen-kv-mtp, medusa, ngram"),
    ("ngram,draft-model", r"--drafters: .*key 'model' is required.*the draft model"),
    (" , ", r"--drafters: no draft method given"),
    ("ngram,ngram", r"--drafters: 'ngram' is the same method as 'ngram'"),
])
def test_drafters_refuses_unknown_or_repeated_forms(text, match):
    with pytest.raises(SystemExit, match=match):
        parse_drafters(text)


def test_bench_refuses_an_unknown_drafter_before_starting_anything():
    with pytest.raises(SystemExit, match=r"--drafters: --drafter 'hydra'"):
        main(["bench", "--drafters", "ngram,hydra"])


def test_each_method_gets_its_own_config_and_namespace():
    import specmesh.cluster.actors as actors
    from specmesh.protocol.enums import Role

    cfg = ClusterConfig.create(num_speculative_tokens=3)
    ngram, eagle = parse_drafters("ngram,eagle:/h")
    assert cluster_drafter(cfg) == ngram
    namespaces = {namespace_for(d, i) for i, d in enumerate((ngram, eagle))}
    assert len(namespaces) == 2 and cfg.namespace not in namespaces
    e = with_drafter(cfg, eagle, namespace_for(eagle, 1))
    assert e.verifier.draft_method == e.drafter.method == "eagle"
    assert e.drafter.method_kwargs == {"head": "/h"}
    assert e.verifier.num_speculative_tokens == 3 and e.drafter.window == cfg.drafter.window
    assert e.namespace == namespace_for(eagle, 1) != cfg.namespace
    assert actors.role_options(Role.VERIFIER, e)["namespace"] == e.namespace
    assert actors.role_options(Role.VERIFIER, cfg)["namespace"] == actors.NAMESPACE


def test_a_thread_plan_variant_is_the_same_method_served_under_another_plan():
    """``eagle@verifier=1+drafter=1``: a served-only variant whose cluster runs that plan
    (the rest of the bench's plan kept); no in-process twin; bad plans are refused."""
    cfg = ClusterConfig.create(num_speculative_tokens=3)
    base, variant = parse_drafters("eagle:/h,eagle:/h@verifier=1+drafter=1")
    assert variant.label == "eagle:h@verifier=1+drafter=1" and variant.served_only
    assert not base.served_only and base.threads == {}
    t = with_drafter(cfg, variant, namespace_for(variant, 1)).threads
    assert t == {**default_threads(model_drafter=True), "verifier": 1, "drafter": 1}
    # a default plan follows each method's default: a model drafter leaves the verifier a core
    assert with_drafter(cfg, base).threads == default_threads(model_drafter=True)
    ngram = parse_drafters("ngram")[0]
    assert with_drafter(with_drafter(cfg, base), ngram).threads == default_threads()
    custom = ClusterConfig.create(num_speculative_tokens=3, threads={
        "verifier": 3, "prefill": 1, "drafter": 1, "gateway": 1})
    assert with_drafter(custom, base).threads == custom.threads  # a user's plan is kept
    names = [s.name for s in systems_for(3, 1, [base.label, variant.label], [variant.label])]
    assert "served k=3 eagle:h@verifier=1+drafter=1" in names
    assert "in-process k=3 eagle:h@verifier=1+drafter=1" not in names
    assert "in-process k=3 eagle:h" in names
    sched = _schedule([1], 3, 1, [base.label, variant.label], [variant.label])
    assert {s.name for _, _, s in sched} == set(names)
    for bad in ("eagle@verifier=0", "eagle@cook=1", "ngram,ngram@drafter=1,ngram@drafter=1"):
        with pytest.raises(SystemExit, match="--drafters"):
            parse_drafters(bad)


# -- schedule and report -----------------------------------------------------------------------


def test_schedule_runs_every_methods_systems_at_every_level():
    methods = ["ngram", "eagle"]
    sched = _schedule([1, 2], kappa=3, repeats=2, methods=methods)
    for r in (0, 1):
        for level in (1, 2):
            names = [s.name for rr, lv, s in sched if (rr, lv) == (r, level)]
            want = {"served k=3 ngram", "served k=3 eagle", "served k=0",
                    "in-process k=3 ngram", "in-process k=3 eagle", "in-process k=0",
                    HF_BASELINE} | ({"hf prompt lookup k=3"} if level == 1 else set())
            assert sorted(names) == sorted(want)  # each once: served k=0 once, not per method
    systems = {s.name: s for s in systems_for(3, 1, methods)}
    assert systems["served k=3 eagle"].method == "eagle"
    assert systems["served k=3 eagle"].plain == "served k=0"
    assert systems["in-process k=3 ngram"].plain == "in-process k=0"
    assert systems["served k=0"].method is None
    assert [s.name for s in systems_for(0, 2, methods)] == ["served k=0", "in-process k=0",
                                                          HF_BASELINE]


def _prof(steps: int, with_drafts: int) -> dict:
    p = StepProfile()
    p.observe("forward_with_drafts", 0.005)
    p.count("num_request_steps", steps)
    p.count("num_request_steps_with_drafts", with_drafts)
    return p.as_dict()


def _run(name, texts, ids=None, spec=(0, 0, 0), per_pos=(), profile=None, tps=10):
    return RunResult(name, seconds=1.0, num_tokens=tps, spec=SpecStats(*spec), texts=texts,
                     token_ids=ids, accepted_per_pos=list(per_pos), profile=profile)


def _two_method_summary() -> dict:
    ids = [[1, 2], [3, 4]]
    runs = {
        "served k=3 ngram": [_run("served k=3 ngram", ["a", "b"], spec=(6, 3, 2),
                                  per_pos=[2, 1, 0, 0], profile=_prof(8, 2), tps=30)],
        "served k=3 eagle": [_run("served k=3 eagle", ["a", "b"], spec=(12, 9, 4),
                                  per_pos=[4, 3, 2, 0], profile=_prof(8, 4), tps=40)],
        "served k=0": [_run("served k=0", ["a", "b"], tps=20)],
        "in-process k=3 ngram": [_run("in-process k=3 ngram", ["a", "b"], ids, (3, 1, 1),
                                      [1, 0, 0], _prof(4, 1), tps=35)],
        "in-process k=3 eagle": [_run("in-process k=3 eagle", ["a", "z"], [[1, 2], [3, 5]],
                                      (6, 4, 2), [2, 1, 1], _prof(4, 2), tps=50)],
        "in-process k=0": [_run("in-process k=0", ["a", "b"], ids, tps=25)],
        HF_BASELINE: [_run(HF_BASELINE, ["a", "b"], ids, tps=10)],
    }
    config = {"model": "tiny", "dtype": "float32", "kappa": 3, "max_tokens": 8,
              "num_prompts": 2, "repeats": 1,
              "threads": {"verifier": 2, "prefill": 2, "drafter": 1, "gateway": 1},
              "bench_threads": 2, "served_clusters": "one cluster per draft method",
              "drafters": [{"label": "ngram"}, {"label": "eagle"}]}
    return summarize(config, {2: runs}, {2: systems_for(3, 2, ["ngram", "eagle"])})


def test_report_has_a_row_per_method_with_per_position_acceptance():
    s = _two_method_summary()
    lv = s["levels"]["2"]["systems"]
    ng, ea = lv["served k=3 ngram"], lv["served k=3 eagle"]
    assert ng["method"] == "ngram" and ea["method"] == "eagle"
    assert ng["acceptance_per_position"] == [1.0, 0.5, 0.0]  # cut to kappa; / steps w/ drafts
    assert ea["acceptance_per_position"] == [1.0, 0.75, 0.5]
    assert ea["mean_accept_len"] == pytest.approx(9 / 4)
    assert ng["verify_steps_with_drafts_share"] == pytest.approx(0.25)
    assert ea["verify_steps_with_drafts_share"] == pytest.approx(0.5)
    assert lv["served k=0"]["verify_steps_with_drafts_share"] is None
    assert ng["exact"] is True and ea["exact"] is True  # texts vs served k=0
    assert lv["in-process k=3 ngram"]["exact"] is True
    ratios = s["levels"]["2"]["ratios"]
    assert ratios["served k=3 eagle / in-process k=3 eagle"] == pytest.approx(0.8)
    assert ratios["served k=3 eagle / served k=0"] == pytest.approx(2.0)


def test_a_method_whose_output_differs_from_kappa0_is_flagged_loudly():
    s = _two_method_summary()
    bad = s["levels"]["2"]["systems"]["in-process k=3 eagle"]
    assert bad["exact"] is False and bad["identical_to_k0"] == [True, False]
    assert s["mismatches"] == [{"concurrency": 2, "system": "in-process k=3 eagle",
                                "plain": "in-process k=0", "requests": [1]}]
    text = markdown(s)
    assert ("**OUTPUT MISMATCH at concurrency 2: in-process k=3 eagle differs from "
            "in-process k=0 on request(s) 1**") in text
    assert "| in-process k=3 eagle | 50.00 | 5.00 | 0.67 | 2.00 | 1.00 / 0.50 / 0.50 | 50% |" \
        in text
    assert "**1/2 MISMATCH** |" in text
    # accepted per step (all request-steps) = mean accept len x share of steps with drafts
    assert "| served k=3 eagle | 40.00 | 4.00 | 0.75 | 2.25 | 1.00 / 0.75 / 0.50 | 50% | " \
        "1.12 | 2/2 | 2/2 |" in text
    assert "drafters ngram, eagle" in text.splitlines()[0]
    assert ("- thread plan: served roles: verifier 2, prefill 2, drafter 1, gateway 1; "
            "bench process (in-process, HF): 2") in text
    assert "- served clusters: one cluster per draft method" in text


# -- in-process per method, generate --drafter (tiny model) -------------------------------------


@pytest.fixture(scope="module")
def random_head(tiny_model_dir, tmp_path_factory):
    """An untrained EAGLE head for the tiny model (its drafts are mostly wrong: the output
    must still be the plain-decode output)."""
    from helpers.eagle_heads import save_random_head

    return save_random_head(tiny_model_dir, tmp_path_factory.mktemp("heads") / "tiny-head")


def test_inprocess_systems_per_method_are_exact(tiny_model_dir, random_head):
    from specmesh.benchmarks.harness.systems import InProcessSystems
    from specmesh.engine.loader import load_model

    cfg = ClusterConfig.create(model=tiny_model_dir, dtype="float32", num_speculative_tokens=3)
    drafters = parse_drafters(f"ngram,eagle:{random_head}", tiny_model_dir)
    loaded = load_model(tiny_model_dir, dtype="float32")
    systems = InProcessSystems(loaded, 16, 12,
                               methods={d.label: with_drafter(cfg, d) for d in drafters})
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11]]
    plain = systems.run(prompts, 0, 2, "in-process k=0")
    for d in drafters:
        res = systems.run(prompts, 3, 2, f"in-process k=3 {d.label}", d.label)
        assert res.token_ids == plain.token_ids, d.label
        assert res.spec.num_draft_tokens > 0 and len(res.accepted_per_pos) >= 3, d.label
        assert systems.cluster(3, 2, d.label).drafter.proposer.name == d.method
    with pytest.raises(KeyError, match="no draft method 'hydra'"):
        systems.cluster(3, 1, "hydra")


def _generate(tiny_model_dir, capsys, *extra):
    rc = main(["generate", "--model", tiny_model_dir, "--dtype", "float32", "--threads", "1",
               "--prompt", "List three colours, then list them again.", "--max-tokens", "12",
               "--num-speculative-tokens", "3", *extra])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out, out.err


def test_generate_with_a_drafter(tiny_model_dir, random_head, capsys):
    text, err = _generate(tiny_model_dir, capsys, "--drafter", "ngram")
    assert "drafter ngram" in err and "spec stats" in err
    plain, _ = _generate(tiny_model_dir, capsys, "--num-speculative-tokens", "0")
    eagle, err = _generate(tiny_model_dir, capsys, "--drafter", f"eagle:{random_head}")
    assert "drafter eagle" in err
    assert text == plain == eagle
    with pytest.raises(SystemExit, match="--drafter 'hydra'"):
        main(["generate", "--model", tiny_model_dir, "--prompt", "x", "--drafter", "hydra"])


# -- thread plans --------------------------------------------------------------------------------


def test_the_bench_process_keeps_every_core_unless_the_user_set_a_plan(tiny_model_dir,
                                                                     tiny_eagle_head):
    """HF and the in-process systems run in the bench process. A model drafter's default plan
    leaves its served verifier one core fewer; that must not cost the baselines a core (a
    bench of n-gram methods under the default ``--drafter auto`` = eagle once ran HF and
    in-process on one thread while the n-gram clusters' verifiers had two)."""
    from specmesh.benchmarks.harness.bench import bench_process_threads
    from specmesh.cluster.cli import build_parser
    from specmesh.cluster.options import cluster_config

    n = default_threads()["verifier"]

    def cfg(*extra):
        return cluster_config(build_parser().parse_args(["bench", "--model", tiny_model_dir,
                                                         *extra]))

    eagle = cfg("--drafter", f"eagle:{tiny_eagle_head[0]}")
    assert eagle.threads["verifier"] == max(1, n - 1)
    assert bench_process_threads(eagle) == n
    assert bench_process_threads(cfg("--drafter", "ngram")) == n
    assert bench_process_threads(cfg("--drafter", "ngram", "--thread-plan",
                                     "verifier=1")) == 1


def test_the_header_names_each_clusters_plan_when_they_differ():
    from specmesh.benchmarks.harness.render import thread_plan_text

    ngram = {"verifier": 2, "prefill": 1, "drafter": 1, "gateway": 1}
    eagle = {**ngram, "verifier": 1}
    text = thread_plan_text({"threads": ngram, "cluster_threads": {"ngram": ngram,
                                                                   "eagle": eagle},
                             "bench_threads": 2})
    assert "ngram: verifier 2" in text and "eagle: verifier 1" in text
    assert "bench process (in-process, HF): 2" in text
    same = thread_plan_text({"threads": ngram, "cluster_threads": {"ngram": ngram}})
    assert same == "served roles: verifier 2, prefill 1, drafter 1, gateway 1"
