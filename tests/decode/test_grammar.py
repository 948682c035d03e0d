"""Structured output on the verifier, unit level (SmolLM2's tokenizer, no model): the matcher
always sits at the committed tokens (a draft rejected mid-way leaves it exactly where plain
decoding of the committed tokens leaves it), masks per verified row, drafts the grammar refuses
cut in the plan, and the output ends where the grammar completes."""

from __future__ import annotations

import json

import pytest
import torch

from specmesh.decode.config import VerifierConfig
from specmesh.decode.grammar import VerifierGrammars
from specmesh.decode.request import Request, RequestStatus
from specmesh.decode.scheduler import Scheduler
from specmesh.engine.block_manager import BlockManager
from specmesh.engine.grammar import GrammarCompiler, apply_masks
from specmesh.protocol.enums import FinishReason
from specmesh.protocol.messages import GrammarSpec, SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "kind": {"enum": ["dog", "cat"]}}}
SPEC = GrammarSpec(kind="json_schema", value=json.dumps(SCHEMA))
EOS = 2


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, (EOS,), len(tok) + 7)  # logits wider than the tokenizer


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _request(max_tokens: int = 64) -> Request:
    req = Request("r", "gw", [1, 2, 3], SamplingParams(max_tokens=max_tokens, grammar=SPEC), 4)
    req.status = RequestStatus.RUNNING
    return req


def _state(g) -> tuple:
    """What decides everything a matcher does next: its mask, whether it may end, is done."""
    return (g.masks([]).nonzero().flatten().tolist(), g.matcher.is_accepting(), g.done)


def test_a_draft_rejected_mid_string_leaves_the_matcher_where_plain_decoding_does(tok, compiler):
    grammars = VerifierGrammars(compiler)
    prefix = _ids(tok, '{"name":"bo')
    drafts = _ids(tok, 'bby fox","kind":"dog"}')
    assert len(drafts) >= 4
    req = _request()
    grammars.open(req)
    assert grammars.commit(req, prefix, frozenset({EOS})) == prefix
    g = grammars.matcher(req)
    # the verify step looks ahead over every draft (row masks), then the rule accepts two and
    # recovers a token of its own, mid-string
    masks = g.masks(drafts)
    assert masks.shape == (len(drafts) + 1, compiler.vocab_size)
    assert all(masks[i, drafts[i]] for i in range(len(drafts)))
    recovered = _ids(tok, "x")[0]
    assert masks[2, recovered] and recovered != drafts[2]
    out = drafts[:2] + [recovered]
    assert grammars.commit(req, out, frozenset({EOS})) == out
    plain = compiler.matcher(SPEC)
    assert plain.advance(prefix + out) == len(prefix + out)
    assert _state(g) == _state(plain)
    # both go on the same way to the end
    rest = _ids(tok, '","kind":"cat"}')
    assert g.valid_drafts(rest) == plain.valid_drafts(rest) == len(rest)
    assert grammars.commit(req, rest + [EOS], frozenset({EOS})) == rest
    assert req.finish_reason == FinishReason.STOP and g.done


def test_masks_row_i_is_the_state_after_the_first_i_drafts(tok, compiler):
    drafts = _ids(tok, '{"name":"a","kind":"')
    g = compiler.matcher(SPEC)
    masks = g.masks(drafts)
    for i in range(len(drafts) + 1):
        plain = compiler.matcher(SPEC)
        plain.advance(drafts[:i])
        assert torch.equal(masks[i], plain.masks([])[0]), i
    assert _state(g) == _state(compiler.matcher(SPEC))  # looking ahead changed nothing
    # ids past the tokenizer are never allowed; EOS only where the grammar may end
    assert not masks[:, len(tok):].any()
    assert not masks[:, EOS].any()
    logits = torch.zeros(len(drafts) + 1, compiler.vocab_size)
    apply_masks(logits, masks)
    assert torch.equal(torch.isfinite(logits), masks)


def test_drafts_are_cut_at_the_first_refused_one_and_after_completion(tok, compiler):
    grammars = VerifierGrammars(compiler)
    req = _request()
    grammars.open(req)
    good = _ids(tok, '{"name":"a"')
    assert grammars.valid_drafts(req, good + _ids(tok, "}")) == len(good)  # kind missing
    done = _ids(tok, '{"name":"a","kind":"cat"}')
    assert grammars.valid_drafts(req, done + [EOS, EOS]) == len(done)
    assert grammars.valid_drafts(req, _ids(tok, "[1]")) == 0
    # the plan verifies only what survives the cut
    sched = Scheduler(VerifierConfig(num_speculative_tokens=8, adaptive_drafts=False,
                                     goodput_drafts=False), BlockManager(64, 16))
    sched.draft_limit = grammars.valid_drafts
    req.drafter = "d"
    req.output_token_ids = [good[0]]
    grammars.commit(req, [], frozenset({EOS}))  # nothing: it stays at the start
    g = grammars.matcher(req)
    g.advance([good[0]])
    req.block_table = sched.block_manager.allocate(1)
    req.num_reserved_blocks = 4
    req.tail.reset(req.committed_len)
    # refused after good[1:]
    req.tail.add(1, good[1:] + _ids(tok, "}") + good[1:], req.output_token_ids,
                 base_committed_len=1)
    plan = sched.plan([req])
    assert plan[0].draft_token_ids == good[1:]


def test_the_output_ends_where_the_grammar_completes_even_mid_step(tok, compiler):
    grammars = VerifierGrammars(compiler)
    req = _request()
    grammars.open(req)
    done = _ids(tok, '{"name":"a","kind":"dog"}')
    # a verify step whose accepted drafts complete the grammar and whose bonus is EOS: the
    # output ends at "}" as plain decoding ends it (no EOS step after it)
    assert grammars.commit(req, done + [EOS], frozenset()) == done
    assert req.finish_reason == FinishReason.STOP and req.output_token_ids == done


def test_a_cut_at_max_tokens_rolls_the_matcher_back(tok, compiler):
    grammars = VerifierGrammars(compiler)
    req = _request(max_tokens=3)
    grammars.open(req)
    ids = _ids(tok, '{"name":"abc","kind":"dog"}')
    assert grammars.commit(req, ids, frozenset({EOS})) == ids[:3]
    assert req.finish_reason == FinishReason.LENGTH
    plain = compiler.matcher(SPEC)
    plain.advance(ids[:3])
    assert _state(grammars.matcher(req)) == _state(plain)


def test_a_broken_spec_fails_the_request_not_the_verifier(compiler):
    grammars = VerifierGrammars(compiler)
    req = Request("r", "gw", [1], SamplingParams(
        grammar=GrammarSpec(kind="regex", value="a(b")), 4)
    grammars.open(req)
    assert grammars.valid_drafts(req, [5, 6]) == 0
    assert grammars.commit(req, [5], frozenset()) == []
    assert req.finish_reason == FinishReason.ERROR and "unclosed group" in req.error
    assert VerifierGrammars().refuse_reason(req.sampling)
