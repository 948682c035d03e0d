"""`specmesh train-drafter --method eagle` on the tiny model: a few steps end to end."""

import json

import pytest
import torch

from specmesh.cluster.cli import build_parser
from specmesh.drafter.training.eagle import train_drafter
from specmesh.drafter.eagle.checkpoint import (HeadMismatch, load_head, read_head_config,
                                      target_embeddings, target_identity)
from specmesh.engine.loader import load_model

TOPICS = ["rivers", "python lists", "the moon", "tea", "prime numbers", "bicycles", "sorting",
          "volcanoes", "poetry", "binary search", "clouds", "chess"]


def _small_run(model_dir: str, tmp_path, num_topics: int, *options: str):  # noqa: ANN001, ANN202
    """Parsed ``train-drafter`` args for a few-step eagle run on the tiny model over the first
    ``num_topics`` prompts (output in tmp_path/head, data in tmp_path/data.pt); ``options``
    are added to (and override) the common ones."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"name": f"p{i}", "prompt": f"Tell me about {t}."})
                               + "\n" for i, t in enumerate(TOPICS[:num_topics])))
    return build_parser().parse_args([
        "train-drafter", "--model", model_dir, "--prompts", str(prompts),
        "--heldout-fraction", "0.3", "--gen-batch-size", "4", "--batch-size", "4",
        "--depth", "2", "--out", str(tmp_path / "head"), "--data", str(tmp_path / "data.pt"),
        *options])


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train-drafter")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"name": f"p{i}", "prompt": f"Tell me about {t}."})
                               + "\n" for i, t in enumerate(TOPICS)))
    extra = tmp / "extra.jsonl"
    extra.write_text(json.dumps({"name": "x0", "prompt": "Write a haiku about rain."}) + "\n")
    out = tmp / "head"
    args = build_parser().parse_args([
        "train-drafter", "--model", tiny_model_dir, "--prompts", str(prompts),
        "--eval-prompts", str(extra), "--heldout-fraction", "0.3", "--max-new-tokens", "12",
        "--gen-batch-size", "5", "--draft-vocab-size", "256", "--epochs", "3",
        "--batch-size", "4", "--depth", "2", "--eval-depth", "3", "--out", str(out),
        "--data", str(tmp / "data.pt")])
    evaluation = train_drafter(args)
    return out, evaluation, args


def test_checkpoint_names_its_target_and_splits_by_prompt(trained, tiny_model_dir):
    out, evaluation, _ = trained
    meta = json.loads((out / "config.json").read_text())
    assert meta["config"]["target"]["vocab_size"] == 49152
    training = meta["training"]
    held = set(training["heldout_names"])
    assert held and len(held) < len(TOPICS)
    assert training["train_prompts"] + training["heldout_prompts"] == len(TOPICS)
    assert set(evaluation) == {"heldout", "extra"}
    for ev in evaluation.values():
        acc = ev["acceptance_per_position"]
        assert len(acc) == 3 and all(0 <= a <= 1 for a in acc)
        assert acc == sorted(acc, reverse=True)  # a chain only gets shorter
    assert read_head_config(out).draft_vocab_size == 256


def test_head_loads_for_its_target_and_is_refused_for_another(trained, tiny_model_dir):
    out, _, _ = trained
    lm = load_model(tiny_model_dir)
    embed, lm_head = target_embeddings(tiny_model_dir)
    torch.testing.assert_close(embed, lm.model.model.embed_tokens.weight)
    head = load_head(out, embed, lm_head, target_identity(lm.name, lm.config, embed))
    assert head.lm_head.shape == (256, lm.config.hidden_size)
    other = embed + 0.5
    with pytest.raises(HeadMismatch, match="other embedding weights"):
        load_head(out, other, other, target_identity("other", lm.config, other))
    wrong = dict(target_identity(lm.name, lm.config, embed), hidden_size=32, name="small")
    with pytest.raises(HeadMismatch, match="hidden_size"):
        load_head(out, embed, lm_head, wrong)


def test_generated_samples_are_the_targets_greedy_outputs(trained, tiny_model_dir):
    """The cached data: greedy tokens and hidden states equal a plain forward's."""
    _, _, args = trained
    from specmesh.engine.block_manager import BlockManager
    from specmesh.engine.kv_cache import KVCache
    from specmesh.engine.runner import ModelRunner

    blob = torch.load(args.data, weights_only=False)
    sample = blob["samples"]["train"][0]
    lm = load_model(tiny_model_dir)
    cache = KVCache(lm.config, 16, 16, lm.model.dtype)
    runner = ModelRunner(lm.model, lm.config, cache)
    table = BlockManager(16, 16).allocate(8)
    logits, hidden = runner.forward(
        [__import__("specmesh.engine.runner", fromlist=["SeqChunk"]).SeqChunk(sample.token_ids, 0, table)],
        logits="all", return_hidden=True)
    p = sample.prompt_len
    assert logits[0][p - 1:-1].argmax(-1).tolist() == sample.token_ids[p:]
    torch.testing.assert_close(hidden[0][p - 1:-1].to(sample.features.dtype), sample.features,
                               atol=2e-2, rtol=2e-2)


def test_fused_feature_head_trains_on_layer_outputs_and_records_its_seed_state(
        tiny_model_dir, tmp_path):
    """--feature-layers (EAGLE-3 fusion): the data carries those layers' outputs side by side
    (equal to a plain forward's), the checkpoint names the seed state, and the head reads
    rows of that width only."""
    from specmesh.engine.block_manager import BlockManager
    from specmesh.engine.kv_cache import KVCache
    from specmesh.engine.runner import ModelRunner, SeqChunk

    out = tmp_path / "head"
    args = _small_run(tiny_model_dir, tmp_path, 6, "--max-new-tokens", "8",
                      "--draft-vocab-size", "128", "--epochs", "1", "--eval-depth", "2",
                      "--feature-layers", "1,0")
    prompts = tmp_path / "prompts.jsonl"
    train_drafter(args)
    cfg = read_head_config(out)
    assert cfg.feature_layers == (1, 0) and cfg.seed_state == "hidden:1,0"
    lm = load_model(tiny_model_dir)
    d = lm.config.hidden_size
    sample = torch.load(args.data, weights_only=False)["samples"]["train"][0]
    assert sample.features.shape[1] == 2 * d
    runner = ModelRunner(lm.model, lm.config, KVCache(lm.config, 16, 16, lm.model.dtype))
    table = BlockManager(16, 16).allocate(8)
    _, hidden = runner.forward([SeqChunk(sample.token_ids, 0, table)], logits="all",
                               return_hidden=True, hidden_layers=(1, 0))
    p = sample.prompt_len
    torch.testing.assert_close(hidden[0][p - 1:-1].to(sample.features.dtype), sample.features,
                               atol=2e-2, rtol=2e-2)
    embed, lm_head = target_embeddings(tiny_model_dir)
    head = load_head(out, embed, lm_head, target_identity(lm.name, lm.config, embed))
    assert head.seed_features(torch.randn(3, 2 * d)).shape == (3, d)
    with pytest.raises(ValueError, match="wide"):
        head.seed_features(torch.randn(3, d))
    with pytest.raises(SystemExit, match="feature-layers"):
        train_drafter(build_parser().parse_args([
            "train-drafter", "--model", tiny_model_dir, "--prompts", str(prompts),
            "--feature-layers", "0,5", "--out", str(tmp_path / "x")]))


def test_sampled_continuations_are_labelled_with_the_targets_greedy_tokens(
        tiny_model_dir, tmp_path):
    """--samples-per-prompt 3: each training prompt gets its greedy continuation and two
    sampled ones; a sampled one's labels are the target's argmax at each position (a plain
    forward over the sampled sequence), which is what the head's windows train on; held-out
    prompts stay greedy only."""
    from specmesh.drafter.eagle.train import IGNORE, windows
    from specmesh.engine.block_manager import BlockManager
    from specmesh.engine.kv_cache import KVCache
    from specmesh.engine.runner import ModelRunner, SeqChunk

    args = _small_run(tiny_model_dir, tmp_path, 6, "--max-new-tokens", "10",
                      "--draft-vocab-size", "0", "--epochs", "1", "--eval-depth", "2",
                      "--samples-per-prompt", "3", "--sample-temperature", "1.5")
    train_drafter(args)
    samples = torch.load(args.data, weights_only=False)["samples"]
    train, held = samples["train"], samples["heldout"]
    base = [s.name for s in train if "#" not in s.name]
    assert sorted(s.name for s in train) == sorted(
        [n for b in base for n in (b, f"{b}#1", f"{b}#2")])
    assert all(s.target_ids is None for s in held + [s for s in train if "#" not in s.name])
    sampled = [s for s in train if "#" in s.name]
    assert any(s.label_ids != s.token_ids for s in sampled)
    lm = load_model(tiny_model_dir)
    runner = ModelRunner(lm.model, lm.config, KVCache(lm.config, 16, 16, lm.model.dtype))
    to_draft = torch.arange(lm.config.vocab_size)
    for s in sampled:
        p = s.prompt_len
        logits = runner.forward([SeqChunk(s.token_ids, 0, BlockManager(16, 16).allocate(8))],
                                logits="all")[0]
        assert logits[p - 1:-1].argmax(-1).tolist() == s.target_ids
        (w,) = windows([s], to_draft)
        want = torch.tensor(s.target_ids[1:])  # entry s = p-1.. labels position s + 2
        assert torch.equal(w.labels[w.labels != IGNORE], want)
        assert torch.equal(w.next_tokens, torch.tensor(s.token_ids[p:-1]))  # sampled inputs


def test_bfloat16_checkpoint_is_what_was_evaluated(tiny_model_dir, tmp_path):
    """--save-dtype bfloat16 stores the head's weights in bf16 (half the file); the head is
    rounded before its evaluation, so the stored weights are exactly the evaluated ones."""
    from safetensors import safe_open

    from specmesh.drafter.eagle.checkpoint import round_weights, save_head
    from specmesh.drafter.eagle.head import EagleHead, EagleHeadConfig
    from specmesh.drafter.eagle.train import acceptance, windows

    out = tmp_path / "head"
    args = _small_run(tiny_model_dir, tmp_path, 8, "--heldout-fraction", "0.4",
                      "--max-new-tokens", "10", "--draft-vocab-size", "0", "--epochs", "2",
                      "--eval-depth", "3", "--save-dtype", "bfloat16")
    evaluation = train_drafter(args)
    with safe_open(str(out / "head.safetensors"), framework="pt") as st:
        dtypes = {k: st.get_tensor(k).dtype for k in st.keys()}
    assert dtypes.pop("draft_to_target") == torch.int64
    assert set(dtypes.values()) == {torch.bfloat16}
    lm = load_model(tiny_model_dir)
    embed, lm_head = target_embeddings(tiny_model_dir)
    target = target_identity(lm.name, lm.config, embed)
    head = load_head(out, embed, lm_head, target)
    held = torch.load(args.data, weights_only=False)["samples"]["heldout"]
    to_draft = torch.full((lm.config.vocab_size,), -1, dtype=torch.long)
    to_draft[head.draft_to_target] = torch.arange(head.draft_to_target.numel())
    assert acceptance(head, windows(held, to_draft), 3) == \
        evaluation["heldout"]["acceptance_per_position"]
    # the rounding is what makes stored == evaluated, bit for bit
    torch.manual_seed(0)
    fresh = EagleHead(EagleHeadConfig.for_target(lm.config, target=target))
    fresh.set_target_weights(embed.float(), lm_head.float(), None)
    for rounded in (False, True):
        if rounded:
            round_weights(fresh, torch.bfloat16)
        save_head(fresh, tmp_path / f"h{rounded}", dtype=torch.bfloat16)
        back = load_head(tmp_path / f"h{rounded}", embed, lm_head, target)
        same = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                      back.state_dict().values()))
        assert same == rounded


def test_bfloat16_autocast_training_learns_with_float32_weights():
    """--autocast bfloat16: the products run in bf16 (the result differs from a float32 run
    with the same seed), the weights and optimizer stay float32, and the head still learns a
    rule (label = next token + 1) to the same train acceptance as float32."""
    from specmesh.drafter.eagle.head import EagleHead, EagleHeadConfig
    from specmesh.drafter.eagle.train import Window, acceptance, train

    V, D = 64, 32
    cfg = EagleHeadConfig(hidden_size=D, num_heads=4, num_kv_heads=2, head_dim=8,
                          intermediate_size=64, vocab_size=V)
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(24):
        toks = torch.randint(0, V - 1, (20,), generator=g)
        data.append(Window(features=torch.randn(21, D, generator=g), next_tokens=toks,
                           labels=(toks + 1) % V, positions=torch.arange(20)))
    heads = {}
    for ac in (None, torch.bfloat16):
        torch.manual_seed(0)
        head = EagleHead(cfg)
        head.set_target_weights(torch.randn(V, D, generator=torch.Generator().manual_seed(1)),
                                torch.randn(V, D, generator=torch.Generator().manual_seed(2)))
        before = acceptance(head, data, 1)[0]
        summary = train(head, data, epochs=30, batch_size=8, lr=3e-3, depth=1, reg_weight=0.0,
                        autocast_dtype=ac, progress=False)
        assert summary["autocast"] == (None if ac is None else "bfloat16")
        assert all(p.dtype == torch.float32 for p in head.parameters())
        after = acceptance(head, data, 1)[0]
        assert before < 0.2 and after > 0.9, (ac, before, after)
        heads[ac] = head
    a, b = heads[None].fc.weight, heads[torch.bfloat16].fc.weight
    assert not torch.equal(a, b)
