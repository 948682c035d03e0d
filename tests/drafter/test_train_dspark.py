"""`specmesh train-drafter --method dspark` on the tiny model: the layout's row structure
(teacher-forced previous tokens, depths, predecessors); a few steps write a checkpoint of a
PARD backbone plus the Markov and confidence heads, naming the head's shape and rank; the
acceptance it reports is the loaded proposer's (``--drafter dspark:PATH``) and matches PARD's
count; a checkpoint can start from a PARD backbone; a rank of 0, or ``markov``/``markov_rank``
keys that are not the checkpoint's, are refused."""

import json

import pytest
import torch

from specmesh.cluster.cli import build_parser
from specmesh.drafter.dspark_files import BACKBONE, HEADS, read_dspark_config
from specmesh.drafter.dspark_training import row_structure
from specmesh.drafter.pard_block import cod_layout
from specmesh.drafter.pard_files import read_pard_config
from specmesh.drafter.pard_training import acceptance
from specmesh.drafter.proposer import DraftTarget
from specmesh.drafter.registry import create_proposer
from specmesh.drafter.training.eagle import train_drafter

TOPICS = ["rivers", "python lists", "the moon", "tea", "prime numbers", "bicycles", "sorting",
          "volcanoes"]


def test_row_structure_teacher_forces_each_block():
    tokens = [10, 11, 12, 13, 14, 15]
    labels = [90, 91, 12, 13, 14, 15]  # prompt 10, 11; output from position 2
    lay = cod_layout(tokens, labels, 1, 3, 99, [1.0, 1.0])
    prev, depth, pred = row_structure(lay, len(tokens), labels)
    n = len(tokens)
    assert prev[:n].tolist() == tokens and depth[:n].tolist() == [0] * n
    assert pred[:n].tolist() == [-1] * n
    # anchors 1, 2 get copies 1, 2 and anchor 3 copy 1 (position a + i, labelled label[a + 1 + i])
    rows = list(zip(lay.position_ids[n:].tolist(), depth[n:].tolist(), prev[n:].tolist(),
                    pred[n:].tolist()))
    assert rows == [(2, 1, 12, 1), (3, 2, 13, n), (3, 1, 13, 2), (4, 2, 14, n + 2),
                    (4, 1, 14, 3)]


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train-dspark")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"name": f"p{i}", "prompt": f"Tell me about {t}."})
                               + "\n" for i, t in enumerate(TOPICS)))
    common = ["train-drafter", "--model", tiny_model_dir, "--prompts", str(prompts),
              "--heldout-fraction", "0.3", "--max-new-tokens", "12", "--gen-batch-size", "8",
              "--epochs", "2", "--batch-size", "4", "--lr", "3e-3",
              "--data", str(tmp / "data.pt")]
    pard = tmp / "pard"
    train_drafter(build_parser().parse_args(
        common + ["--method", "pard", "--num-layers", "1", "--block", "3", "--out", str(pard)]))
    out = tmp / "dspark"
    args = build_parser().parse_args(common + [
        "--method", "dspark", "--dspark-backbone", str(pard), "--markov", "rnn",
        "--markov-rank", "8", "--save-dtype", "bfloat16", "--out", str(out)])
    return out, train_drafter(args), args, pard


def test_checkpoint_holds_a_pard_backbone_and_the_heads(trained):
    from safetensors.torch import load_file  # safetensors: as the loader reads it

    out, evaluation, args, pard = trained
    meta = read_dspark_config(out)
    assert (meta["markov"], meta["markov_rank"], meta["block"]) == ("rnn", 8, 3)
    assert meta["mask_token_id"] == read_pard_config(pard)["mask_token_id"]
    assert read_pard_config(out / BACKBONE)["num_layers"] == 1
    assert meta["training"]["evaluation"] == evaluation
    heads = load_file(str(out / HEADS))
    assert {"token_proj.weight", "to_vocab.weight", "cell.weight", "confidence.weight"} \
        <= set(heads)
    assert {t.dtype for t in heads.values()} == {torch.bfloat16}
    assert heads["to_vocab.weight"].abs().sum() > 0  # trained away from its zero start
    cal = evaluation["heldout"]["confidence_calibration"]
    assert cal["judged"] > 0 and 0 <= cal["mean_predicted"] <= 1


def test_reported_acceptance_is_the_loaded_proposers(trained, tiny_model_dir):
    out, evaluation, args, _ = trained
    acc = evaluation["heldout"]["acceptance_per_position"]
    assert len(acc) == 3 and acc == sorted(acc, reverse=True) and all(0 <= a <= 1 for a in acc)
    proposer = create_proposer("dspark", {"model": str(out), "markov": "rnn",
                                          "markov_rank": 8}, DraftTarget(model=tiny_model_dir))
    assert proposer.returns_draft_confidences and proposer.draft_weights_bytes > 0
    held = torch.load(args.data, weights_only=False)["samples"]["heldout"]
    assert acceptance(proposer, held, 3, batch_size=2) == pytest.approx(acc)


def test_keys_that_are_not_the_checkpoints_are_refused(trained, tiny_model_dir):
    out = str(trained[0])
    target = DraftTarget(model=tiny_model_dir)
    with pytest.raises(ValueError, match="markov=gated asked"):
        create_proposer("dspark", {"model": out, "markov": "gated"}, target)
    with pytest.raises(ValueError, match="markov_rank=64 asked"):
        create_proposer("dspark", {"model": out, "markov_rank": 64}, target)
    with pytest.raises(ValueError, match="not a DSpark checkpoint"):
        create_proposer("dspark", {"model": str(trained[3])}, target)  # a PARD dir


def test_rank_zero_is_refused_before_training(tiny_model_dir, tmp_path):
    from specmesh.drafter.training.dspark import train_dspark

    args = build_parser().parse_args(["train-drafter", "--method", "dspark", "--markov-rank",
                                      "0", "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="markov_rank must be a positive"):
        train_dspark({"lm": None, "samples": {}}, args, object)


def test_a_checkpoint_may_read_its_backbone_from_another_directory(tmp_path):
    """config.json ``backbone``: a path relative to the checkpoint (the shipped SmolLM2 draft
    reads the shipped PARD draft, ``../pard``); without it, ``backbone/`` inside."""
    from specmesh.drafter.dspark_files import backbone_dir, shipped_dspark

    assert backbone_dir(tmp_path / "d", {}) == (tmp_path / "d" / BACKBONE).resolve()
    assert backbone_dir(tmp_path / "d", {"backbone": "../pard"}) == (tmp_path / "pard").resolve()
    shipped = shipped_dspark("SmolLM2-135M-Instruct")
    assert shipped is not None and not (shipped / BACKBONE).exists()
    assert (backbone_dir(shipped, read_dspark_config(shipped)) / "pard.safetensors").is_file()
