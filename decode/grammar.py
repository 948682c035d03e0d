"""Structured output on the verifier: each constrained request's matcher (engine/grammar.py)
through the step, as vLLM's structured-output manager does under speculation.

- planning (:meth:`VerifierGrammars.valid_drafts`, the scheduler's ``draft_limit``): drafts
  from the first one the grammar refuses are cut before the verify forward (they could never
  be accepted), and so are drafts past the token that completes the grammar;
- the forward's logits (:meth:`VerifierGrammars.mask_logits`, from the verify step): row i of
  a request's chunk gets the mask of the matcher state after drafts ``d_0 .. d_{i-1}``, set to
  -inf in place before the verification rule, so whatever the rule commits (accepted drafts,
  the bonus or the recovered token) is a token the grammar allows there;
- the commit (:meth:`VerifierGrammars.commit`): the matcher advances over the committed tokens
  only (rolled back over any it advanced past the commit's cut), and the request finishes
  with ``stop`` once the grammar is complete (the token that completes it is the last).

So the matcher always sits at the committed output, and a constrained request's output is
the same with speculation on or off (tests/decode/test_grammar.py).
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from specmesh.decode.request import Request
from specmesh.engine.grammar import GrammarCompiler, RequestGrammar, apply_masks
from specmesh.protocol.enums import FinishReason
from specmesh.protocol.messages import SamplingParams


class VerifierGrammars:
    """The verifier's grammar work. ``compiler`` (None: this verifier has no tokenizer, and
    refuses constrained requests) compiles each request's GrammarSpec on a worker thread from
    its arrival (:meth:`open`), so the compile overlaps its prefill."""

    def __init__(self, compiler: GrammarCompiler | None = None) -> None:
        self.compiler = compiler

    def refuse_reason(self, sampling: SamplingParams) -> str:
        """Why a request with this sampling cannot be served here ("" when it can)."""
        if sampling.grammar is not None and self.compiler is None:
            return "structured output needs the model's tokenizer on the verifier"
        return ""

    def open(self, req: Request) -> None:
        """Start compiling ``req``'s grammar (no-op for an unconstrained request)."""
        spec = req.sampling.grammar
        if spec is not None and self.compiler is not None and req.grammar is None:
            req.grammar = self.compiler.submit(spec)

    @staticmethod
    def matcher(req: Request) -> RequestGrammar | None:
        """``req``'s matcher (waiting for its compile if still running), None when it has
        none.

        Raises:
            ValueError: its grammar did not compile.
        """
        g = req.grammar
        if isinstance(g, Future):
            g = req.grammar = g.result()
        return g

    def valid_drafts(self, req: Request, draft_token_ids: list[int]) -> int:
        """How many leading drafts of ``req`` are worth verifying (all, unconstrained)."""
        if req.sampling.grammar is None or not draft_token_ids:
            return len(draft_token_ids)
        try:
            g = self.matcher(req)
        except ValueError:
            return 0  # it fails at its commit
        return len(draft_token_ids) if g is None else g.valid_drafts(draft_token_ids)

    def mask_logits(self, requests: list[Request], drafts: list[list[int]],
                    target_logits: torch.Tensor) -> None:
        """Mask the verify chunk rows of every constrained request in place:
        ``target_logits`` [sum(len(d) + 1), vocab] holds the requests' chunks in order."""
        offset = 0
        for req, d in zip(requests, drafts):
            rows = len(d) + 1
            if req.sampling.grammar is not None:
                try:
                    g = self.matcher(req)
                except ValueError:
                    g = None  # did not compile: its commit ends it with the error
                if g is not None:
                    apply_masks(target_logits[offset:offset + rows],
                                g.masks(d, target_logits.device))
            offset += rows

    def commit(self, req: Request, token_ids: list[int],
               eos_token_ids: frozenset[int]) -> list[int]:
        """``req.commit`` of ``token_ids`` with the grammar: the output ends at the token that
        completes it (finish reason ``stop``), and the matcher advances over exactly the
        tokens committed. A token the grammar refuses (only a role sampling without the mask
        can produce one) or a grammar that did not compile ends the request with an error.
        Returns the tokens committed."""
        if req.sampling.grammar is None:
            return req.commit(token_ids, eos_token_ids)
        try:
            g = self.matcher(req)
        except ValueError as err:
            req.finish_reason, req.error = FinishReason.ERROR, f"grammar: {err}"
            return []
        n = g.advance(token_ids)
        committed = req.commit(token_ids[:n], eos_token_ids)
        g.rollback(n - len(committed))  # advanced past max_tokens / a stop token
        if req.finish_reason is None and g.done:
            req.finish_reason = FinishReason.STOP
        elif req.finish_reason is None and n < len(token_ids):
            req.finish_reason = FinishReason.ERROR
            req.error = f"token {token_ids[n]} breaks the request's grammar"
        return committed
