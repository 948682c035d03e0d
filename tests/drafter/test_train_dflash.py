"""`specmesh train-drafter --method dflash` on the tiny model: a few steps write a checkpoint
of the draft's own weights only (no embedding, no LM head), naming its target, block and the
target layers its context rows carry; the acceptance it reports per position is what the
proposer loaded from disk by ``--drafter dflash:PATH`` measures; the seed state the cluster
asks the verifier for is the checkpoint's; a checkpoint is refused against another target.
Also the block objective's layout (anchors, real run-ahead rows, labels at the mask rows'
own positions, decaying weights)."""

import json

import pytest
import torch

from specmesh.cluster.cli import build_parser
from specmesh.drafter.dflash_files import WEIGHTS, read_dflash_config
from specmesh.drafter.dflash_model import MASK
from specmesh.drafter.dflash_training import IGNORE, acceptance, block_layout, position_weights
from specmesh.drafter.eagle.checkpoint import HeadMismatch
from specmesh.drafter.eagle.data import Sample
from specmesh.drafter.proposer import DraftTarget
from specmesh.drafter.registry import create_proposer, seed_state_for
from specmesh.drafter.training.eagle import train_drafter

TOPICS = ["rivers", "python lists", "the moon", "tea", "prime numbers", "bicycles", "sorting",
          "volcanoes"]


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train-dflash")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"name": f"p{i}", "prompt": f"Tell me about {t}."})
                               + "\n" for i, t in enumerate(TOPICS)))
    out = tmp / "dflash"
    args = build_parser().parse_args([
        "train-drafter", "--method", "dflash", "--model", tiny_model_dir,
        "--prompts", str(prompts), "--heldout-fraction", "0.3", "--max-new-tokens", "12",
        "--gen-batch-size", "8", "--feature-layers", "1,0", "--block", "3", "--epochs", "2",
        "--batch-size", "4", "--lr", "3e-3", "--save-dtype", "bfloat16", "--gamma", "0.5",
        "--max-run-ahead", "1", "--out", str(out), "--data", str(tmp / "data.pt")])
    return out, train_drafter(args), args


def test_checkpoint_holds_the_drafts_own_weights_only(trained):
    from safetensors.torch import load_file  # safetensors: as the loader reads it

    out, evaluation, _ = trained
    cfg = read_dflash_config(out)
    assert cfg.block == 3 and cfg.num_layers == 1 and cfg.feature_layers == (1, 0)
    assert cfg.seed_state == "hidden:1,0" and cfg.seed_width == 2 * cfg.hidden_size
    meta = json.loads((out / "config.json").read_text())
    assert meta["training"]["evaluation"] == evaluation
    assert meta["training"]["command"].startswith("specmesh train-drafter")
    # --max-run-ahead is the served proposer's limit too; --gamma is recorded
    assert cfg.max_run_ahead == 1 and meta["training"]["gamma"] == 0.5
    tensors = load_file(str(out / WEIGHTS))
    assert not any(k.startswith(("embed", "lm_head")) or "embed_tokens" in k for k in tensors)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "mask_embedding"} <= set(tensors)
    ids = tensors.pop("draft_to_target")  # the draft vocabulary (--draft-vocab-size)
    assert ids.dtype == torch.int64 and ids.shape == (cfg.draft_vocab_size,) > (0,)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


def test_reported_acceptance_is_the_loaded_proposers(trained, tiny_model_dir):
    out, evaluation, args = trained
    acc = evaluation["heldout"]["acceptance_per_position"]
    assert len(acc) == 3 and acc == sorted(acc, reverse=True) and all(0 <= a <= 1 for a in acc)
    target = DraftTarget(model=tiny_model_dir)
    proposer = create_proposer("dflash", {"model": str(out)}, target)
    assert proposer.seed_state == "hidden:1,0"
    assert seed_state_for("dflash", {"model": str(out)}, target) == "hidden:1,0"
    held = torch.load(args.data, weights_only=False)["samples"]["heldout"]
    assert acceptance(proposer, held, 3, batch_size=2) == pytest.approx(acc)


def test_a_checkpoint_for_another_target_is_refused(trained, tmp_path):
    out, _, args = trained
    meta = json.loads((out / "config.json").read_text())
    meta["config"]["target"]["fingerprint"] = [1.0, 2.0]
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(meta))
    (other / WEIGHTS).write_bytes((out / WEIGHTS).read_bytes())
    with pytest.raises(HeadMismatch):
        create_proposer("dflash", {"model": str(other)}, DraftTarget(model=args.model))


def test_block_layout_labels_each_mask_row_with_the_token_at_its_position():
    # prompt of 3 tokens, output 10 .. 15 (greedy: labels are the tokens)
    s = Sample("s", [1, 2, 3, 10, 11, 12, 13, 14, 15], 3, torch.zeros(6, 4))
    ids, starts, labels = block_layout(s, block=2, run_ahead=0, max_anchors=100)
    # anchors: every position with a context row before it and a label after it
    assert starts.tolist() == [3, 4, 5, 6, 7]
    assert ids[0].tolist() == [10, MASK, MASK] and labels[0].tolist() == [IGNORE, 11, 12]
    assert labels[-1].tolist() == [IGNORE, 15, IGNORE]  # past the sample's end: no loss
    ids, starts, labels = block_layout(s, block=2, run_ahead=1, max_anchors=2,
                                       generator=torch.Generator().manual_seed(0))
    assert len(starts) == 2 and all(3 <= a <= 6 for a in starts.tolist())
    a = int(starts[0])
    assert ids[0].tolist() == [s.token_ids[a], s.token_ids[a + 1], MASK, MASK]
    assert labels[0, :2].tolist() == [IGNORE, IGNORE]
    assert block_layout(s, block=2, run_ahead=5, max_anchors=4) is None
    w = position_weights(3, 1, gamma=4.0)
    assert w[:2].tolist() == [0.0, 0.0] and w[2] == 1.0 and 1 > w[3] > w[4] > 0
    steep = position_weights(3, 1, gamma=0.5)
    assert steep[2] == 1.0 and steep[3] == pytest.approx(w[3] ** 8)


def test_a_token_only_method_trains_from_a_cache_of_hidden_state_rows(trained, tiny_model_dir,
                                                                      tmp_path, capsys):
    """One --data cache feeds every method: pard reads the token ids of the DFlash run's
    samples (captured with layers 1, 0) without generating again; a method that reads other
    layers' rows generates its own."""
    import shutil

    from specmesh.drafter.training.eagle import prepare

    out, _, dflash_args = trained
    data = tmp_path / "data.pt"
    shutil.copy(dflash_args.data, data)
    prompts = str(out.parent / "prompts.jsonl")
    common = ["--model", tiny_model_dir, "--prompts", prompts, "--heldout-fraction",
              "0.3", "--max-new-tokens", "12", "--gen-batch-size", "8", "--data", str(data),
              "--out", str(tmp_path / "out")]
    capsys.readouterr()
    prep = prepare(build_parser().parse_args(["train-drafter", "--method", "pard", *common]))
    assert "using generated samples" in capsys.readouterr().out
    cached = torch.load(dflash_args.data, weights_only=False)["samples"]
    assert [s.token_ids for s in prep["samples"]["train"]] == \
        [s.token_ids for s in cached["train"]]
    prepare(build_parser().parse_args(["train-drafter", "--method", "dflash",
                                       "--feature-layers", "1", *common]))
    assert "using generated samples" not in capsys.readouterr().out
