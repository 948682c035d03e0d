"""Frozen-KV MTP (issue 36 item 4) without a cluster: the assistant's query RoPE phase stays
pinned at the last committed position for every draft step (vLLM's
``constant_draft_positions``), the proposer allocates no draft KV pool (its per-request state
does not grow with the context), it reads the verifier's pool read-only through shared memory
and only the committed rows, and a verifier off the drafter's node is refused at Hello (the
rule, and over ZMQ)."""

from __future__ import annotations

import time

import pytest
import torch

from specmesh.drafter.frozen_kv.assistant import AssistantConfig, FrozenKVAssistant
from specmesh.drafter.proposers.frozen_kv_mtp import FrozenKVMTPProposer
from specmesh.engine.config import ModelConfig
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.shared_kv import SharedKVFile, map_read_only
from specmesh.protocol.messages import PROTOCOL_VERSION, Hello, TargetKVRows
from specmesh.protocol.zmq_transport import ZmqMailbox

CONFIG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8)
BLOCK = 4
NUM_BLOCKS = 64


def _assistant(seed: int = 0) -> FrozenKVAssistant:
    torch.manual_seed(seed)
    m = FrozenKVAssistant(AssistantConfig.for_target(CONFIG))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    m.set_target_weights(torch.randn(96, 32), torch.randn(96, 32))
    return m.eval()


@pytest.fixture
def pool(tmp_path):
    """A verifier's KV cache in a shared-memory file (random K/V), with its Hello."""
    shape = (CONFIG.num_layers, 2, NUM_BLOCKS * BLOCK, CONFIG.num_kv_heads, CONFIG.head_dim)
    f = SharedKVFile("verifier-t", shape, "float32", BLOCK, directory=str(tmp_path))
    cache = KVCache(CONFIG, NUM_BLOCKS, BLOCK, storage=f.tensor)
    torch.manual_seed(1)
    cache.data.copy_(torch.randn(shape))
    hello = Hello(protocol_version=PROTOCOL_VERSION, role="verifier", instance_id="verifier-t",
                  incarnation=1, shared_kv=f.describe())
    yield cache, f, hello
    f.close()


def _proposer(hello) -> FrozenKVMTPProposer:  # noqa: ANN001
    p = FrozenKVMTPProposer(assistant_module=_assistant())
    assert p.check_verifier_hello("verifier-t", hello) == ""
    return p


def _open(p: FrozenKVMTPProposer, rid: str, ctx: list[int], blocks: list[int]) -> None:
    """A request with committed context ``ctx``: rows [0, len - 1) committed, seed at len-2."""
    p.open(rid, ctx)
    p.observe_target_kv(rid, "verifier-t", TargetKVRows(block_table=blocks,
                                                        num_rows=len(ctx) - 1))
    p.observe_seed_state(rid, len(ctx) - 2, torch.randn(1, CONFIG.hidden_size))


def test_positions_stay_pinned_at_the_last_committed_position_across_draft_steps(pool):
    _, _, hello = pool
    p = _proposer(hello)
    seen: list[list[int]] = []
    rope = p.model._rope

    def spy(q, positions):  # noqa: ANN001, ANN202
        seen.append(positions.tolist())
        return rope(q, positions)

    p.model._rope = spy
    ctx = list(range(1, 23))  # 22 committed tokens: rows [0, 21), last position 21
    _open(p, "r", ctx, list(range(6)))
    drafts = p.propose("r", ctx, 4)
    assert len(drafts) == 4 and len(seen) == 4
    assert all(pos == [21] for pos in seen), seen
    # run-ahead past the committed prefix (the drafter's own path): still position 21
    seen.clear()
    more = p.propose("r", ctx + drafts, 2)
    assert len(more) == 2 and seen and all(pos == [21] for pos in seen), seen
    # a commit of two tokens moves the anchor: position 23 for every step, none in between
    seen.clear()
    new_ctx = ctx + drafts[:2]
    p.observe_target_kv("r", "verifier-t", TargetKVRows(block_table=list(range(7)),
                                                        num_rows=len(new_ctx) - 1))
    p.observe_seed_state("r", len(ctx) - 1, torch.randn(2, CONFIG.hidden_size))
    assert len(p.propose("r", new_ctx, 3)) == 3
    assert seen == [[23]] * 3


def test_batched_drafts_equal_alone_and_steps_pin_each_requests_position(pool):
    _, _, hello = pool
    p = _proposer(hello)
    torch.manual_seed(5)
    a, b = list(range(3, 13)), list(range(40, 70))
    _open(p, "a", a, [0, 1, 2])
    _open(p, "b", b, [3, 4, 5, 6, 7, 8, 9, 10])
    from specmesh.drafter.proposer import ProposeCall

    both = p.propose_many([ProposeCall("a", a, 3), ProposeCall("b", b, 3)])
    p.rollback("a", len(a))
    p.rollback("b", len(b))
    assert [d for d, _ in both] == [p.propose("a", a, 3), p.propose("b", b, 3)]
    assert all(r is None for _, rows in both for r in rows)  # one-hot drafts


def test_no_draft_kv_pool_state_does_not_grow_with_the_context(pool):
    _, _, hello = pool
    p = _proposer(hello)
    short, long = list(range(1, 9)), [1 + i % 90 for i in range(200)]
    _open(p, "s", short, [0, 1])
    _open(p, "l", long, list(range(10, 60)))
    assert len(p.propose("s", short, 4)) == 4 and len(p.propose("l", long, 4)) == 4

    def state_bytes(rid: str) -> int:
        st = p.requests[rid]
        tensors = [st.seed, *st.outs]
        return sum(t.numel() * t.element_size() for t in tensors)

    assert state_bytes("s") == state_bytes("l") > 0  # [steps, d]: no per-token K/V
    # nothing of the proposer or its model is a KV pool or grows with the context
    from specmesh.drafter.eagle.head_kv import HeadKV
    from specmesh.engine.dense_kv import DenseKVCache

    kinds = (KVCache, HeadKV, DenseKVCache)
    assert not any(isinstance(v, kinds) for v in vars(p).values())
    assert not any(isinstance(v, kinds) for v in vars(p.model).values())
    assert not any("k_proj" in n or "v_proj" in n for n, _ in p.model.named_parameters())
    mem = p.draft_memory()
    assert mem["draft_kv_pool_bytes"] == 0
    assert mem["draft_weights_bytes"] == p.model.weights_bytes() > 0
    # what an EAGLE-style draft layer would hold for these contexts: 2 * h_kv * d_h * 4 bytes
    per_token = 2 * CONFIG.num_kv_heads * CONFIG.head_dim * 4
    assert mem["draft_kv_bytes_per_token_avoided"] == per_token
    assert mem["draft_kv_bytes_avoided"] == per_token * (len(short) - 1 + len(long) - 1)
    p.close("s")
    p.close("l")
    assert p.draft_memory()["draft_state_bytes"] == 0


def test_only_committed_rows_are_read_and_the_mapping_is_read_only(pool):
    cache, f, hello = pool
    p = _proposer(hello)
    ctx = list(range(5, 25))  # rows [0, 19) committed
    blocks = list(range(8))
    _open(p, "r", ctx, blocks)
    want = p.propose("r", ctx, 4)
    # the verifier writes past the committed rows (a verify forward's drafts): never read
    cache.data[:, :, 19:8 * BLOCK] = float("nan")
    p.rollback("r", 0)
    assert p.propose("r", ctx, 4) == want
    # the verifier's writes to committed rows are seen through the mapping (shared memory)
    cache.data[:, :, :19] = 0.0
    p.rollback("r", 0)
    assert p.pools["verifier-t"].data[:, :, :19].abs().sum() == 0
    # the drafter's mapping is read-only (PROT_READ, shared): writes would fault
    with open("/proc/self/maps") as maps:
        perms = {line.split()[1] for line in maps if f.path in line}
    assert any(perm.startswith("r-") and perm.endswith("s") for perm in perms), perms
    # a closed request is never read again
    p.close("r")
    before = p.num_kv_rows_read
    assert p.propose("r", ctx, 2) == [] and p.num_kv_rows_read == before


def test_a_verifier_off_the_drafters_node_is_refused(pool):
    _, f, hello = pool
    p = FrozenKVMTPProposer(assistant_module=_assistant())
    import msgspec

    other = msgspec.structs.replace(hello.shared_kv, node="elsewhere/boot-1")
    why = p.check_verifier_hello("verifier-t", msgspec.structs.replace(hello, shared_kv=other))
    assert "node" in why and "elsewhere/boot-1" in why and "co-locate" in why
    why = p.check_verifier_hello("verifier-t", msgspec.structs.replace(hello, shared_kv=None))
    assert "shares no KV pool" in why
    moved = msgspec.structs.replace(hello.shared_kv, inode=hello.shared_kv.inode + 1)
    assert "not the file" in p.check_verifier_hello(
        "verifier-t", msgspec.structs.replace(hello, shared_kv=moved))
    assert p.pools == {}
    assert p.check_verifier_hello("verifier-t", hello) == ""
    assert "verifier-t" in p.pools


def test_zmq_hello_from_a_verifier_on_another_node_is_refused_with_a_clear_error(pool):
    """Over the real transport: the drafter's mailbox asks the proposer (as DrafterHost
    wires it); the verifier's Hello announcing a pool on another node is refused and both
    sides see why."""
    import msgspec

    _, f, hello = pool
    p = FrozenKVMTPProposer(assistant_module=_assistant())
    drafter = ZmqMailbox("drafter-0", "drafter", draft_method="frozen_kv_mtp")
    drafter.hello_check = p.check_verifier_hello
    verifier = ZmqMailbox("verifier-t", "verifier", draft_method="frozen_kv_mtp")
    verifier.shared_kv = msgspec.structs.replace(f.describe(), node="other-host/boot-9")
    errors: list = []
    try:
        verifier.connect("drafter-0", drafter.endpoint, "drafter")
        deadline = time.monotonic() + 10
        while len(errors) < 2 and time.monotonic() < deadline:
            for mb in (drafter, verifier):
                env = mb.recv(0.01)
                if env is not None and env.is_error:
                    errors.append((mb.name, str(env.msg)))
        assert {n for n, _ in errors} == {"drafter-0", "verifier-t"}, errors
        assert all("other-host/boot-9" in e and "node" in e for _, e in errors), errors
        assert not verifier.ready("drafter-0") and "verifier-t" not in drafter.accepted
        assert p.pools == {}
    finally:
        verifier.close()
        drafter.close()


def test_kv_cache_storage_must_fit():
    with pytest.raises(ValueError, match="storage"):
        KVCache(CONFIG, 4, BLOCK, storage=torch.zeros(1, 2, 3))
