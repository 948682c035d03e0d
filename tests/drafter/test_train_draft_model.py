"""`specmesh train-drafter --method draft-model` on the tiny model: a few steps end to end write
a Hugging Face dir that --drafter draft-model:PATH loads; the split is by prompt; acceptance is
per position, falls with depth and equals what the proposer itself drafts; through the
in-process workers float64 greedy output equals plain decoding."""

import json

import pytest
import torch

from specmesh.cluster.cli import build_parser
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.drafter.training.eagle import train_drafter
from specmesh.drafter.draft_model_files import META, engine_model, read_draft_meta, save_draft_model
from specmesh.drafter.draft_model_training import acceptance, init_draft_model, layer_sources
from specmesh.drafter.eagle.data import chat_token_ids
from specmesh.drafter.proposers.draft_model import DraftModelProposer, build_draft_model_proposer
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.loader import load_model
from specmesh.engine.runner import ModelRunner, SeqChunk
from helpers.models import tiny_llama
from specmesh.protocol.messages import SamplingParams

TOPICS = ["rivers", "python lists", "the moon", "tea", "prime numbers", "bicycles", "sorting",
          "volcanoes", "poetry", "binary search", "clouds", "chess"]


@pytest.fixture(scope="module")
def trained_draft(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train-draft-model")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"name": f"p{i}", "prompt": f"Tell me about {t}."})
                               + "\n" for i, t in enumerate(TOPICS)))
    extra = tmp / "extra.jsonl"
    extra.write_text(json.dumps({"name": "x0", "prompt": "Write a haiku about rain."}) + "\n")
    out = tmp / "draft"
    args = build_parser().parse_args([
        "train-drafter", "--method", "draft-model", "--model", tiny_model_dir,
        "--prompts", str(prompts), "--eval-prompts", str(extra), "--heldout-fraction", "0.3",
        "--max-new-tokens", "16", "--gen-batch-size", "5", "--num-layers", "1",
        "--epochs", "3", "--batch-size", "4", "--lr", "3e-3", "--eval-depth", "3",
        "--out", str(out), "--data", str(tmp / "data.pt")])
    evaluation = train_drafter(args)
    return out, evaluation, args


def test_checkpoint_is_a_hf_dir_naming_its_target_that_the_proposer_loads(trained_draft,
                                                                         tiny_model_dir):
    out, evaluation, _ = trained_draft
    for name in ("config.json", "model.safetensors", "tokenizer.json", META):
        assert (out / name).is_file(), name
    target = load_model(tiny_model_dir)
    meta = read_draft_meta(out)
    assert meta["target"]["name"] == target.name
    assert meta["target"]["vocab_size"] == target.config.vocab_size == 49152
    assert meta["num_layers"] == 1 and meta["layers_from_target"] == [0]
    assert meta["training"]["command"].startswith("specmesh train-drafter")
    assert meta["training"]["evaluation"] == evaluation
    proposer = build_draft_model_proposer(str(out), target.config, target.tokenizer,
                                          target_name=target.name, num_blocks=16)
    cfg = proposer.config
    assert cfg.num_layers == 1
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (
        target.config.hidden_size, target.config.num_heads, target.config.num_kv_heads,
        target.config.vocab_size)
    assert cfg.tie_word_embeddings == target.config.tie_word_embeddings
    # embedding, LM head and final norm are the target's (frozen by default)
    torch.testing.assert_close(proposer.model.model.embed_tokens.weight,
                               target.model.model.embed_tokens.weight)
    torch.testing.assert_close(proposer.model.lm_head.weight, target.model.lm_head.weight)
    prompt = chat_token_ids(target.tokenizer, [{"messages": [
        {"role": "user", "content": "Tell me about tea."}]}])[0]
    proposer.open("r", prompt)
    assert len(proposer.propose("r", prompt, 3)) == 3


def test_train_and_heldout_prompts_do_not_overlap(trained_draft):
    out, _, args = trained_draft
    training = read_draft_meta(out)["training"]
    held = set(training["heldout_names"])
    assert held and len(held) < len(TOPICS)
    assert training["train_prompts"] + training["heldout_prompts"] == len(TOPICS)
    samples = torch.load(args.data, weights_only=False)["samples"]
    assert {s.name for s in samples["heldout"]} == held
    assert not {s.name for s in samples["train"]} & held


def test_acceptance_is_per_position_and_falls_with_depth(trained_draft):
    _, evaluation, _ = trained_draft
    assert set(evaluation) == {"heldout", "extra"}
    for ev in evaluation.values():
        acc = ev["acceptance_per_position"]
        assert len(acc) == 3 and all(0 <= a <= 1 for a in acc)
        assert acc == sorted(acc, reverse=True)  # a chain only gets shorter
        assert ev["mean_accepted_per_chain"] == pytest.approx(sum(acc))


def test_batched_acceptance_equals_the_proposers_own_drafts(trained_draft):
    """acceptance() simulates DraftModelProposer: at every output position after prefill's
    token, greedy drafts from the true prefix; here recomputed one position at a time with the
    proposer itself."""
    out, _, args = trained_draft
    draft = load_model(str(out), "float64")
    samples = torch.load(args.data, weights_only=False)["samples"]["heldout"]
    depth = 3
    proposer = DraftModelProposer(loaded=draft, num_blocks=64)
    hits, total = [0] * depth, 0
    for s in samples:
        for j in range(s.prompt_len + 1, len(s.token_ids)):  # prefill gave the first
            d = proposer.propose(s.name, s.token_ids[:j], depth)
            ok = True
            for k in range(depth):
                ok = ok and j + k < len(s.token_ids) and d[k] == s.token_ids[j + k]
                hits[k] += ok
            total += 1
        proposer.close(s.name)
    expected = [h / total for h in hits]
    assert acceptance(draft.model, draft.config, samples, depth, batch_size=2) == expected


def test_layers_start_from_the_targets_first_or_evenly_spaced_ones():
    assert layer_sources(30, 2) == [0, 1]
    assert layer_sources(30, 2, "spread") == [0, 29]
    assert layer_sources(30, 3, "spread") == [0, 14, 29]  # round(14.5) is 14
    assert layer_sources(4, 1, "spread") == [0]
    assert layer_sources(4, 4, "spread") == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        layer_sources(4, 5)


def test_float64_greedy_through_the_inprocess_workers_equals_plain_decode(trained_draft,
                                                                          tiny_model_dir):
    out, _, _ = trained_draft
    lm = load_model(tiny_model_dir, "float64")
    prompts = chat_token_ids(lm.tokenizer, [{"messages": [
        {"role": "user", "content": f"Tell me about {t}."}]} for t in TOPICS[:5]])
    sp = SamplingParams(max_tokens=20)
    eos = lm.config.eos_token_ids
    plain = InProcessCluster(lm.model, lm.config, num_speculative_tokens=0,
                             eos_token_ids=eos).generate(prompts, sp)
    proposer = build_draft_model_proposer(str(out), lm.config, lm.tokenizer, "float64",
                                          target_name=lm.name, num_blocks=64)
    spec = InProcessCluster(lm.model, lm.config, num_speculative_tokens=3, eos_token_ids=eos,
                            draft_method="draft_model", proposer=proposer).generate(prompts, sp)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.spec.num_draft_tokens for o in spec) > 0
    assert sum(o.spec.num_accepted_tokens for o in spec) > 0


def test_a_tied_target_gives_a_tied_draft_that_loads_back(tmp_path):
    """Tie settings follow the target: the saved dir has no separate LM head, and engine's
    loader builds it back with the same logits as the trained transformers model."""
    hf, target, _ = tiny_llama(seed=5, dtype=torch.float32, vocab_size=96, num_layers=3,
                               tie_word_embeddings=True)
    draft, sources = init_draft_model(target, hf.config, 2, "spread")
    assert sources == [0, 2] and draft.config.tie_word_embeddings
    assert draft.lm_head.weight is draft.model.embed_tokens.weight
    for j, i in enumerate(sources):
        torch.testing.assert_close(draft.model.layers[j].mlp.up_proj.weight,
                                   target.model.layers[i].mlp.up_proj.weight)
    torch.testing.assert_close(draft.model.norm.weight, target.model.norm.weight)
    save_draft_model(draft, None, tmp_path, {"target": {"name": "t"}})
    loaded = load_model(str(tmp_path))
    assert loaded.config.num_layers == 2 and loaded.config.tie_word_embeddings
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        ref = draft(input_ids=ids).logits[0]
    for model in (loaded.model, engine_model(draft)):
        runner = ModelRunner(model, loaded.config, KVCache(loaded.config, 4, 4, torch.float32))
        got = runner.forward([SeqChunk(ids[0].tolist(), 0, [0, 1])], logits="all")[0]
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
