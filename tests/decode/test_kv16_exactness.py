"""A float32 model with a 16-bit KV cache (``--kv-cache-dtype bfloat16`` / ``float16``) through
the three in-process workers: speculation on equals speculation off token for token (greedy
chains and token trees through side branches, seeded sampling), with drafts accepted; the
prefill's KVFrames are 16-bit and the verifier stores them as they are (the verifier's cache
holds after the transfer exactly what the prefill's held); a frame of another dtype, and a
peer announcing another KV dtype in its Hello, are refused."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch
from helpers.models import tiny_llama
from helpers.proposers import GarbageProposer, OracleProposer, TreeOracleProposer

from specmesh.cluster.inprocess import InProcessCluster
from specmesh.decode.kv_receiver import KVReceiver
from specmesh.drafter.proposers.ngram import NgramProposer
from specmesh.engine.block_manager import BlockManager
from specmesh.engine.frames import tensor_to_buffer
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.runner import ModelRunner
from specmesh.prefill.config import PrefillConfig
from specmesh.prefill.worker import PrefillWorker
from specmesh.protocol.errors import ProtocolError
from specmesh.protocol.handshake import identity_mismatch
from specmesh.protocol.messages import (
    KVFrame,
    ModelIdentity,
    PrefillDone,
    PrefillRequest,
    SamplingParams,
)
from specmesh.protocol.transport import InProcHub

MAX_TOKENS = 20
VOCAB = 96
KV16 = ["bfloat16", "float16"]


@pytest.fixture(scope="module")
def tiny():
    # head_dim 64 (the compiled attention's vector path) and flat logits (small weights):
    # near-ties, where a verify row reading other K/V than a one-token step would show
    _, model, cfg = tiny_llama(seed=0, dtype=torch.float32, vocab_size=VOCAB, num_heads=4,
                               num_kv_heads=2, hidden_size=256, init_std=0.1)
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (150, 257, 90)]
    prompts.append([7, 8, 9] * 40)  # repeats: the n-gram drafter proposes (and gets accepted)
    return model, cfg, prompts


def _cluster(model, cfg, k, kv, **kw):
    return InProcessCluster(model, cfg, num_speculative_tokens=k, num_kv_blocks=256,
                            block_size=16, kv_cache_dtype=kv, **kw)


def _generate(c, prompts, params=None):
    params = params or [SamplingParams(max_tokens=MAX_TOKENS - (i % 3))
                        for i in range(len(prompts))]
    return [o.token_ids for o in c.generate(prompts, params)]


@pytest.mark.parametrize("kv", KV16)
def test_speculation_equals_plain_decode(tiny, kv):
    model, cfg, prompts = tiny
    c = _cluster(model, cfg, 0, kv)
    assert c.verifier.kv.kv_cache.dtype == c.prefill.runner.kv_cache.dtype == getattr(torch, kv)
    plain = _generate(c, prompts)
    # the oracle proposes plain decode's own output: every step carries kappa drafts
    c = _cluster(model, cfg, 4, kv, proposer=OracleProposer(prompts, plain))
    assert _generate(c, prompts) == plain
    st = c.verifier.stats
    assert st.num_accepted_tokens > 0 and st.num_accepted_tokens == st.num_draft_tokens
    c = _cluster(model, cfg, 4, kv, proposer=GarbageProposer(VOCAB))
    assert _generate(c, prompts) == plain and c.verifier.stats.num_draft_tokens > 0
    c = _cluster(model, cfg, 4, kv)  # the n-gram drafter
    assert _generate(c, prompts) == plain and c.verifier.stats.num_accepted_tokens > 0
    # token trees: branch 0 always wrong, every accepted draft through a side branch
    c = _cluster(model, cfg, 3, kv, proposer=TreeOracleProposer(prompts, plain, VOCAB))
    assert _generate(c, prompts) == plain
    st = c.verifier.stats
    assert st.num_tree_verify_steps > 0 and st.num_tree_side_branch_accepts > 0
    c = _cluster(model, cfg, 4, kv, proposer=NgramProposer(min_ngram=1, tree_width=3))
    assert _generate(c, prompts) == plain and c.verifier.stats.num_tree_verify_steps > 0


def test_seeded_sampling_with_speculation_equals_without(tiny):
    model, cfg, prompts = tiny
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=100 + i)
              for i in range(len(prompts))]
    plain = _generate(_cluster(model, cfg, 0, "bfloat16"), prompts, params)
    c = _cluster(model, cfg, 4, "bfloat16", proposer=OracleProposer(prompts, plain))
    assert _generate(c, prompts, params) == plain
    assert c.verifier.stats.num_accepted_tokens > 0


def test_the_option_changes_the_cache_not_just_its_name(tiny):
    """The 16-bit runs above are not float32 runs: a 16-bit cache's logits differ from a
    float32 cache's (by rounding) on the same prompt."""
    model, cfg, prompts = tiny
    logits = {}
    for kv in ("float32", "bfloat16"):
        runner = ModelRunner(model, cfg, KVCache(cfg, 16, 16, dtype=kv))
        runner.prefill(prompts[0], list(range(16)))
        logits[kv] = runner.prefill([3], list(range(16)), start_pos=len(prompts[0]))
    diff = (logits["float32"] - logits["bfloat16"]).abs().max().item()
    assert 0 < diff < 0.1


def _prefill_frames(model, cfg, kv, prompt):
    """The KVFrames (and PrefillDone) a prefill worker with a ``kv`` cache sends for
    ``prompt``, and its cache after the prefill."""
    hub = InProcHub()
    verifier = hub.mailbox("verifier-0")
    runner = ModelRunner(model, cfg, KVCache(cfg, 16, 16, dtype=kv))
    worker = PrefillWorker(PrefillConfig(frame_tokens=40, frame_layers=1),
                           hub.mailbox("prefill-0"), runner, BlockManager(16, 16))
    table = list(range(-(-len(prompt) // 16)))
    verifier.send("prefill-0", PrefillRequest(request_id="r", transfer_id=3,
                                              prompt_token_ids=prompt, block_table=table,
                                              sampling=SamplingParams(max_tokens=4)))
    for _ in range(4):
        worker.step()
    msgs = [e.msg for e in verifier.drain()]
    return msgs, runner.kv_cache.read_chunk(0, cfg.num_layers, table, 0, len(prompt))


@pytest.mark.parametrize("kv", KV16)
def test_the_transfer_is_16bit_and_stored_as_sent(tiny, kv):
    model, cfg, prompts = tiny
    prompt = prompts[2]
    msgs, sent = _prefill_frames(model, cfg, kv, prompt)
    frames = [m for m in msgs if isinstance(m, KVFrame)]
    (done,) = [m for m in msgs if isinstance(m, PrefillDone)]
    assert frames and all(f.kv.dtype == kv for f in frames)
    itemsize = 2
    assert done.num_bytes == sum(f.kv.nbytes for f in frames) == \
        sent.numel() * itemsize  # half the bytes of a float32 transfer
    cache = KVCache(cfg, 16, 16, dtype=kv)
    receiver = KVReceiver(cache)
    table = [9, 3, 12, 0, 7, 1, 2, 4]  # other blocks than the prefill's
    receiver.start("r", 3, "prefill-0", table, len(prompt))
    for f in frames:
        receiver.on_frame("prefill-0", f)
    assert receiver.on_done("prefill-0", done) is not None  # complete
    got = cache.read_chunk(0, cfg.num_layers, table, 0, len(prompt))
    assert torch.equal(got.view(torch.int16), sent.view(torch.int16))  # bit for bit


def test_a_frame_of_another_kv_dtype_is_refused(tiny):
    model, cfg, prompts = tiny
    msgs, _ = _prefill_frames(model, cfg, "bfloat16", prompts[2][:20])
    frame = next(m for m in msgs if isinstance(m, KVFrame))
    receiver = KVReceiver(KVCache(cfg, 16, 16, dtype="float32"))
    receiver.start("r", 3, "prefill-0", [0, 1], 20)
    with pytest.raises(ProtocolError, match="KV dtype torch.bfloat16 != cache dtype"):
        receiver.on_frame("prefill-0", frame)
    wide = msgspec.structs.replace(frame, kv=tensor_to_buffer(torch.zeros(frame.kv.shape)))
    receiver = KVReceiver(KVCache(cfg, 16, 16, dtype="bfloat16"))
    receiver.start("r", 3, "prefill-0", [0, 1], 20)
    with pytest.raises(ProtocolError, match="KV dtype torch.float32 != cache dtype"):
        receiver.on_frame("prefill-0", wide)


def test_hello_refuses_a_peer_with_another_kv_cache_dtype():
    base = dict(name="m", vocab_size=10, dtype="float32", num_layers=2, num_kv_heads=1,
                head_dim=4, block_size=16)
    ours = ModelIdentity(**base, kv_cache_dtype="bfloat16")
    assert identity_mismatch(ours, ModelIdentity(**base, kv_cache_dtype="bfloat16")) == ""
    why = identity_mismatch(ours, ModelIdentity(**base, kv_cache_dtype="float32"))
    assert "kv_cache_dtype" in why and "float32" in why
