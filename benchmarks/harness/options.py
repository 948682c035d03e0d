"""What one ``specmesh bench`` run does: its command-line options (registered on the CLI's
``bench`` subparser by :func:`add_bench_options`), the :class:`BenchOptions` they parse into,
and the draft methods the run compares.

``--drafters`` lists the methods, each a ``--drafter`` form (``ngram``, ``eagle:PATH``,
``auto``, a plugin...: cluster/drafter_option.py), optionally with a thread plan of its served
cluster after ``@`` (``eagle@verifier=1+drafter=1``: the same method again under another plan,
served only, so that plans are compared in one run). Each method gets the cluster
configuration it runs under (the bench's config with that method, in its own Ray namespace, so
the methods' served clusters run side by side in one Ray session). ``--baselines`` picks the
systems specmesh is compared with: Hugging Face ``generate`` (``hf``) and llama.cpp's
``llama-server`` (benchmarks/harness/llama_server.py). Imports no torch and no Ray at load.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass, field, replace
from pathlib import PurePath

from specmesh.benchmarks.harness.llama_server import DEFAULT_SPEC_TYPE, NGRAM_SPEC_TYPES
from specmesh.benchmarks.harness.report import BASELINES
from specmesh.cluster.config import DEFAULT_NAMESPACE, ClusterConfig, default_threads
from specmesh.cluster.drafter_option import parse_drafter
from specmesh.cluster.options import is_model_drafter, parse_thread_plan
from specmesh.data.prompts import parse_concurrency



@dataclass(frozen=True)
class BenchDrafter:
    """One compared method: ``label`` (in system names, e.g. ``served k=4 eagle``), ``spec``
    (as typed), ``method`` (registry name) and its ``method_kwargs``."""

    label: str
    spec: str
    method: str
    method_kwargs: dict = field(default_factory=dict, hash=False)
    #: torch threads per role of its served cluster over the bench's plan (empty: the plan)
    threads: dict = field(default_factory=dict, hash=False)

    @property
    def served_only(self) -> bool:
        """A thread-plan variant: in-process runs would repeat its method's."""
        return bool(self.threads)

    def as_dict(self) -> dict:
        return {"label": self.label, "spec": self.spec, "method": self.method,
                "method_kwargs": dict(self.method_kwargs), "threads": dict(self.threads)}


def _label(method: str, kwargs: dict) -> str:
    """The method as users type it (drafter/registry.py), with the last part of the value of
    its positional option (a head's or a draft model's path) when it has one, then its other
    keys that are set, in the schema's order (``eagle:topk=4+nodes=12``: an EAGLE-2 tree is
    told apart from the chain ``eagle`` whichever is listed first)."""
    # the registry imports the built-in methods (torch) on first use: not at --help
    from specmesh.drafter.registry import get_method, spelling

    kind = spelling(method)
    schema = get_method(method).options
    positional = schema.positional
    path = kwargs.get(positional.kwarg) if positional is not None else None
    parts = [str(PurePath(str(path)).name or path)] if path else []
    parts += [f"{o.key}={kwargs[o.kwarg]}" for o in schema.options
              if not o.positional and o.kwarg in kwargs]
    return f"{kind}:{'+'.join(parts)}" if parts else kind


def parse_drafters(text: str, model: str | None = None) -> list[BenchDrafter]:
    """``"ngram,eagle"`` -> one :class:`BenchDrafter` per form, in order (``auto`` resolved for
    target ``model``). Two forms that name the same method and arguments are refused; two
    different heads whose directory names agree are labelled by their forms as typed.

    Raises:
        SystemExit: an empty list, an unknown form (naming it and the forms accepted), or a
            method listed twice.
    """
    out: list[BenchDrafter] = []
    for part in (text or "").split(","):
        spec = part.strip()
        if not spec:
            continue
        form, _, plan = spec.partition("@")
        try:
            method, kwargs = parse_drafter(form, model)
            threads = parse_thread_plan(plan.replace("+", ",")) if plan else {}
        except SystemExit as e:
            raise SystemExit(f"--drafters: {e}") from None
        for d in out:
            if (d.method, d.method_kwargs, d.threads) == (method, kwargs, threads):
                raise SystemExit(f"--drafters: {spec!r} is the same method as {d.spec!r} "
                                 f"({d.label}); list each method once")
        suffix = "@" + "+".join(f"{r}={n}" for r, n in threads.items()) if threads else ""
        label = _label(method, kwargs) + suffix
        if any(d.label == label for d in out):
            label = form + suffix
        out.append(BenchDrafter(label, spec, method, kwargs, threads))
    if not out:
        raise SystemExit("--drafters: no draft method given (e.g. ngram,eagle)")
    return out


def cluster_drafter(cfg: ClusterConfig) -> BenchDrafter:
    """The method ``cfg`` already runs (the bench's default: the cluster's ``--drafter``)."""
    kwargs = dict(cfg.drafter.method_kwargs)
    return BenchDrafter(_label(cfg.drafter.method, kwargs), cfg.drafter.method,
                        cfg.drafter.method, kwargs)


def namespace_for(d: BenchDrafter, index: int) -> str:
    """A Ray namespace of its own for the served cluster of the ``index``-th method."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", d.label).strip("-") or "method"
    return f"{DEFAULT_NAMESPACE}-bench-{index}-{slug}"


def with_drafter(cfg: ClusterConfig, d: BenchDrafter, namespace: str | None = None,
                 ) -> ClusterConfig:
    """``cfg`` running method ``d`` on verifier and drafter (and in ``namespace`` when
    given), under ``d``'s thread plan over ``cfg``'s (``cfg``'s default plan becomes ``d``'s
    method's default: a model drafter leaves the verifier one core fewer); everything else
    as it is."""
    threads = cfg.threads
    if threads == default_threads(model_drafter=is_model_drafter(cfg.drafter.method)):
        # the default plan, not one the user set: each method gets its own default
        threads = default_threads(model_drafter=is_model_drafter(d.method))
    out = replace(cfg, verifier=replace(cfg.verifier, draft_method=d.method),
                  drafter=replace(cfg.drafter, method=d.method,
                                  method_kwargs=dict(d.method_kwargs)),
                  threads={**threads, **d.threads})
    return replace(out, namespace=namespace) if namespace else out


@dataclass
class BenchOptions:
    """What one bench run does. ``concurrency``: the levels (clients / batch size);
    ``max_tokens``: completion tokens per request; ``num_prompts``: the first N prompts (of
    ``prompts_file`` when given: a JSONL file, or ``workloads`` for the bundled workload set;
    else the bundled demo prompts); ``profile``: print the verifier step profiles and measure
    the forward-cost ratio; ``*_path``: outputs (None: not written); ``drafters``: the draft
    methods compared (None: the cluster's own ``--drafter``); ``predictions``: send the
    prompts' ``prediction`` on the served speculative systems' requests."""

    concurrency: list[int] = field(default_factory=lambda: [1])
    repeats: int = 3
    max_tokens: int = 64
    num_prompts: int | None = None
    prompts_file: str | None = None
    profile: bool = False
    json_path: str | None = None
    markdown_path: str | None = None
    plot_path: str | None = None
    progress: bool = True
    drafters: list[BenchDrafter] | None = None
    #: the baselines compared (of report.BASELINES; empty: specmesh only)
    baselines: tuple[str, ...] = ("hf",)
    #: the llama-server binary (None: $PATH, then the build script's location)
    llama_server: str | None = None
    llama_spec_type: str = DEFAULT_SPEC_TYPE
    #: further llama-server options, appended to both servers' command lines
    llama_server_args: tuple[str, ...] = ()
    #: one speculative llama-server for every pass (its n-gram state kept across passes)
    #: instead of a fresh one per pass
    llama_keep_spec_state: bool = False
    #: the prompts' ``prediction`` (OpenAI's Predicted Outputs) sent to the served systems
    predictions: bool = True
    #: the adaptive-speculation sweep (``--kappas`` / ``--policy``; None / empty: the plain
    #: bench): the fixed kappas served under ``--speculative-policy fixed`` (0: plain decode)
    #: and the adaptive policies, each a served pass interleaved with the others
    kappas: list[int] | None = None
    policies: tuple[str, ...] = ()

    @property
    def sweep(self) -> bool:
        """Whether this run is the adaptive-speculation sweep."""
        return self.kappas is not None or bool(self.policies)


#: the adaptive policies ``--policy`` may list (``fixed`` is what ``--kappas`` runs)
SWEEP_POLICIES = ("schedule", "goodput", "confidence")


def parse_kappas(text: str) -> list[int]:
    """``"0,1,3,5"`` -> ``[0, 1, 3, 5]`` (order kept, duplicates dropped): the fixed kappas of
    the sweep; 0 (plain decode, the output reference) is added first when missing.

    Raises:
        SystemExit: an empty list, a non-integer or a negative kappa.
    """
    out: list[int] = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        try:
            k = int(part)
        except ValueError:
            raise SystemExit(f"--kappas: {part!r} is not an integer (e.g. 0,1,3,5)") from None
        if k < 0:
            raise SystemExit(f"--kappas: kappa must be >= 0, got {k}")
        if k not in out:
            out.append(k)
    if not out:
        raise SystemExit("--kappas: no kappa given (e.g. 0,1,3,5)")
    return out if 0 in out else [0, *out]


def parse_policies(text: str) -> tuple[str, ...]:
    """``"schedule,goodput"`` -> ``("schedule", "goodput")`` (order kept, duplicates
    dropped): the adaptive policies of the sweep.

    Raises:
        SystemExit: an empty list or a policy not in :data:`SWEEP_POLICIES` (``fixed`` is
            named: it is what ``--kappas`` runs).
    """
    out: list[str] = []
    for name in (p.strip() for p in (text or "").split(",")):
        if not name:
            continue
        if name not in SWEEP_POLICIES:
            hint = " (fixed kappas are --kappas)" if name == "fixed" else ""
            raise SystemExit(f"--policy: unknown policy {name!r}{hint}; use a comma list of "
                             f"{', '.join(SWEEP_POLICIES)}")
        if name not in out:
            out.append(name)
    if not out:
        raise SystemExit(f"--policy: no policy given (e.g. {','.join(SWEEP_POLICIES)})")
    return tuple(out)


def parse_baselines(text: str) -> tuple[str, ...]:
    """``"hf,llama-server"`` -> ``("hf", "llama-server")`` (order kept, duplicates dropped);
    ``"none"`` -> ``()``.

    Raises:
        SystemExit: an empty list, an unknown name (naming the accepted ones), or ``none``
            with others.
    """
    names = [p.strip() for p in (text or "").split(",") if p.strip()]
    if names == ["none"]:
        return ()
    out: list[str] = []
    for n in names:
        if n == "none":
            raise SystemExit("--baselines: 'none' cannot be combined with other baselines")
        if n not in BASELINES:
            raise SystemExit(f"--baselines: unknown baseline {n!r} (use a comma list of "
                             f"{', '.join(BASELINES)}, or none)")
        if n not in out:
            out.append(n)
    if not out:
        raise SystemExit("--baselines: no baseline given (e.g. hf,llama-server, or none)")
    return tuple(out)


def add_bench_options(p: argparse.ArgumentParser) -> None:
    """Options of ``specmesh bench`` (besides the cluster's)."""
    p.add_argument("--concurrency", default="1",
                   help="comma list of concurrency levels: concurrent clients through the "
                        "gateway, batch size of HF generate and of the in-process run (e.g. "
                        "1,4,16)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (median taken)")
    p.add_argument("--max-tokens", type=int, default=64, help="completion tokens per request")
    p.add_argument("--num-prompts", type=int, default=None, help="the first N prompts only")
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl|workloads",
                   help='your prompts, one JSON object a line: {"messages": [...]} or '
                        '{"prompt": "..."}, optional "name", "category" and "prediction"; '
                        'or "workloads", the bundled prompts by workload (chat, code-edit '
                        "with predictions, extraction, multi-turn; tables split by "
                        "category); a file named workloads is ./workloads (default: the "
                        "bundled demo prompts)")
    p.add_argument("--predictions", choices=("on", "off"), default="on",
                   help="send each prompt's \"prediction\" as OpenAI's Predicted Outputs "
                        "(prediction: {type: content}) on the served kappa>0 requests and "
                        "report the accepted / rejected prediction tokens; in-process, HF "
                        "and llama-server run without it (default: on; off for a server "
                        "that refuses them)")
    p.add_argument("--profile", action="store_true",
                   help="print the verifier step profiles and the measured forward-cost ratio")
    p.add_argument("--json", default=None, metavar="PATH", help="write the whole summary here")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help="write the tables (one per concurrency level) here")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="plot tokens/s vs concurrency and acceptance per draft position")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--kappas", default=None, metavar="LIST",
                   help="the adaptive-speculation sweep: comma list of fixed kappas (e.g. "
                        "0,1,3,5; 0 added when missing), each a served pass under "
                        "--speculative-policy fixed, interleaved with the --policy passes; "
                        "served systems only (docs/benchmarks.md, 'Adaptive speculation "
                        "sweep')")
    p.add_argument("--policy", default=None, metavar="LIST",
                   help=f"the sweep's adaptive policies, a comma list of "
                        f"{', '.join(SWEEP_POLICIES)}: each its own served cluster (kappa: "
                        f"the largest of --kappas), its chosen kappa sampled over time, its "
                        f"tokens/s compared with the best fixed kappa per concurrency")
    p.add_argument("--drafters", default=None, metavar="LIST",
                   help="comma list of draft methods to compare, each a --drafter form (e.g. "
                        "ngram,eagle): served and in-process kappa=K systems per method, each "
                        "method on its own cluster (default: just --drafter)")
    p.add_argument("--baselines", default="hf", metavar="LIST",
                   help="comma list of the systems specmesh is compared with: hf (Hugging "
                        "Face generate, and prompt lookup at C=1), llama-server (llama.cpp's "
                        "server on the same GGUF and threads, plain and with its n-gram "
                        "speculation; skipped with a note when not found), or none")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="the llama-server binary (default: llama-server on $PATH, else where "
                        "benchmarks/build_llama_server.sh puts it)")
    p.add_argument("--llama-spec-type", default=DEFAULT_SPEC_TYPE,
                   choices=list(NGRAM_SPEC_TYPES),
                   help=f"llama-server's speculation type, drafts capped at kappa (default "
                        f"{DEFAULT_SPEC_TYPE}: the fastest on the bundled prompts, "
                        f"docs/benchmarks.md)")
    p.add_argument("--llama-keep-spec-state", action="store_true",
                   help="run every pass of llama-server's speculation on one server: its "
                        "n-gram state (ngram-mod, ngram-cache) then remembers the outputs of "
                        "earlier passes of the same prompts (default: a fresh server per "
                        "pass)")
    p.add_argument("--llama-server-args", default="", metavar="ARGS",
                   help="further llama-server options for both servers, one shell-quoted "
                        "string (e.g. \"--spec-ngram-mod-n-match 8\")")


def bench_options(args: argparse.Namespace) -> BenchOptions:
    """The :class:`BenchOptions` the bench options in ``args`` describe.

    Raises:
        SystemExit: a malformed ``--concurrency``, ``--drafters``, ``--baselines`` or
            ``--llama-server-args``, or a ``--repeats`` below 1.
    """
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    drafters = parse_drafters(args.drafters, args.model) if args.drafters else None
    try:
        llama_args = tuple(shlex.split(args.llama_server_args or ""))
    except ValueError as e:
        raise SystemExit(f"--llama-server-args: {e}") from None
    return BenchOptions(concurrency=parse_concurrency(args.concurrency), repeats=args.repeats,
                        max_tokens=args.max_tokens, num_prompts=args.num_prompts,
                        prompts_file=args.prompts, profile=args.profile, json_path=args.json,
                        markdown_path=args.markdown, plot_path=args.plot,
                        progress=not args.no_progress, drafters=drafters,
                        baselines=parse_baselines(args.baselines),
                        llama_server=args.llama_server, llama_spec_type=args.llama_spec_type,
                        llama_server_args=llama_args,
                        llama_keep_spec_state=args.llama_keep_spec_state,
                        predictions=args.predictions == "on", **sweep_options(args))


def sweep_options(args: argparse.Namespace) -> dict:
    """The :class:`BenchOptions` fields of ``--kappas`` / ``--policy`` (``{}``: neither). A
    policy without ``--kappas`` is compared with kappa 0 and the cluster's kappa.

    Raises:
        SystemExit: a malformed list, or a sweep whose largest kappa is 0 with a policy.
    """
    kappas_text = getattr(args, "kappas", None)
    policy_text = getattr(args, "policy", None)
    if kappas_text is None and policy_text is None:
        return {}
    policies = parse_policies(policy_text) if policy_text is not None else ()
    kappas = parse_kappas(kappas_text) if kappas_text is not None else \
        parse_kappas(str(args.num_speculative_tokens))
    if policies and max(kappas) == 0:
        raise SystemExit("--policy: the policies adapt kappa within the largest of --kappas "
                         "(or --num-speculative-tokens), which is 0")
    return {"kappas": kappas, "policies": policies}
