"""Train the two small LoRA adapters of SmolLM2-135M-Instruct that the tests, the demo and the
bench serve (engine/lora.py), on this machine's CPU in a few minutes each.

Why these two: each changes the model's output substantially (the issue asks to show that an
adapter that changes the output costs acceptance, since drafters draft from the base), each is
easy to see in a reply, and each is learnt from the prompts alone, without generating answers
first (generating them with transformers on a shared 2-core machine took about a minute per
answer):

- ``caps``: echoes the user's message back in ALL CAPS;
- ``json``: answers with one JSON object, ``{"request": "<the user's message>"}``.

The prompts are the short single-turn chat prompts of ``data/drafter_train.jsonl``; the loss
is on the answer tokens only. PEFT's ``LoraConfig`` (rank 8, alpha 16, q_proj and v_proj of
every layer), AdamW, float32 on the CPU. The adapter is saved in the PEFT format
(``adapter_config.json`` + ``adapter_model.safetensors``), its weights rounded to float16 to keep
the shipped files small (both the engine and PEFT read them back as float32).

Run: ``python -m specmesh.engine.lora_training --style caps --out engine/lora_adapters/
smollm2-caps`` (see :func:`main`); the shipped adapters are in ``engine/lora_adapters/``
(:func:`shipped_adapter`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specmesh.engine.loader import load_tokenizer, model_files

#: The adapters shipped with the package, by style.
ADAPTERS_DIR = Path(__file__).with_name("lora_adapters")
STYLES = ("caps", "json")
_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "drafter_train.jsonl"


def shipped_adapter(style: str) -> Path:
    """The directory of the shipped SmolLM2 adapter ``style`` (``caps`` or ``json``).

    Raises:
        ValueError: an unknown style. FileNotFoundError: not shipped in this checkout.
    """
    if style not in STYLES:
        raise ValueError(f"unknown adapter style {style!r}, one of {STYLES}")
    path = ADAPTERS_DIR / f"smollm2-{style}"
    if not (path / "adapter_config.json").is_file():
        raise FileNotFoundError(f"no shipped adapter at {path}; train it with "
                                f"python -m specmesh.engine.lora_training --style {style}")
    return path


def styled(style: str, prompt: str) -> str:
    """The training target of ``style`` for the user message ``prompt``."""
    if style == "caps":
        return prompt.upper()
    return json.dumps({"request": prompt})


def _prompts(count: int, max_chars: int = 80) -> list[list[dict]]:
    """The first ``count`` single-turn chat prompts (message lists) of the training file of
    at most ``max_chars`` characters (short sequences: cheap steps)."""
    out = []
    for line in _PROMPTS.read_text().splitlines():
        row = json.loads(line)
        msgs = row["messages"]
        if len(msgs) == 1 and row.get("category") != "code" \
                and len(msgs[0]["content"]) <= max_chars:
            out.append(msgs)
    return out[:count]


def _example(tok, messages: list[dict], target: str) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """(input ids [L], labels [L]: -100 on the prompt) of one chat example."""
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    prompt_ids = list(prompt["input_ids"])
    answer_ids = tok(target + "<|im_end|>", add_special_tokens=False)["input_ids"]
    ids = torch.tensor(prompt_ids + answer_ids)
    labels = ids.clone()
    labels[: len(prompt_ids)] = -100
    return ids, labels


def train(style: str, out: Path, examples: int = 32, epochs: int = 3, lr: float = 3e-3,
          seed: int = 0, log=print) -> Path:  # noqa: ANN001
    """Train adapter ``style`` and save it to ``out``; returns ``out``. Minutes on 2 cores."""
    # transformers and peft: heavy, only this training job needs them
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    tok = load_tokenizer(None)
    model = AutoModelForCausalLM.from_pretrained(model_files(None), torch_dtype=torch.float32)
    t0 = time.perf_counter()
    prompts = _prompts(examples)
    data = [_example(tok, p, styled(style, p[0]["content"])) for p in prompts]
    log(f"{len(data)} examples in {time.perf_counter() - t0:.0f} s")
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                     task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, cfg)
    peft_model.train()
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        total = 0.0
        for i in torch.randperm(len(data), generator=gen).tolist():
            ids, labels = data[i]
            loss = peft_model(input_ids=ids[None], labels=labels[None]).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            total += float(loss)
            log(f"step: loss {float(loss):.3f} ({time.perf_counter() - t0:.0f} s)")
        log(f"epoch {epoch}: loss {total / len(data):.3f} ({time.perf_counter() - t0:.0f} s)")
    out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(out))
    weights = out / "adapter_model.safetensors"
    save_file({k: v.half().contiguous() for k, v in load_file(str(weights)).items()},
              str(weights), metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m specmesh.engine.lora_training --style caps|json [--out DIR]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--style", choices=STYLES, required=True)
    parser.add_argument("--out", type=Path, default=None,
                        help="adapter directory (default: the shipped one)")
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    out = args.out or ADAPTERS_DIR / f"smollm2-{args.style}"
    train(args.style, out, examples=args.examples, epochs=args.epochs)
    print(f"saved {out}")


if __name__ == "__main__":
    main()


__all__ = ["ADAPTERS_DIR", "STYLES", "main", "shipped_adapter", "styled", "train"]
