"""``specmesh train-drafter``: self-distil a drafter for a target on this machine.

Steps: load the target through engine/; split the instruction prompts by prompt into train
and held-out; generate the target's greedy outputs with their hidden states in continuous
batches (drafter/eagle/data.py; ``--samples-per-prompt`` adds sampled continuations of each
training prompt, labelled with the target's greedy tokens; cached in ``--data`` so training
can be re-run, by either method); then the trainer ``--method`` declares (drafter/registry.py):

- ``eagle``: pick the draft vocabulary; train an EAGLE head (drafter/eagle/train.py, progress
  bar with loss and tokens/s); evaluate acceptance per draft position on the held-out prompts
  and on every ``--eval-prompts`` file; write the checkpoint (safetensors + config.json naming
  the target, the command, the numbers). ``--num-steps N`` trains a multi-layer head
  (drafter/eagle/steps.py): N modules, module i drafting depth i on the states module i - 1
  predicts, each started from ``--init-head`` (default: the head shipped for the target),
  module 0 frozen unless ``--train-first-step``.
- ``draft-model``: a small Llama with the target's shape and vocabulary
  (drafter/training/draft_model.py, drafter/draft_model_training.py), written as a Hugging Face
  dir for ``--drafter draft-model:PATH``.
- ``pard``: the same small Llama trained to fill a block of mask tokens (drafter/training/pard.py,
  drafter/pard_training.py), for ``--drafter pard:PATH``.
- ``dflash``: a block drafter over the target's hidden states (drafter/training/dflash.py,
  drafter/dflash_training.py), for ``--drafter dflash:PATH``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from specmesh.data.prompts import load_prompts_file
from specmesh.drafter.eagle.checkpoint import (load_head, round_weights, save_head,
                                               target_identity)
from specmesh.drafter.eagle.config import AFTER_LAST_STEP
from specmesh.drafter.eagle.data import chat_token_ids, generate_samples, split_by_prompt
from specmesh.drafter.eagle.head import EagleHead, EagleHeadConfig
from specmesh.drafter.eagle.train import (
    acceptance,
    acceptance_report,
    draft_vocabulary,
    train,
    windows,
)
from specmesh.drafter.registry import get_method, trainable_methods
from specmesh.drafter.training.draft_model import train_draft_model
from specmesh.drafter.training.dspark import add_dspark_options
from specmesh.drafter.training.record import training_record
from specmesh.engine.hidden_layers import check_hidden_layers, is_hidden_seed

#: where shipped heads live (drafter/proposers/eagle.py reads them): <dir>/<target, lower case>/
SHIPPED_HEADS = Path(__file__).resolve().parent.parent / "heads"
#: the bundled prompt sets (data/)
PROMPTS_DIR = Path(next(iter(importlib.util.find_spec("specmesh.data").submodule_search_locations)))
DEFAULT_TRAIN_PROMPTS = (PROMPTS_DIR / "drafter_train.jsonl", PROMPTS_DIR / "drafter_train_extra.jsonl",
                         PROMPTS_DIR / "drafter_train_more.jsonl",
                         PROMPTS_DIR / "drafter_train_code.jsonl")


def add_train_drafter_options(p: argparse.ArgumentParser) -> None:
    methods = trainable_methods()  # the methods that declare a trainer (drafter/registry.py)
    p.add_argument("--method", choices=methods, default="eagle",
                   help="the drafting method to train: " + "; ".join(
                       f"{m}: {get_method(m).summary}" for m in methods))
    p.add_argument("--model", default=None, help="target: smollm2 (default), a .gguf or a HF dir")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"],
                   help="dtype the target generates the data in")
    p.add_argument("--prompts", nargs="+", default=[str(x) for x in DEFAULT_TRAIN_PROMPTS],
                   help="JSONL of instruction prompts (default: the bundled training set)")
    p.add_argument("--heldout-fraction", type=float, default=0.1)
    p.add_argument("--eval-prompts", action="append", default=[],
                   help="extra held-out JSONL prompt sets to evaluate on (repeatable)")
    p.add_argument("--max-prompts", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--gen-batch-size", type=int, default=64)
    p.add_argument("--samples-per-prompt", type=int, default=1,
                   help="continuations per training prompt: the greedy one, then N-1 sampled at "
                        "--sample-temperature, each labelled with the target's greedy token at "
                        "every position (held-out prompts: greedy only)")
    p.add_argument("--sample-temperature", type=float, default=0.8,
                   help="temperature of the sampled continuations")
    p.add_argument("--data", default=None,
                   help="cache file of generated samples (reused when it matches)")
    p.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="eagle: 0 = the whole vocabulary")
    p.add_argument("--num-layers", type=int, default=None,
                   help="layers of the head (eagle, default 1) or the draft model (default 2)")
    p.add_argument("--feature-layers", default="",
                   help="eagle, dflash: target decoder layers whose outputs the head fuses "
                        "(EAGLE-3, e.g. 2,15,26; 'auto' = 2, L/2, L-4); default: the final-norm "
                        "state (EAGLE-1)")
    p.add_argument("--num-steps", type=int, default=1,
                   help="eagle: distinct modules, module i drafting depth i (multi-layer "
                        "EAGLE); above 1 every module starts from --init-head")
    p.add_argument("--after-last-step", choices=AFTER_LAST_STEP, default="repeat",
                   help="eagle --num-steps: past the last module repeat it recurrently, or "
                        "stop the chain")
    p.add_argument("--init-head", default=None,
                   help="eagle --num-steps > 1: the head whose module 0 every module starts "
                        "from (default: the head shipped for the target; 'none': random)")
    p.add_argument("--train-first-step", action="store_true",
                   help="eagle --num-steps > 1 from --init-head: train module 0 too (default: "
                        "frozen, as the head it came from)")
    p.add_argument("--depth", type=int, default=3,
                   help="eagle: unrolled passes (training-time test)")
    p.add_argument("--init-layers", choices=["first", "spread", "random"], default="first",
                   help="draft-model: start the layers from the target's first ones (default), "
                        "from its layers evenly spaced from the first to the last, or random")
    p.add_argument("--kl-weight", type=float, default=0.5,
                   help="draft-model: loss = (1-w) CE(target greedy token) + w KL(target||draft)")
    p.add_argument("--train-embeddings", action="store_true",
                   help="draft-model: also train the embedding and LM head (default: the "
                        "target's, frozen)")
    p.add_argument("--block", type=int, default=None,
                   help="pard, dflash: drafts per forward the draft is trained for (K, default 4)")
    p.add_argument("--anchor-input", choices=["on", "off"], default="on",
                   help="dflash: every block row also reads the fused target row before the "
                        "block and the block's first token (drafter/dflash_model.py, 'Anchor "
                        "input'); off: the context reaches the block through attention only")
    p.add_argument("--gamma", type=float, default=None,
                   help="dflash: the block loss weight of mask row j is exp(-(j-1)/gamma) "
                        "(default 0.5: a one-layer draft's first positions first; DFlash "
                        "uses 4 for deeper drafts)")
    p.add_argument("--max-run-ahead", type=int, default=0,
                   help="dflash: most drafted tokens past the last committed row a block is "
                        "trained for and served with (default 0: blocks only from a "
                        "committed context, which trains position 1 best; up to --block)")
    p.add_argument("--cod-ratio", type=float, default=0.7,
                   help="pard: COD keeps mask copy i of an anchor with probability "
                        "max(ratio^(i-1), 0.2)")
    p.add_argument("--train-minutes", type=float, default=None,
                   help="pard, eagle, dflash, frozen-kv-mtp: stop training after this many "
                        "minutes (a bounded run)")
    p.add_argument("--target-layer", type=int, default=None,
                   help="frozen-kv-mtp: the target layer whose K/V the assistant reads "
                        "(default: the last)")
    p.add_argument("--epochs", type=float, default=4.0)
    p.add_argument("--batch-size", type=int, default=16,
                   help="windows (eagle) or whole samples (draft-model) per step")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--autocast", choices=["none", "bfloat16"], default="none",
                   help="eagle, pard: run the training products in bfloat16 under torch.autocast "
                        "(float32 weights and optimizer; ~2.3x the entries/s on a CPU with "
                        "AVX-512 bf16)")
    p.add_argument("--soft-weight", type=float, default=0.0,
                   help="weight of the target-distribution (soft) cross-entropy vs the argmax")
    p.add_argument("--reg-weight", type=float, default=None,
                   help="weight of the smooth-L1 regression onto the target's next state "
                        "(default 0.5; 0 and not allowed with --feature-layers)")
    p.add_argument("--eval-depth", type=int, default=5)
    p.add_argument("--num-heads", type=int, default=4,
                   help="medusa: heads, head i drafting the token i+1 after the next one")
    p.add_argument("--tree-nodes", type=int, default=8,
                   help="medusa: nodes of the static draft tree chosen from held-out accuracy "
                        "(the verifier verifies at most 2 x kappa of them per step)")
    p.add_argument("--batch-rows", type=int, default=256,
                   help="medusa: target states (positions) per training step")
    p.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="eagle, pard: dtype of the stored weights (bfloat16 halves the file; "
                        "the evaluation runs on the rounded weights)")
    add_dspark_options(p)  # --markov, --markov-rank, ... (drafter/training/dspark.py)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--out", required=True, help="checkpoint directory to write")


def _load_prompts(paths: str | list[str], limit: int | None = None) -> list[dict]:
    prompts = [p for path in ([paths] if isinstance(paths, str) else paths)
               for p in load_prompts_file(path)]
    return prompts[:limit] if limit else prompts


def feature_layers(spec: str, num_layers: int) -> tuple[int, ...]:
    """``--feature-layers``: "" -> () (the final-norm state), "auto" -> (2, L/2, L-4) of a
    target with L layers (fewer, distinct, for a shallow model), else a comma list.

    Raises:
        SystemExit: layers that are not distinct indices of the target.
    """
    if not spec:
        return ()
    if spec == "auto":
        wanted = (2, num_layers // 2, num_layers - 4)
        layers = tuple(sorted({min(max(i, 0), num_layers - 1) for i in wanted}))
    else:
        try:
            layers = tuple(int(x) for x in spec.split(","))
        except ValueError:
            raise SystemExit(f"--feature-layers {spec!r}: a comma list of layer indices") from None
    try:
        check_hidden_layers(layers, num_layers)
    except ValueError as err:
        raise SystemExit(f"--feature-layers: {err}") from None
    return layers


def _data_key(args, model_name: str, names: list[str],  # noqa: ANN001
              layers: tuple[int, ...] | None = None) -> str:
    """The ``--data`` cache's key: what decides the outputs and the rows they carry
    (``layers``: the captured target layers, default ``--feature-layers``)."""
    layers = args.resolved_feature_layers if layers is None else layers
    h = hashlib.sha256(json.dumps([model_name, args.dtype, args.max_new_tokens, names,
                                   list(layers), args.samples_per_prompt,
                                   args.sample_temperature, args.seed]).encode())
    return h.hexdigest()[:16]


#: in place of the feature layers in the key of the outputs alone (``tokens_key``)
ANY_LAYERS = (-1,)


def _generate(lm, prompts: list[dict], args, label: str):  # noqa: ANN001, ANN202
    ids = chat_token_ids(lm.tokenizer, prompts)
    names = [p["name"] for p in prompts]
    temps = [0.0] * len(ids)
    if label == "train" and args.samples_per_prompt > 1:  # sampled extra continuations
        extra = args.samples_per_prompt - 1
        ids += [x for x in ids for _ in range(extra)]
        names += [f"{n}#{k}" for n in names for k in range(1, extra + 1)]
        temps += [args.sample_temperature] * (len(ids) - len(temps))
    bar = tqdm(desc=f"generate {label}", unit="tok")
    t0 = time.perf_counter()
    samples = generate_samples(lm.model, lm.config, ids, names,
                               max_new_tokens=args.max_new_tokens,
                               batch_size=args.gen_batch_size, progress=bar.update,
                               hidden_layers=args.resolved_feature_layers or None,
                               temperatures=temps, seed=args.seed)
    bar.close()
    n = sum(s.num_output_tokens for s in samples)
    print(f"{label}: {len(prompts)} prompts, {len(samples)} continuations, {n} output tokens "
          f"in {time.perf_counter() - t0:.0f} s", flush=True)
    return samples


def _samples(lm, sets: dict[str, list[dict]], args) -> dict:  # noqa: ANN001
    """Generated samples of every prompt set, from the ``--data`` cache when it matches: the
    same key, or for a method whose trainer reads only token ids
    (``Proposer.trainer_reads_features`` False: pard, dspark) the same outputs whatever
    layers the cache captured (``tokens_key``), so one cache feeds every method."""
    names = [p["name"] for ps in sets.values() for p in ps]
    key = _data_key(args, lm.name, names)
    tokens_key = _data_key(args, lm.name, names, ANY_LAYERS)
    tokens_only = not get_method(args.method).trainer_reads_features
    cache = Path(args.data) if args.data else None
    if cache and cache.is_file():
        blob = torch.load(cache, weights_only=False)
        if blob.get("key") == key or (tokens_only and blob.get("tokens_key") == tokens_key):
            print(f"using generated samples from {cache}", flush=True)
            return blob["samples"]
    out = {label: _generate(lm, ps, args, label) for label, ps in sets.items()}
    if cache:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"key": key, "tokens_key": tokens_key, "samples": out}, cache)
    return out


def prepare(args: argparse.Namespace) -> dict:
    """Load the target, split the prompts and generate (or read) the samples: what both
    methods train and evaluate on."""
    from specmesh.engine.loader import load_model  # the engine's model: triton kernels

    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    lm = load_model(args.model, args.dtype)
    args.resolved_feature_layers = feature_layers(args.feature_layers, lm.config.num_layers)
    if args.resolved_feature_layers and not is_hidden_seed(get_method(args.method).seed_state):
        raise SystemExit(f"--feature-layers is for a method that reads the target's hidden "
                         f"states (eagle), not --method {args.method}")
    if args.samples_per_prompt < 1 or args.sample_temperature <= 0:
        raise SystemExit("--samples-per-prompt must be >= 1 and --sample-temperature > 0")
    prompts = _load_prompts(args.prompts, args.max_prompts)
    train_p, held_p = split_by_prompt(prompts, args.heldout_fraction, args.seed)
    sets = {"train": train_p, "heldout": held_p}
    for path in args.eval_prompts:
        extra = _load_prompts(path)
        clash = {p["name"] for p in extra} & {p["name"] for p in train_p}
        if clash:
            raise SystemExit(f"--eval-prompts {path} shares prompts with the training set: "
                             f"{sorted(clash)[:3]}")
        sets[Path(path).stem] = extra
    overlap = {p["name"] for p in train_p} & {p["name"] for p in held_p}
    assert not overlap, overlap  # split_by_prompt puts each name on one side
    t_gen = time.perf_counter()
    samples = _samples(lm, {k: v for k, v in sets.items() if v}, args)
    return {"lm": lm, "train_p": train_p, "held_p": held_p, "samples": samples,
            "generate_seconds": time.perf_counter() - t_gen, "t_start": t_start}


def train_drafter(args: argparse.Namespace) -> dict:
    """Run the whole pipeline: the shared steps (:func:`prepare`), then the trainer of
    ``args.method`` (the method's declared trainer, drafter/registry.py); returns the
    evaluation (also written to the checkpoint).

    Raises:
        SystemExit: a method that has no trainer.
    """
    trainer = get_method(args.method).trainer
    if trainer is None:
        raise SystemExit(f"--method {args.method}: the method has no trainer")
    return trainer(prepare(args), args)


def train_eagle_head(prep: dict, args: argparse.Namespace) -> dict:
    """``--method eagle``: train, evaluate and save an EAGLE head on the prepared samples;
    returns the evaluation."""
    lm, samples = prep["lm"], prep["samples"]
    embed = lm.model.model.embed_tokens.weight.detach()
    lm_head = lm.model.lm_head.weight.detach()
    target = target_identity(lm.name, lm.config, embed)
    n_draft = args.draft_vocab_size if args.draft_vocab_size < lm.config.vocab_size else 0
    layers = args.resolved_feature_layers
    num_steps = getattr(args, "num_steps", 1)
    if num_steps < 1:
        raise SystemExit(f"--num-steps {num_steps}: at least 1")
    init = _init_head(args, lm, embed, lm_head, target) if num_steps > 1 else None
    if init is not None:  # the shape, draft vocabulary and seed state of the head it starts from
        if tuple(init.config.feature_layers) != tuple(layers):
            raise SystemExit(f"--init-head reads the target's layers "
                             f"{list(init.config.feature_layers) or 'final state'}; the data "
                             f"is generated for --feature-layers {list(layers) or 'none'}: pass "
                             f"--feature-layers {','.join(map(str, init.config.feature_layers))}")
        cfg = replace(init.config, num_steps=num_steps, after_last_step=args.after_last_step)
        layers, n_draft = cfg.feature_layers, cfg.draft_vocab_size
    else:
        cfg = EagleHeadConfig.for_target(lm.config, draft_vocab_size=n_draft,
                                         num_layers=args.num_layers or 1, target=target,
                                         feature_layers=layers, num_steps=num_steps,
                                         after_last_step=getattr(args, "after_last_step",
                                                                 "repeat"))
    reg_weight = args.reg_weight if args.reg_weight is not None else (0.0 if layers else 0.5)
    torch.manual_seed(args.seed)
    head = EagleHead(cfg)
    if init is not None:
        ids = init.draft_to_target
        _start_from(head, init, freeze_first=not args.train_first_step)
    else:
        ids = (draft_vocabulary(samples["train"], n_draft, tuple(lm.config.eos_token_ids))
               if n_draft else None)
    head.set_target_weights(embed.float(), lm_head.float(), ids)
    to_draft = torch.full((lm.config.vocab_size,), -1, dtype=torch.long)
    to_draft[head.draft_to_target] = torch.arange(head.draft_to_target.numel())
    train_w = windows(samples["train"], to_draft)
    print(f"head ({cfg.seed_state}): {head.num_trainable_parameters() / 1e6:.2f} M parameters, draft vocabulary "
          f"{head.lm_head.shape[0]}, {sum(len(w.labels) for w in train_w)} training entries",
          flush=True)
    minutes = getattr(args, "train_minutes", None)
    summary = train(head, train_w, epochs=args.epochs, batch_size=args.batch_size,
                    lr=args.lr, depth=max(args.depth, num_steps), seed=args.seed,
                    max_seconds=None if minutes is None else 60 * minutes,
                    soft_weight=args.soft_weight, reg_weight=reg_weight,
                    autocast_dtype=None if args.autocast == "none" else getattr(torch, args.autocast))
    save_dtype = getattr(torch, args.save_dtype)
    round_weights(head, save_dtype)  # evaluate what the checkpoint will hold
    evaluation = {}
    for label, ss in samples.items():
        if label == "train" or not ss:
            continue
        acc = acceptance(head, windows(ss, to_draft), args.eval_depth)
        evaluation[label] = {"prompts": len(ss), "acceptance_per_position": acc,
                             "mean_accepted_per_chain": sum(acc)}
        print(f"{label} ({len(ss)} prompts): {acceptance_report(acc)}", flush=True)
    training = training_record(prep, args, summary, evaluation)
    out = save_head(head, args.out, training, dtype=save_dtype)
    print(f"wrote {out} in {training['total_seconds'] / 60:.1f} min total", flush=True)
    return evaluation


def _init_head(args, lm, embed: torch.Tensor, lm_head: torch.Tensor,  # noqa: ANN001
               target: dict) -> EagleHead | None:
    """The 1-module head a multi-layer head starts from (``--init-head``; default the one
    shipped for the target, drafter/heads/), None for 'none' or when none is shipped.

    Raises:
        SystemExit: ``--init-head`` names a head that is not a 1-module head of this target.
    """
    path = args.init_head
    if path == "none":
        return None
    if path is None:
        shipped = SHIPPED_HEADS / lm.name.lower()
        if not (shipped / "config.json").is_file():
            print(f"no head shipped for {lm.name}: modules start random", flush=True)
            return None
        path = shipped
    try:
        head = load_head(path, embed, lm_head, target)
    except (OSError, ValueError) as err:
        raise SystemExit(f"--init-head {path}: {err}") from None
    if head.config.num_steps != 1:
        raise SystemExit(f"--init-head {path}: a {head.config.num_steps}-module head; "
                         f"start from a 1-module head")
    print(f"modules start from the head at {path}", flush=True)
    return head


def _start_from(head: EagleHead, init: EagleHead, freeze_first: bool) -> None:
    """Every module of ``head`` starts as ``init``'s only one (module 0 with the EAGLE-3
    fusion too); module 0 frozen when ``freeze_first``."""
    state = {k: v for k, v in init.state_dict().items()}
    missing, unexpected = head.load_state_dict(state, strict=False)
    if unexpected or any(not k.startswith("steps.") for k in missing):
        raise SystemExit(f"--init-head does not fit: missing {missing}, unexpected {unexpected}")
    for step in head.steps:
        step.fc.load_state_dict(head.fc.state_dict())
        step.layers.load_state_dict(head.layers.state_dict())
        step.norm.load_state_dict(head.norm.state_dict())
    if freeze_first:
        for p in head.parameters():
            p.requires_grad_(False)
        for step in head.steps:
            step.requires_grad_(True)
