"""The ``specmesh`` command line. ``specmesh env`` says what this machine computes with: CPU
features, the dtype ``--dtype auto`` picks, and each CPU backend on or off with why."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# the bench command's options live with its harness (benchmarks/harness/, a layer above
# cluster/); no other cluster module imports the harness
from specmesh.benchmarks.harness.options import add_bench_options, bench_options  # noqa: E402
from specmesh.cluster.auto import banner  # noqa: E402
from specmesh.cluster.config import ROLES, ClusterConfig  # noqa: E402
from specmesh.cluster.demo import demo  # noqa: E402  (ray-free until it starts the cluster)
from specmesh.cluster.drafter_option import (  # noqa: E402
    add_drafter_options,
    drafter_from_args,
    drafter_help,
)
from specmesh.cluster.loopback import use_loopback  # noqa: E402
from specmesh.cluster.plan_command import (  # noqa: E402
    add_plan_options,
    plan_report,
    render_machine,
    render_plan,
)
from specmesh.cluster.options import (  # noqa: E402
    CLI_DTYPES,
    add_cluster_options,
    add_corpus_option,
    add_cpu_backend_option,
    add_model_options,
    backend_overrides,
    cluster_config,
    default_instance_id,
    drafter_plans,
)
from specmesh.data.prompts import load_prompt_set  # noqa: E402
from specmesh.decode.rules import outputs_exact  # noqa: E402
from specmesh.engine.backend import cpu_backend  # noqa: E402
from specmesh.engine.devices import resolve_device, resolve_dtype  # noqa: E402
from specmesh.engine.environment import environment_report, render_report  # noqa: E402
from specmesh.protocol.messages import SamplingParams  # noqa: E402


def decided_config(args: argparse.Namespace, **overrides):
    """The ClusterConfig of a driver that starts a whole cluster (serve, demo, bench): ``auto``
    resolved once here, measured where it measures (cluster/auto_resolve.py), the decision
    printed with its reasons, then handed to every role in the config."""
    from specmesh.cluster.auto_resolve import resolve_settings  # torch: auto's measurements

    settings = resolve_settings(args, measure=True, plans=drafter_plans(args))
    for line in banner(settings):
        print(line, flush=True)
    return cluster_config(args, settings, **overrides)


def cmd_generate(args: argparse.Namespace) -> int:
    # torch, and the engine's model (triton kernels) with the in-process cluster and the host
    import torch

    from specmesh.cluster.hosts.drafter import build_proposer
    from specmesh.cluster.inprocess import InProcessCluster
    from specmesh.engine.loader import load_model

    method, method_kwargs = drafter_from_args(args)  # fails before loading
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    args.dtype = resolve_dtype(args.dtype, args.device)
    overrides = backend_overrides(args)
    loaded = load_model(args.model, dtype=args.dtype, device=resolve_device(args.device),
                        backend=cpu_backend(overrides))
    tok = loaded.tokenizer
    load_s = time.perf_counter() - t0
    if args.raw:
        prompt_ids = list(tok(args.prompt)["input_ids"])
    else:
        from specmesh.gateway.tokens import chat_prompt_ids  # the gateway's fastapi, pydantic

        prompt_ids = chat_prompt_ids(tok, [{"role": "user", "content": args.prompt}])
    # the proposer the drafter role would build for this method
    proposer = build_proposer(ClusterConfig.create(
        model=args.model, dtype=args.dtype, device=args.device,
        kv_cache_dtype=args.kv_cache_dtype,
        num_speculative_tokens=args.num_speculative_tokens, draft_method=method,
        drafter_method_kwargs=method_kwargs, backend=overrides))
    cluster = InProcessCluster(loaded.model, loaded.config,
                               num_speculative_tokens=args.num_speculative_tokens,
                               eos_token_ids=loaded.config.eos_token_ids,
                               draft_method=method, proposer=proposer,
                               kv_cache_dtype=args.kv_cache_dtype,
                               goodput_drafts=getattr(args, "goodput_drafts", "on") == "on")
    t1 = time.perf_counter()
    (out,) = cluster.generate([prompt_ids], SamplingParams(max_tokens=args.max_tokens))
    dt = time.perf_counter() - t1
    print(tok.decode(out.token_ids, skip_special_tokens=True))
    n = len(out.token_ids)
    print(f"\n[specmesh] {n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s), finish_reason="
          f"{out.finish_reason}, model load {load_s:.1f} s, dtype {args.dtype}, "
          f"num_speculative_tokens {args.num_speculative_tokens}, drafter {method}"
          + (f" {method_kwargs}" if method_kwargs else ""), file=sys.stderr)
    s = out.spec
    print(f"[specmesh] spec stats: drafted {s.num_draft_tokens}, accepted "
          f"{s.num_accepted_tokens}, verify steps with drafts {s.num_verify_steps}, "
          f"mean accept length {s.mean_accept_len:.2f}", file=sys.stderr)
    return 0 if out.finish_reason is not None and out.finish_reason.is_success else 1


def cmd_serve(args: argparse.Namespace) -> int:
    use_loopback()  # before the first `import ray`: an embedded, 127.0.0.1 Ray
    from specmesh.cluster.launcher import start_cluster  # ray, after use_loopback()

    cfg = decided_config(args)
    handle = start_cluster(cfg)
    print(f"[specmesh] serving {handle.url}/v1 (Ctrl-C to stop)", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    handle.stop()
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    """Join one role to a running cluster (``ray up deploy/...yaml``). The settings ``auto``
    decides are the controller's: the first launch settles them (measuring the dtype unless
    it launches the gateway, which runs no model), every later one follows them, and a launch
    given another value explicitly is refused before its role starts."""
    # ray (joins the running cluster) and auto's measurements (torch)
    import ray

    from specmesh.cluster.actors import NAMESPACE
    from specmesh.cluster.auto_resolve import launch_settings
    from specmesh.cluster.launcher import get_controller, start_role

    ray.init(address=args.address, namespace=NAMESPACE)
    # Detached: the role (and the controller it registers with, created by the first launch)
    # must outlive this command, which exits once the role is up.
    controller = get_controller(lifetime="detached")
    settings = launch_settings(args, lambda p: ray.get(controller.settle.remote(p)),
                               args.role, drafter_plans(args))
    for line in banner(settings):
        print(line, file=sys.stderr, flush=True)
    cfg = cluster_config(args, settings)
    actor = start_role(args.role, args.instance_id or default_instance_id(args.role), cfg,
                       num_gpus=args.num_gpus, lifetime="detached")
    print(json.dumps(ray.get(actor.info.remote())), flush=True)
    if args.role == "gateway":
        print("[specmesh] gateway up", flush=True)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    use_loopback()  # before the first `import ray` (demo imports it to start the cluster)
    demo(decided_config(args, port=0), num_prompts=args.num_prompts, max_tokens=args.max_tokens)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    opts = bench_options(args)  # a bad list or prompts file fails before anything starts
    if opts.prompts_file:
        load_prompt_set(opts.prompts_file)
    use_loopback()  # before the first `import ray`: an embedded, 127.0.0.1 Ray
    # lazy: the bench runner pulls in the gateway's HTTP stack (fastapi, uvicorn, httpx), which
    # no other command needs
    from specmesh.benchmarks.harness.bench import bench

    cfg = decided_config(args, port=0)
    summary = bench(cfg, opts)
    if not outputs_exact(cfg.verifier.verify_rule):  # the ablation harness: outputs differ
        return 0
    return 1 if summary.get("mismatches") else 0  # a method whose output is not exact


def cmd_env(args: argparse.Namespace) -> int:
    from specmesh.cluster.auto_resolve import auto_dtype  # torch: auto's measurements

    try:
        # what serve / demo / bench decide for --dtype auto: a cached measurement of this model
        # on this CPU, else the rule; env itself never measures
        choice = auto_dtype(args.model, args.device, measure=False)
        report = environment_report(device=args.device, dtype=args.dtype,
                                    overrides=backend_overrides(args),
                                    auto=(choice.dtype, choice.reason))
    except ValueError as err:  # an unknown device
        raise SystemExit(f"specmesh env: {err}") from None
    print(json.dumps(report, indent=2) if args.json else render_report(report))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """The chapter's speedup economics for the given figures, or this machine's break-even
    batch per drafter from a bench JSON (cluster/plan_command.py)."""
    if args.from_bench:
        from specmesh.cluster.plan_bench import machine_plan  # (only this command needs it)

        try:
            with open(args.from_bench) as f:
                report = machine_plan(json.load(f))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise SystemExit(f"specmesh plan --from-bench {args.from_bench}: {err}") from None
        print(json.dumps(report, indent=2) if args.json else render_machine(report))
        return 0
    report = plan_report(args)
    print(json.dumps(report, indent=2) if args.json else render_plan(report))
    return 0


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from specmesh.drafter.training.eagle import train_drafter  # torch, the training stack

    train_drafter(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    # the commands that take --drafter list the methods and their keys after their options
    with_methods = {"epilog": drafter_help(),
                    "formatter_class": argparse.RawDescriptionHelpFormatter}
    g = sub.add_parser("generate", help="run prefill, verifier and drafter in one process",
                       **with_methods)
    add_model_options(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--raw", action="store_true", help="no chat template: tokenize the prompt as is")
    add_drafter_options(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="embedded local Ray: prefill, verifier, drafter, gateway",
                       **with_methods)
    add_cluster_options(s)
    add_corpus_option(s)
    s.add_argument("--port", type=int, default=8000)
    s.set_defaults(func=cmd_serve)

    la = sub.add_parser("launch", help="join one role to an existing Ray cluster",
                        **with_methods)
    la.add_argument("role", choices=list(ROLES))
    la.add_argument("--address", default="auto", help="Ray address (default: auto)")
    la.add_argument("--instance-id", default=None)
    la.add_argument("--num-gpus", type=float, default=0)
    la.add_argument("--port", type=int, default=8000)
    la.add_argument("--host", default="auto",
                    help="address the role binds and advertises (ZMQ, metrics; HTTP for the "
                         "gateway): auto (default) = the IP of the node Ray runs it on, resolved "
                         "again wherever Ray restarts it; 0.0.0.0 = every interface, advertising "
                         "the node IP; an explicit IP pins the role to the machine that has it")
    add_cluster_options(la)
    add_corpus_option(la)
    la.set_defaults(func=cmd_launch)

    d = sub.add_parser("demo", help="start the cluster and run bundled prompts through HTTP",
                       **with_methods)
    add_cluster_options(d)
    d.add_argument("--num-prompts", type=int, default=None)
    d.add_argument("--max-tokens", type=int, default=96)
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="specmesh served / in-process (k>0 per draft method, k=0) "
                                     "vs HF generate per concurrency level, interleaved "
                                     "repeats", **with_methods)
    add_cluster_options(b)
    add_bench_options(b)
    b.set_defaults(func=cmd_bench)

    e = sub.add_parser("env", help="what this machine computes with: CPU features, the dtype "
                                   "--dtype auto picks, each CPU backend on/off and why")
    e.add_argument("--json", action="store_true", help="the report as JSON")
    e.add_argument("--model", default=None,
                   help="the model whose --dtype auto decision to show (default: SmolLM2)")
    e.add_argument("--device", default="auto",
                   help="the device --dtype auto is resolved for (auto, cpu, cuda, cuda:N)")
    e.add_argument("--dtype", default="auto", choices=("auto",) + CLI_DTYPES,
                   help="the model dtype to show the backends for (auto: what --dtype auto "
                        "picks here)")
    add_cpu_backend_option(e)
    e.set_defaults(func=cmd_env)

    pl = sub.add_parser("plan", help="when speculation pays: speedup, break-even batch and "
                                     "S_inf per drafting mode, or this machine's from a bench")
    add_plan_options(pl)
    pl.set_defaults(func=cmd_plan)

    # torch, the training stack: out of the module's import (the parser imports it to build)
    from specmesh.drafter.training.eagle import add_train_drafter_options

    t = sub.add_parser("train-drafter", help="self-distil a drafter for a target on this "
                                             "machine (EAGLE head or draft model)")
    add_train_drafter_options(t)
    t.set_defaults(func=cmd_train_drafter)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
