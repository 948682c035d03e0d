"""What a drafting method costs the drafter, as its stats report it (drafter/draft_memory.py):
resident weight bytes (each storage once), draft KV bytes and model forwards (a batched call
counting once) for EAGLE, Medusa, PARD, the draft model, n-gram and suffix; the drafter
worker's ``draft_forwards`` counter and the drafter role's stats fields."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from specmesh.drafter.config import DrafterConfig
from specmesh.drafter.draft_memory import COST_FIELDS, drafter_costs, resident_bytes
from specmesh.drafter.eagle.head import EagleHead, EagleHeadConfig
from specmesh.drafter.medusa.heads import MedusaConfig, MedusaHeads
from specmesh.drafter.proposer import ProposeCall
from specmesh.drafter.proposers.draft_model import DraftModelProposer
from specmesh.drafter.proposers.eagle import EagleProposer
from specmesh.drafter.proposers.medusa import MedusaProposer
from specmesh.drafter.proposers.ngram import NgramProposer
from specmesh.drafter.proposers.pard import PardProposer
from specmesh.drafter.proposers.suffix import SuffixProposer
from specmesh.drafter.worker import DrafterWorker
from specmesh.engine.frames import tensor_to_buffer
from specmesh.protocol.messages import DraftSync, SamplingParams
from specmesh.protocol.transport import InProcHub
from helpers.models import tiny_llama


# -- resident bytes ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Blocks:  # the shape of kernels.gguf_matmul.BlockWeight: tensors in dataclass fields
    scale: torch.Tensor
    qs: torch.Tensor


def test_resident_bytes_counts_each_storage_once():
    lin = torch.nn.Linear(8, 4, bias=False)  # 32 float32 weights: 128 bytes
    tied = torch.nn.Module()
    tied.a, tied.b = lin, torch.nn.Linear(8, 4, bias=False)
    tied.b.weight = lin.weight  # tied: one storage
    assert resident_bytes(lin) == 128
    assert resident_bytes(tied) == 128
    assert resident_bytes(lin, lin.weight, lin.weight[:2]) == 128  # views of the same storage
    # blocks attached to a module (as quantize_head attaches them) count too
    lin.blocks = (_Blocks(torch.zeros(4, 1, dtype=torch.float16), torch.zeros(4, 8,
                                                                              dtype=torch.int8)),
                  (0, 0))
    assert resident_bytes(lin) == 128 + 8 + 32
    lin.register_buffer("ids", torch.arange(5))  # int64 buffer: 40 bytes
    assert resident_bytes(lin) == 128 + 8 + 32 + 40
    assert resident_bytes(object(), None, 3) == 0


def test_costs_leave_out_what_a_method_does_not_report():
    class Silent:
        pass

    assert drafter_costs(Silent()) == {}
    assert drafter_costs(NgramProposer()) == dict.fromkeys(COST_FIELDS, 0)
    assert drafter_costs(SuffixProposer()) == dict.fromkeys(COST_FIELDS, 0)


# -- model methods ----------------------------------------------------------------------------

V, D = 40, 32


def _eagle_head():
    torch.manual_seed(0)
    cfg = EagleHeadConfig(hidden_size=D, num_heads=4, num_kv_heads=2, head_dim=8,
                          intermediate_size=48, vocab_size=V, draft_vocab_size=30)
    head = EagleHead(cfg).double()
    emb = torch.randn(V, D, dtype=torch.float64)
    head.set_target_weights(emb, emb.clone(), torch.randperm(V)[:30])
    return head.eval()


def test_eagle_chain_pays_a_forward_per_draft_and_reports_its_kv():
    head = _eagle_head()
    p = EagleProposer(head_module=head)
    params = sum(t.numel() * t.element_size() for t in head.parameters())
    assert p.draft_weights_bytes >= params > 0
    assert (p.num_draft_forwards, p.draft_kv_pool_bytes) == (0, 0)
    prompt = [3, 7, 1, 9, 4]
    ctx = prompt + [11]
    p.open("r", ctx)
    p.observe_seed_state("r", len(prompt) - 1, torch.randn(1, D, dtype=torch.float64))
    assert len(p.propose("r", ctx, 4)) == 4
    # one head forward over the true state, then one per further draft: kappa forwards
    assert p.num_draft_forwards == 4
    held = sum(t.untyped_storage().nbytes()
               for t in (*p.states["r"].kv.key_buffers, *p.states["r"].kv.value_buffers))
    assert p.draft_kv_pool_bytes == held > 0
    # two requests in one call: one forward per round for both
    p.open("s", ctx)
    p.observe_seed_state("s", len(prompt) - 1, torch.randn(1, D, dtype=torch.float64))
    p.close("r")
    p.open("r", ctx)
    p.observe_seed_state("r", len(prompt) - 1, torch.randn(1, D, dtype=torch.float64))
    p.propose_many([ProposeCall("r", ctx, 3), ProposeCall("s", ctx, 3)])
    assert p.num_draft_forwards == 4 + 3
    p.close("r")
    p.close("s")
    assert p.draft_kv_pool_bytes >= held  # the most held at once, kept after the close


def test_eagle_tree_counts_one_forward_per_depth_for_the_batch():
    prompt = [3, 7, 1, 9, 4]
    ctx = prompt + [11]

    def proposer(requests):
        p = EagleProposer(head_module=_eagle_head(), topk=3)
        for r in requests:
            p.open(r, ctx)
            p.observe_seed_state(r, len(prompt) - 1, torch.randn(1, D, dtype=torch.float64))
        return p

    one = proposer("a")
    one.propose_trees([ProposeCall("a", ctx, 3)])
    assert one.num_tree_forwards > 0
    # one catch-up forward over the true state, then the tree's depth forwards
    assert one.num_draft_forwards == 1 + one.num_tree_forwards
    two = proposer("ab")
    two.propose_trees([ProposeCall("a", ctx, 3), ProposeCall("b", ctx, 3)])
    # grown in lockstep: the batch's depth forwards count once, not once per request
    assert 1 + two.num_tree_forwards // 2 <= two.num_draft_forwards < 1 + two.num_tree_forwards


def _medusa():
    torch.manual_seed(0)
    h = MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=30, num_heads=3, tree=((0,),)))
    h.set_target_weights(torch.randn(30, 8))
    return h.eval().requires_grad_(False)


def test_medusa_one_forward_per_batched_head_run_and_no_kv():
    h = _medusa()
    p = MedusaProposer(heads_module=h)
    assert p.draft_weights_bytes == resident_bytes(h) > 0 and p.draft_kv_pool_bytes == 0
    for i in range(2):
        p.open(f"r{i}", [1, 2, 3])
        p.observe_seed_state(f"r{i}", 1, torch.randn(1, 8))
    p.propose_many([ProposeCall(f"r{i}", [1, 2, 3], 2) for i in range(2)])
    assert p.num_draft_forwards == 1
    p.propose_many([ProposeCall("r0", [1, 2, 3], 2)])  # nothing new to run
    assert p.num_draft_forwards == 1


@pytest.fixture(scope="module")
def tiny():
    _, model, cfg = tiny_llama(seed=4, dtype=torch.float64, vocab_size=128)
    return model, cfg


def _kv_bytes(cfg, num_blocks: int, block_size: int) -> int:
    return cfg.num_layers * 2 * num_blocks * block_size * cfg.num_kv_heads * cfg.head_dim * 8


def test_pard_one_forward_per_block_and_its_preallocated_pool(tiny):
    model, cfg = tiny
    p = PardProposer(model, cfg, 126, 4, num_blocks=64, block_size=4)
    assert p.draft_kv_pool_bytes == _kv_bytes(cfg, 64, 4)
    assert p.draft_weights_bytes == resident_bytes(model) > 0
    p.propose("r", list(range(9)), 3)
    assert p.num_draft_forwards == p.stats.num_forwards == 1


def test_draft_model_a_forward_per_draft(tiny):
    model, cfg = tiny
    p = DraftModelProposer(dtype="float64", loaded=model, num_blocks=32, block_size=4)
    assert p.draft_kv_pool_bytes == _kv_bytes(cfg, 32, 4)
    assert len(p.propose("r", list(range(9)), 3)) == 3
    assert p.num_draft_forwards == 3  # the context's forward drafts the first


# -- the drafter worker and role ----------------------------------------------------------------


def _worker(proposer, method):
    hub = InProcHub()
    v = hub.mailbox("verifier-0")
    d = DrafterWorker(DrafterConfig(method=method, window=3, max_segment=3),
                      hub.mailbox("drafter-0"), proposer)
    return v, d


def test_worker_counts_the_methods_forwards_per_step():
    v, d = _worker(MedusaProposer(heads_module=_medusa()), "medusa")
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=[4, 5, 6, 7],
                                  committed_token_ids=[9], sampling=SamplingParams(),
                                  seed_state=tensor_to_buffer(torch.randn(1, 8))))
    d.step()
    assert d.profile.counters["draft_forwards"] == 1
    d.step()  # nothing new: no forward, no count
    assert d.profile.counters["draft_forwards"] == 1
    v, d = _worker(NgramProposer(), "ngram")  # no model: no counter at all
    v.send("drafter-0", DraftSync(request_id="r", prompt_token_ids=[4, 5, 4, 5, 4],
                                  committed_token_ids=[5], sampling=SamplingParams()))
    d.step()
    assert "draft_forwards" not in d.profile.counters


def test_drafter_role_stats_carry_the_costs():
    """The drafter role's ``stats()`` (what the bench reads) adds the fields its method
    reports."""
    from types import SimpleNamespace

    from specmesh.cluster.hosts.drafter import DrafterHost

    _, d = _worker(MedusaProposer(heads_module=_medusa()), "medusa")
    host = object.__new__(DrafterHost)
    host.worker, host.num_calls = d, 0
    host.mailbox = SimpleNamespace(num_protocol_errors=0, num_refused_peers=0,
                                   num_failed_handshakes=0, curve=False, dealers={},
                                   dealer_peers={}, ready=lambda p: False)
    stats = host.stats()
    assert stats["draft_weights_bytes"] == resident_bytes(d.proposer.heads)
    assert stats["draft_kv_pool_bytes"] == 0 and stats["num_draft_forwards"] == 0
