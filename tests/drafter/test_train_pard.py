"""`specmesh train-drafter --method pard` on the tiny model: a few steps write a checkpoint of
the layers, norm and mask vector only, naming its target, block and a mask id the data never
holds; the acceptance it reports per position is what the proposer loaded from disk by
``--drafter pard:PATH`` measures; a checkpoint is refused against another target."""

import json

import pytest
import torch

from specmesh.cluster.cli import build_parser
from specmesh.drafter.eagle.checkpoint import HeadMismatch
from specmesh.drafter.pard_files import WEIGHTS, read_pard_config
from specmesh.drafter.pard_training import acceptance, choose_mask_token
from specmesh.drafter.proposer import DraftTarget
from specmesh.drafter.registry import create_proposer
from specmesh.drafter.training.eagle import train_drafter

TOPICS = ["rivers", "python lists", "the moon", "tea", "prime numbers", "bicycles", "sorting",
          "volcanoes"]


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train-pard")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"name": f"p{i}", "prompt": f"Tell me about {t}."})
                               + "\n" for i, t in enumerate(TOPICS)))
    out = tmp / "pard"
    args = build_parser().parse_args([
        "train-drafter", "--method", "pard", "--model", tiny_model_dir,
        "--prompts", str(prompts), "--heldout-fraction", "0.3", "--max-new-tokens", "12",
        "--gen-batch-size", "8", "--num-layers", "1", "--block", "3", "--epochs", "2",
        "--batch-size", "4", "--lr", "3e-3", "--save-dtype", "bfloat16",
        "--out", str(out), "--data", str(tmp / "data.pt")])
    return out, train_drafter(args), args


def test_checkpoint_holds_layers_norm_and_mask_vector_only(trained):
    from safetensors.torch import load_file  # safetensors: as the loader reads it

    out, evaluation, args = trained
    meta = read_pard_config(out)
    assert meta["block"] == 3 and meta["num_layers"] == 1 and meta["layers_from_target"] == [0]
    assert meta["training"]["evaluation"] == evaluation
    assert meta["training"]["command"].startswith("specmesh train-drafter")
    tensors = load_file(str(out / WEIGHTS))
    assert "mask_embedding" in tensors and "model.norm.weight" in tensors
    assert all(k.startswith("model.layers.0.") for k in tensors
               if k not in ("mask_embedding", "model.norm.weight"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    samples = torch.load(args.data, weights_only=False)["samples"]
    assert all(meta["mask_token_id"] not in s.token_ids for ss in samples.values() for s in ss)


def test_reported_acceptance_is_the_loaded_proposers(trained, tiny_model_dir):
    out, evaluation, args = trained
    acc = evaluation["heldout"]["acceptance_per_position"]
    assert len(acc) == 3 and acc == sorted(acc, reverse=True) and all(0 <= a <= 1 for a in acc)
    proposer = create_proposer("pard", {"model": str(out)}, DraftTarget(model=tiny_model_dir))
    held = torch.load(args.data, weights_only=False)["samples"]["heldout"]
    assert acceptance(proposer, held, 3, batch_size=2) == pytest.approx(acc)


def test_a_checkpoint_for_another_target_is_refused(trained, tmp_path):
    out, _, _ = trained
    meta = json.loads((out / "config.json").read_text())
    meta["target"]["fingerprint"] = [1.0, 2.0]
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(meta))
    (other / WEIGHTS).write_bytes((out / WEIGHTS).read_bytes())
    with pytest.raises(HeadMismatch):
        create_proposer("pard", {"model": str(other)}, DraftTarget(model=trained[2].model))


def test_mask_token_is_an_unused_special_id(smollm2_tokenizer):
    class S:
        token_ids = [0, 1, 2, 16, 500]

    assert choose_mask_token(smollm2_tokenizer, [S()], 49152) == 15
    S.token_ids = list(range(17))
    assert choose_mask_token(None, [S()], 20) == 19
