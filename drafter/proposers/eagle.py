"""EAGLE drafting: chains from a feature head over the target's hidden states.

Li et al., EAGLE (arXiv 2401.15077). Seed state ``"hidden"``: the prefill worker ships the
target's hidden state at the last prompt position, each VerifyCommit the states at the
positions whose next token it committed (docs/architecture.md, 'Messages'). Per request the proposer
keeps the
true states it was sent and the head's own KV (drafter/eagle/head.py ``HeadKV``): entries at
positions with a true state are computed from it, entries past the last true state from the
head's own predicted state (the chain). When true states arrive for positions the chain had
predicted, those entries are dropped and recomputed (one batched head forward); a rollback
drops the entries whose tokens the commit rejected. Drafts are chains over the head's draft
vocabulary, chosen for the request's sampling (drafter/draft_sampling.py): argmax for greedy
requests, the coupled rule's Gumbel-max for seeded ones, a sample of the processed head
distribution (sent as the draft's row) for unseeded sampled ones.

A multi-layer head (``num_steps`` > 1, drafter/eagle/steps.py) keeps a KV per module and runs
module i at depth i (drafter/eagle/step_draft.py); its resident weights, KV pool and each
module's milliseconds per drafting call are in :meth:`EagleProposer.draft_stats`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specmesh.drafter.draft_memory import resident_bytes
from specmesh.drafter.draft_sampling import DraftSampling, target_space_logits, token_probs
from specmesh.drafter.eagle.checkpoint import (
    load_head,
    read_head_config,
    target_embeddings,
    target_identity,
)
from specmesh.drafter.eagle.head import EagleHead, HeadKV
from specmesh.drafter.eagle.prefill_seed import adopt_seed, make_seed
from specmesh.drafter.eagle.quantize import quantize_head
from specmesh.drafter.eagle.step_draft import (StepChains, StepClock, StepState,
                                               catch_up_steps, kv_pool_bytes, truncate_steps)
from specmesh.drafter.eagle.steps import step_weight_bytes
from specmesh.drafter.eagle.tree_draft import MAX_TOPK, TreeJob, draft_trees
from specmesh.drafter.options import Option, OptionSchema
from specmesh.drafter.proposer import (BranchCall, DraftTarget, ProposeCall, Proposer,
                                       shipped_or_raise)
from specmesh.drafter.registry import register_proposer
from specmesh.drafter.training.eagle import train_eagle_head
from specmesh.engine.backend import CpuBackend
from specmesh.engine.config import ModelConfig
from specmesh.engine.dtypes import MODEL_DTYPES, model_dtype
from specmesh.engine.loader import model_files, model_identity
from specmesh.engine.sampling import GREEDY

log = logging.getLogger(__name__)

#: where shipped heads live: <dir>/<target name, lower case>/ (a multi-layer head of N modules:
#: <dir>/<target name, lower case>-eagle-<N>step/)
SHIPPED_HEADS = Path(__file__).resolve().parent.parent / "heads"


def shipped_head(target_name: str, num_steps: int = 1) -> Path | None:
    """The head of ``num_steps`` modules shipped for the target called ``target_name``, or
    None."""
    name = target_name.lower() + (f"-eagle-{num_steps}step" if num_steps > 1 else "")
    p = SHIPPED_HEADS / name
    return p if (p / "config.json").is_file() else None


@dataclass
class _HeadState:
    feats_start: int = -1  # position of the first true state held
    feats: list[torch.Tensor] = field(default_factory=list)  # true states, [d] each
    kv: HeadKV = field(default_factory=HeadKV)
    entry_tokens: list[int] = field(default_factory=list)  # token each entry read
    outs: list[torch.Tensor] = field(default_factory=list)  # predicted state out of each entry
    steps: list[StepState] = field(default_factory=list)  # modules 1.. of a multi-layer head
    # a multi-layer head's chain past its anchor (the context length whose last true state
    # module 0 read): tokens whose entries ran, and the state after each (EagleProposer.chains)
    chain_anchor: int = -1
    chain_tokens: list[int] = field(default_factory=list)
    chain_states: list[torch.Tensor] = field(default_factory=list)

    @property
    def last_g(self) -> torch.Tensor | None:
        return self.outs[-1] if self.outs else None

    @property
    def feats_end(self) -> int:
        return self.feats_start + len(self.feats)


@dataclass
class _Cursor:
    """One request's progress through a :meth:`EagleProposer.propose_many` call: ``s`` the
    position of the next head entry."""

    call: ProposeCall
    st: _HeadState
    L: int
    s: int


def _train(prep: dict, args) -> dict:  # noqa: ANN001
    """``specmesh train-drafter --method eagle``: drafter/training/eagle.py."""
    return train_eagle_head(prep, args)


@register_proposer
class EagleProposer(Proposer):
    """Kwargs: ``head`` (checkpoint dir; default: the head shipped for the target), ``model``
    (the target: "smollm2", a .gguf or a HF dir, of which only the embedding and LM head are
    read), ``dtype`` of the head ("float32"), or ``head_module`` (a loaded
    :class:`EagleHead`, tests); ``backend``: the CPU backend the head computes with
    (engine/backend.py; None: the process's default; the drafter role passes its cluster's).

    Raises:
        drafter.eagle.checkpoint.HeadMismatch: the head was trained for another target.
        FileNotFoundError: no head given and none shipped for the target.
    """

    name = "eagle"
    summary = ("EAGLE feature head over the target's hidden states (the head shipped for the "
               "target, or one from specmesh train-drafter)")
    options = OptionSchema((
        Option("head", "path", "the head's checkpoint directory (specmesh train-drafter "
               "--method eagle --out DIR)", "the head shipped for the target", positional=True),
        Option("dtype", str, "dtype of the head's weights", "the cluster's dtype",
               choices=tuple(d for d in MODEL_DTYPES if d != "float16")),
        Option("topk", int, "EAGLE-2 draft trees: children per expanded node and nodes "
               "expanded per depth (SGLang's --speculative-eagle-topk; 1: chains)", 1,
               minimum=1, maximum=MAX_TOPK, flag="--eagle-topk"),
        Option("nodes", int, "EAGLE-2 draft trees: most nodes of a tree, the best by "
               "cumulative draft probability (SGLang's --speculative-num-draft-tokens "
               "less the root)", "topk * depth", kwarg="tree_nodes", minimum=1,
               flag="--eagle-tree-nodes"),
        Option("steps", int, "modules of the shipped head when no head is given (multi-layer "
               "EAGLE: module i drafts depth i; 2: the two-module head shipped for the "
               "target)", 1, kwarg="num_steps", minimum=1, maximum=8),
    ))
    trainer = staticmethod(_train)
    max_drafts_per_call = 1  # a forward per draft: stream each one as it is made
    seed_state = "hidden"
    returns_draft_probs = True
    returns_token_probs = True
    runs_a_model = True
    makes_prefill_seed = True  # the first entry runs at the prefill (drafter/eagle/prefill_seed.py)

    def __init__(self, head: str | None = None, model: str | None = None,
                 dtype: str = "float32", head_module: EagleHead | None = None,
                 backend: CpuBackend | None = None, topk: int = 1,
                 tree_nodes: int | None = None, num_steps: int = 1) -> None:
        if not 1 <= topk <= MAX_TOPK or (tree_nodes is not None and tree_nodes < 1):
            raise ValueError(f"need 1 <= topk <= {MAX_TOPK} and tree_nodes >= 1, got "
                             f"topk {topk}, tree_nodes {tree_nodes}")
        self.topk, self.tree_nodes = topk, tree_nodes
        #: topk 1 drafts today's chains, bit for bit; above it the segment at the committed
        #: prefix is an EAGLE-2 tree (drafter/eagle/tree_draft.py)
        self.draft_shape = "tree" if topk > 1 else "chain"
        self.num_tree_forwards = 0  # tree-depth forwards run (metrics, tests)
        self.head = head_module if head_module is not None else load_eagle_head(
            head, model, dtype, backend, num_steps)
        self.seed_state = self.head.config.seed_state  # "hidden" or "hidden:L1,L2,L3"
        self.seed_hidden_size = self.head.config.seed_width  # the drafter checks row widths
        self.states: dict[str, _HeadState] = {}
        self.num_recomputed_entries = 0
        self.num_prefill_seeds_adopted = 0  # first entries taken from the prefill's DraftSeed
        #: drafter/draft_memory.py: the head's resident weights (the target's embedding and LM
        #: head rows it reads included), head forwards run (one per batched extend, tree depth
        #: or branch peek) and the most bytes its per-request KV buffers held at once (no
        #: preallocated pool: they grow per request)
        self.draft_weights_bytes = resident_bytes(self.head)
        self.clock = StepClock(self.head.config.num_steps)  # per-module time (draft_stats)
        self._module0_forwards = 0  # module 0's forwards and the trees' depth forwards
        self._kv_peak = 0  # the most bytes held, sampled when a request closes
        self.chains = StepChains(self.head, self.clock)  # multi-layer heads' chains, by request

    @property
    def num_draft_forwards(self) -> int:
        """Head forwards run (one per batched extend, tree depth or branch peek): module 0's
        and the trees' as they run, plus a multi-layer head's modules 1.. (their chains and
        catch-ups, timed and counted by the step clock)."""
        return self._module0_forwards + sum(self.clock.forwards[1:])

    @num_draft_forwards.setter
    def num_draft_forwards(self, value: int) -> None:
        self._module0_forwards = value - sum(self.clock.forwards[1:])

    @classmethod
    def create(cls, kwargs: dict, target: DraftTarget) -> EagleProposer:
        """The head of ``kwargs`` (``head``: default the one shipped for the target; ``dtype``:
        default the cluster's, so a bfloat16 cluster drafts with bfloat16 weights: half the
        bytes per draft, which the drafter's core otherwise pulls through the memory bus the
        verifier's forward is bound by); only the target's embedding and LM head are read
        from ``target.model``'s weights, and a head trained for another target is refused
        (:class:`~drafter.eagle.checkpoint.HeadMismatch`)."""
        return cls(**{"model": target.model, "dtype": target.dtype,
                      "backend": target.backend, **kwargs})

    @classmethod
    def seed_state_for(cls, kwargs: dict, target: DraftTarget | None = None) -> str:
        """The seed state a drafter built with ``kwargs`` needs: the head's (read from its
        config.json, no weights loaded); ``"hidden"`` when no head can be found (the drafter
        then fails at startup with the reason)."""
        if kwargs.get("head_module") is not None:
            return kwargs["head_module"].config.seed_state
        try:
            model = kwargs.get("model", target.model if target is not None else None)
            path = kwargs.get("head") or _shipped_head_for(model, kwargs.get("num_steps", 1))
            return read_head_config(path).seed_state if path else cls.seed_state
        except (OSError, ValueError) as err:
            log.warning("EAGLE seed state: %s; assuming %r", err, cls.seed_state)
            return cls.seed_state

    # -- interface -------------------------------------------------------------------------

    def _new_state(self, feats_start: int = -1) -> _HeadState:
        return _HeadState(feats_start=feats_start, steps=[
            StepState() for _ in range(self.head.config.num_steps - 1)])

    def open(self, request_id: str, context_token_ids: list[int]) -> None:
        self.states[request_id] = self._new_state()

    def observe_seed_state(self, request_id: str, start_position: int, hidden) -> None:  # noqa: ANN001
        st = self.states.get(request_id)
        if st is None:
            return
        with torch.inference_mode():
            rows = list(self.head.seed_features(hidden.detach()))
        if st.feats_start < 0 or not st.feats_start <= start_position <= st.feats_end:
            # the first states, or a gap: restart the request's head state from these
            self.states[request_id] = st = self._new_state(start_position)
        old_end = st.feats_end
        keep = start_position - st.feats_start
        st.feats[keep:] = rows
        if st.kv.end > old_end:  # entries computed from predicted states: recompute them
            self.num_recomputed_entries += st.kv.end - old_end
            self._truncate(st, old_end)

    def make_prefill_seed(self, request_id: str, context_token_ids: list[int],
                          hidden, topk: int):  # noqa: ANN001, ANN201
        """The head's entry at the last prompt position as a DraftSeed (run at the prefill;
        drafter/eagle/prefill_seed.py ``make_seed``)."""
        return make_seed(self, request_id, context_token_ids, hidden, topk)

    def adopt_prefill_seed(self, request_id: str, context_token_ids: list[int],
                           seed) -> bool:  # noqa: ANN001
        """Install the prefill's DraftSeed instead of running that entry (drafter/eagle/
        prefill_seed.py ``adopt_seed``); counted in ``num_prefill_seeds_adopted``."""
        adopted = adopt_seed(self, request_id, context_token_ids, seed)
        self.num_prefill_seeds_adopted += adopted
        return adopted

    def propose(self, request_id: str, context_token_ids: list[int], num_tokens: int) -> list[int]:
        return self._draft(request_id, context_token_ids, num_tokens, None)[0]

    def propose_sampled(self, request_id: str, context_token_ids: list[int], num_tokens: int,
                        how: DraftSampling) -> tuple[list[int], list[torch.Tensor | None]]:
        """Drafts for ``how`` (module docstring); a row is float32 ``[target vocab_size]``,
        zero outside the head's draft vocabulary."""
        return self._draft(request_id, context_token_ids, num_tokens, how)

    def _pick(self, g: torch.Tensor, how: DraftSampling | None,
              index: int) -> tuple[int, torch.Tensor | None]:
        head = self.head
        if how is None or (how.mode == GREEDY and not how.processes):
            logits = head.logits(g).reshape(1, -1)  # [1, draft vocab]
            best = int(logits[0].argmax())
            q = token_probs(logits, [best])[0] if how is not None and how.token_probs else None
            return int(head.target_ids(torch.tensor(best))), q
        full = target_space_logits(head.logits(g).reshape(1, -1), head.config.vocab_size,
                                   head.draft_to_target)
        return how.choose(full, index)

    def _draft(self, request_id: str, context_token_ids: list[int], num_tokens: int,
               how: DraftSampling | None) -> tuple[list[int], list[torch.Tensor | None]]:
        return self.propose_many([ProposeCall(request_id, context_token_ids, num_tokens,
                                              how)])[0]

    def propose_many(self, calls: list[ProposeCall]
                     ) -> list[tuple[list[int], list[torch.Tensor | None]]]:
        """Drafts for several requests with one head forward per round for all of them
        (:meth:`EagleHead.extend_many`) and one LM-head product per draft depth for the
        greedy ones: the head's weights are read once per round, not once per request.
        Each request's drafts are those :meth:`propose` / :meth:`propose_sampled` give it
        alone (the head's products are row-invariant). A multi-layer head drafts depth j
        with its module j (:meth:`_propose_steps`)."""
        if self.head.config.num_steps > 1:
            return self._propose_steps(calls)
        self.clock.calls += 1
        out: list[tuple[list[int], list[torch.Tensor | None]]] = [([], []) for _ in calls]
        live = self._cursors(calls)
        with torch.inference_mode():
            self._catch_up(live)
            while live:
                picks = self._pick_many(live, {i: len(out[i][0]) for i in live})
                work = {}
                for i, cur in list(live.items()):
                    tok, row = picks[i]
                    out[i][0].append(tok)
                    out[i][1].append(row)
                    if len(out[i][0]) == cur.call.num_tokens:
                        del live[i]
                    else:
                        work[i] = (cur.st.last_g[None], [tok], cur.s)
                        cur.s += 1
                if work:
                    self._extend_many(live, work)
        return out

    def _propose_steps(self, calls: list[ProposeCall]
                       ) -> list[tuple[list[int], list[torch.Tensor | None]]]:
        """:meth:`propose_many` of a multi-layer head. Module 0 reads only true states; every
        module is caught up to the request's anchor (the context up to the position after its
        last true state, drafter/eagle/step_draft.py); the context's tokens past the anchor
        (the drafter's own path: the worker drafts a chain one call per draft) and then the
        drafts run as one chain, its entry at depth j by module ``step_of_depth(j)``, kept
        between calls while the path continues it. One forward per module and round for all
        requests; a "stop" head drafts nothing past its last module."""
        self.clock.calls += 1
        out: list[tuple[list[int], list[torch.Tensor | None]]] = [([], []) for _ in calls]
        live = self._cursors(calls)
        with torch.inference_mode():
            self._catch_up(live, chain=False)
            anchors = self._anchor_steps(live)
            while True:  # the chain over the path's tokens (none when the cache has them)
                reqs = {}
                for i, cur in live.items():
                    n = len(cur.st.chain_tokens)
                    if n < cur.L - anchors[i]:
                        reqs[i] = cur.call.context_token_ids[anchors[i] + n]
                if not reqs:
                    break
                self._advance_chains(live, anchors, reqs)
            while live:
                picks = self._pick_many(live, {i: len(out[i][0]) for i in live},
                                        {i: cur.st.chain_states[-1] for i, cur in live.items()})
                reqs = {}
                for i, cur in live.items():
                    tok, row = picks[i]
                    out[i][0].append(tok)
                    out[i][1].append(row)
                    if len(out[i][0]) < cur.call.num_tokens:
                        reqs[i] = tok
                live = {i: live[i] for i in reqs}
                self._advance_chains(live, anchors, reqs)
        return out

    def _anchor_steps(self, live: dict[int, _Cursor]) -> dict[int, int]:
        """Each live request's anchor (module 0 caught up to its true states), modules 1..
        caught up to it, and its chain cache kept when it still continues the context (else
        started over from module 0's last state); a request module 0 cannot draft for
        leaves ``live``."""
        anchors = {}
        for i, cur in list(live.items()):
            st = cur.st
            anchors[i] = a = min(st.feats_end, cur.L - 1) + 1
            if st.last_g is None or st.kv.end != a - 1:
                del live[i]
        catch_up_steps(self.head, [([cur.st, *cur.st.steps], cur.call.context_token_ids[
            :anchors[i]]) for i, cur in live.items()], self.clock)
        for i, cur in live.items():
            st, a, ctx = cur.st, anchors[i], cur.call.context_token_ids
            n = len(st.chain_tokens)
            if st.chain_anchor != a or not st.chain_states or n > cur.L - a \
                    or st.chain_tokens != ctx[a:a + n]:
                self.chains.drop(cur.call.request_id)
                st.chain_anchor, st.chain_tokens, st.chain_states = a, [], [st.last_g]
        return anchors

    def _advance_chains(self, live: dict[int, _Cursor], anchors: dict[int, int],
                        tokens: dict[int, int]) -> None:
        """One chain entry per request of ``tokens`` (request index -> the token it reads);
        a request whose chain cannot go deeper (a "stop" head's last module) leaves
        ``live``."""
        reqs = {live[i].call.request_id: ([live[i].st, *live[i].st.steps], anchors[i],
                                          live[i].st.chain_states[-1], tok,
                                          len(live[i].st.chain_states) + 1)
                for i, tok in tokens.items()}
        got = self.chains.advance(reqs)
        for i, tok in tokens.items():
            st, g = live[i].st, got.get(live[i].call.request_id)
            if g is None:
                del live[i]
            else:
                st.chain_tokens.append(tok)
                st.chain_states.append(g)

    def draft_stats(self) -> dict:
        """What the drafter's stats show of the head (cluster/hosts/drafter.py): its modules
        ``draft_num_steps``, resident weights ``draft_weights_bytes`` (parameters, the copied
        target embedding and LM-head rows, Q8_0 copies), the KV buffers its requests hold
        ``draft_kv_pool_bytes`` (every module's), per module the weight bytes one forward
        reads ``draft_step_weight_bytes`` and its mean milliseconds per drafting call
        ``draft_step_ms`` (catch-up and drafts: the numerator of its ``c_i``; their sum is
        the head's ``sum(c_i)`` times the target's step), and the prefill draft seeds it
        installed instead of running their entry ``num_prefill_seeds_adopted``."""
        for _ in range(3):  # read from the host's stats thread while the worker drafts
            try:
                kvs = [kv for st in list(self.states.values())
                       for kv in (st.kv, *(s.kv for s in st.steps))]
                chain_bytes = self.chains.nbytes()
                break
            except RuntimeError:  # the requests changed during the read: read again
                kvs, chain_bytes = [], 0
        return {"draft_num_steps": self.head.config.num_steps,
                "draft_weights_bytes": resident_bytes(self.head),
                "draft_kv_pool_bytes": kv_pool_bytes(kvs) + chain_bytes,
                "draft_step_weight_bytes": step_weight_bytes(self.head),
                "draft_step_ms": self.clock.ms_per_call(),
                "draft_step_forwards": list(self.clock.forwards),
                "num_prefill_seeds_adopted": self.num_prefill_seeds_adopted}

    def _catch_up(self, live: dict[int, _Cursor], chain: bool = True) -> None:
        """Bring each request's head KV up to its context: per request its true states in one
        batch, then (``chain``) the chain over known tokens; each round takes every request's
        next piece (one head forward for all). A request that cannot draft leaves ``live``."""
        while True:
            work = {}
            for i, cur in list(live.items()):
                piece = self._catch_up_piece(cur, chain)
                if piece is False:  # nothing to draft from
                    del live[i]
                elif piece is not None:
                    work[i] = piece
            if not work:
                return
            self._extend_many(live, work)

    def propose_tree(self, request_id: str, context_token_ids: list[int],
                     num_tokens: int) -> tuple[list[int], list[int]]:
        """An EAGLE-2 tree after the context (drafter/eagle/tree_draft.py), as for a greedy
        request: :meth:`propose_tree_sampled` without its rows."""
        tokens, parents, _ = self.propose_tree_sampled(request_id, context_token_ids,
                                                       num_tokens, None)
        return tokens, parents

    def propose_tree_sampled(self, request_id: str, context_token_ids: list[int],
                             num_tokens: int, how: DraftSampling | None
                             ) -> tuple[list[int], list[int], list[torch.Tensor | None]]:
        """An EAGLE-2 tree after the context for the sampling ``how`` (drafter/eagle/
        tree_draft.py): ``(draft_token_ids, parents, rows)``, at most ``num_tokens`` deep and
        ``tree_nodes`` large (default ``topk * num_tokens``); rows float32 ``[vocab_size]``
        for an unseeded sampled request (each node's distribution given its parent and
        earlier siblings), else None. The entries of branch 0 join the request's head KV, so
        the chains drafted after it continue from there. Empty when it cannot draft."""
        return self.propose_trees([ProposeCall(request_id, context_token_ids, num_tokens,
                                               how)])[0]

    def propose_trees(self, calls: list[ProposeCall]
                      ) -> list[tuple[list[int], list[int], list[torch.Tensor | None]]]:
        """:meth:`propose_tree_sampled` for several requests, their trees grown in lockstep:
        one head forward per depth for all of them (drafter/eagle/tree_draft.py
        ``draft_trees``), as :meth:`propose_many` batches chains. Each request gets the tree
        it gets alone."""
        out: list[tuple[list[int], list[int], list[torch.Tensor | None]]] = \
            [([], [], []) for _ in calls]
        self.clock.calls += 1
        live = self._cursors(calls)
        with torch.inference_mode():
            if self.head.config.num_steps > 1:  # a tree at the anchor only (module KVs' end)
                self._catch_up(live, chain=False)
                anchors = self._anchor_steps(live)
                live = {i: cur for i, cur in live.items() if anchors[i] == cur.L}
            else:
                self._catch_up(live)
            keys = list(live)
            jobs = [TreeJob(live[i].st.kv, live[i].st.last_g, len(calls[i].context_token_ids),
                            self.topk, calls[i].num_tokens,
                            self.tree_nodes or self.topk * calls[i].num_tokens, calls[i].how,
                            tuple(s.kv for s in live[i].st.steps))
                    for i in keys]
            drafted = draft_trees(self.head, jobs)
        # the trees grow in lockstep: one head forward per depth for all of them
        self.num_draft_forwards += max((d.num_forwards for d in drafted), default=0)
        for i, d in zip(keys, drafted):
            st = live[i].st
            self.num_tree_forwards += d.num_forwards
            st.entry_tokens.extend(d.branch0_tokens)
            st.outs.extend(d.branch0_outs)
            out[i] = (d.token_ids, d.parents, d.rows)
        return out

    def _cursors(self, calls: list[ProposeCall]) -> dict[int, _Cursor]:
        """Each call's :meth:`_cursor` by its index in ``calls``, the calls with none left out."""
        live: dict[int, _Cursor] = {}
        for i, call in enumerate(calls):
            cur = self._cursor(call)
            if cur is not None:
                live[i] = cur
        return live

    def _cursor(self, call: ProposeCall) -> _Cursor | None:
        """Where a request's drafting starts: its head entries that no longer match the
        context dropped; None when it cannot draft."""
        st = self.states.get(call.request_id)
        ctx = call.context_token_ids
        L = len(ctx)
        if st is None or st.feats_start < 0 or call.num_tokens <= 0 or L - 2 < st.feats_start:
            return None
        s0 = st.kv.start if st.kv.length else st.feats_start
        agree = 0
        for i, t in enumerate(st.entry_tokens):
            if s0 + i + 1 >= L or ctx[s0 + i + 1] != t:
                break
            agree += 1
        if agree < len(st.entry_tokens):
            self._truncate(st, s0 + agree)
        return _Cursor(call, st, L, st.kv.end if st.kv.length else st.feats_start)

    @staticmethod
    def _catch_up_piece(cur: _Cursor, chain: bool = True) -> tuple | bool | None:
        """The request's next catch-up extend ``(features, tokens, start)``, None when it is
        caught up (to its true states only without ``chain``), False when it cannot draft (no
        predicted state to chain from)."""
        st, ctx, s = cur.st, cur.call.context_token_ids, cur.s
        true_hi = min(st.feats_end, cur.L - 1)
        if s < true_hi:
            cur.s = true_hi
            return (torch.stack(st.feats[s - st.feats_start:true_hi - st.feats_start]),
                    ctx[s + 1:true_hi + 1], s)
        if chain and s <= cur.L - 2:
            if st.last_g is None:
                return False
            cur.s = s + 1
            return st.last_g[None], [ctx[s + 1]], s
        return None

    def _extend_many(self, live: dict[int, _Cursor], work: dict) -> None:
        keys = list(work)
        items = [(live[i].st.kv, work[i][0], torch.tensor(work[i][1], dtype=torch.long),
                  work[i][2]) for i in keys]
        self.num_draft_forwards += 1
        for i, g in zip(keys, self.clock.run(0, self.head.extend_many, items)):
            st = live[i].st
            st.entry_tokens.extend(work[i][1])
            st.outs.extend(g)

    def _pick_many(self, live: dict[int, _Cursor], made: dict[int, int],
                   states: dict[int, torch.Tensor] | None = None
                   ) -> dict[int, tuple[int, torch.Tensor | None]]:
        """Each live request's next draft from its last predicted state (``states``, default
        its head state's last; ``made``: drafts it got so far in this call): the greedy ones
        by one batched argmax, the others one by one (their sampling rule)."""
        last = {i: (cur.st.last_g if states is None else states[i]) for i, cur in live.items()}
        picks = {}
        greedy = [i for i, cur in live.items() if cur.call.how is None
                  or (cur.call.how.mode == GREEDY and not cur.call.how.processes)]
        if greedy:
            g = torch.stack([last[i] for i in greedy])
            logits = self.head.logits(g)  # [n, draft vocab]
            best = logits.argmax(-1)
            ids = self.head.target_ids(best).tolist()
            scored = [j for j, i in enumerate(greedy) if live[i].call.how is not None
                      and live[i].call.how.token_probs]
            qs = dict(zip(scored, token_probs(logits[scored], best[scored].tolist()))) \
                if scored else {}
            picks.update({i: (int(t), qs.get(j)) for j, (i, t) in enumerate(zip(greedy, ids))})
        for i, cur in live.items():
            if i not in picks:
                picks[i] = self._pick(last[i], cur.call.how, made[i])
        return picks

    def propose_branches(self, calls: list[BranchCall]) -> list[dict[int, list[int]]]:
        """Per call, the head's most likely tokens at the position after the context other
        than the path's (its LM head's top ``num_candidates + 1`` from the state that drafted
        the path token), each with the one draft the head makes after it: the candidates are
        read as sibling entries on the request's head KV (:meth:`EagleHead.peek_many`), all
        requests in one pass. A request whose head KV does not reach the context is skipped.
        A multi-layer head reads the candidates with its depth-2 module, on that module's KV
        (none past a 1-draft "stop" head)."""
        out: list[dict[int, list[int]]] = [{} for _ in calls]
        head = self.head
        step = head.config.step_of_depth(2)
        if step is None:
            return out
        items, where = [], []
        with torch.inference_mode():
            for i, call in enumerate(calls):
                st = self.states.get(call.request_id)
                ctx = call.context_token_ids
                s = len(ctx) - 2  # the entry whose output drafted the token after ctx
                if st is None or call.num_candidates <= 0 or not st.kv.length \
                        or not st.kv.start <= s < st.kv.end \
                        or st.entry_tokens[:s + 1 - st.kv.start] != ctx[st.kv.start + 1:s + 2]:
                    continue
                kv = st.kv if step == 0 else st.steps[step - 1].kv
                if step and not (kv.length and kv.start < s + 1 <= kv.end):
                    continue
                g = st.outs[s - st.kv.start]
                top = head.target_ids(head.logits(g[None])[0].topk(
                    min(call.num_candidates + 1, head.lm_head.shape[0])).indices).tolist()
                cands = [t for t in top if t != call.path_token_id][:call.num_candidates]
                items.append((kv, s + 1, g[None].expand(len(cands), -1),
                              torch.tensor(cands, dtype=torch.long)))
                where.append((i, cands))
            if not items:
                return out
            preds = head.peek_many(items, step)
            self.num_draft_forwards += 1
            nxt = head.target_ids(head.logits(torch.cat(preds)).argmax(-1)).tolist()
        lo = 0
        for i, cands in where:
            out[i] = {c: [nxt[lo + j]] for j, c in enumerate(cands)}
            lo += len(cands)
        return out

    def rollback(self, request_id: str, num_context_tokens: int) -> None:
        st = self.states.get(request_id)
        if st is not None:  # entry s read the token at s + 1
            self._truncate(st, num_context_tokens - 1)

    def close(self, request_id: str) -> None:
        self._kv_peak = max(self._kv_peak, self._kv_held())
        self.states.pop(request_id, None)
        self.chains.drop(request_id)

    @property
    def draft_kv_pool_bytes(self) -> int:
        """The most bytes the requests' head KV buffers held at once (no preallocated pool:
        they grow per request): read when the stats are, sampled when a request closes,
        never on the drafting path."""
        return max(self._kv_peak, self._kv_held())

    # -- internals -------------------------------------------------------------------------

    def _kv_held(self) -> int:
        return sum(t.untyped_storage().nbytes() for st in list(self.states.values())
                   for t in (*st.kv.key_buffers, *st.kv.value_buffers))

    def _truncate(self, st: _HeadState, end: int) -> None:
        if st.kv.length and end < st.kv.end:
            st.kv.truncate(end)
            keep = st.kv.length
            del st.entry_tokens[keep:]
            del st.outs[keep:]
        truncate_steps(st, st.steps, end)  # modules 1.. of a multi-layer head
        if end < st.chain_anchor - 1:  # its chain attended to dropped entries
            st.chain_anchor = -1


def _shipped_head_for(model: str | None, num_steps: int = 1) -> Path | None:
    return shipped_head(model_identity(model, "float32", 16)["name"], num_steps)


def load_eagle_head(head: str | None, model: str | None, dtype: str = "float32",
                    backend: CpuBackend | None = None, num_steps: int = 1) -> EagleHead:
    """The head at ``head`` (or the one of ``num_steps`` modules shipped for ``model``: a
    multi-layer head for more than one) with only the target's embedding
    and LM head loaded from its weights, computing with ``backend`` (engine/backend.py; None:
    the process's default); a float32 head on CPU computes on Q8_0 blocks where the backend
    has ``eagle_q8_0`` on (drafter/eagle/quantize.py).

    Raises:
        FileNotFoundError: no head given and none shipped for the target; missing weights.
        drafter.eagle.checkpoint.HeadMismatch: the head was trained for another target.
        ValueError: ``num_steps`` differs from the given head's modules.
    """
    from transformers import AutoConfig  # transformers: slow to import, only to load a head

    files = model_files(model)
    name = model_identity(model, "float32", 16)["name"]
    if head is None:
        multi = num_steps > 1
        head = shipped_or_raise(shipped_head(name, num_steps),
                                f"{num_steps}-module EAGLE head" if multi else "EAGLE head",
                                name, "eagle", f"--num-steps {num_steps}" if multi else "")
    elif num_steps != 1 and (have := read_head_config(head).num_steps) != num_steps:
        raise ValueError(f"eagle:steps={num_steps} but the head at {head} has {have} modules")
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(files))
    embed, lm_head = target_embeddings(files)
    loaded = load_head(head, embed, lm_head, target_identity(name, config, embed),
                       dtype=model_dtype(dtype), backend=backend)
    on_blocks = quantize_head(loaded)
    log.info("EAGLE head %s for %s: %.2f M parameters%s", head, name,
             loaded.num_trainable_parameters() / 1e6,
             f", {on_blocks} products on Q8_0 blocks" if on_blocks else "")
    return loaded
