"""Medusa drafting: a static token tree from K heads on the target's last hidden state
(Medusa-1, Cai et al., arXiv 2401.10774; drafter/medusa/).

Seed state ``"hidden"``, as EAGLE's: the prefill worker ships the target's final hidden state
at the last prompt position, each VerifyCommit the states at the positions whose next token it
committed. Per request the proposer keeps only the newest state, ``h_s`` at position ``s``
(the one from which the target chose the context's last token ``s + 1``); head i's candidates
from it are drafts for position ``s + 2 + i``. The heads run once per new state, batched over
every request whose state changed since the last draft (one ``[n, d]`` product per head).

Drafts: at the committed prefix the checkpoint's static tree (drafter/medusa/tree.py; branch 0
the heads' top-1 chain), verified by the tree rule (decode/verification.py ``TreeRule``:
exact for greedy, seeded and sampled requests alike; one-hot drafts, no typical acceptance).
Later run-ahead segments continue branch 0 with the remaining heads' top-1 tokens; past the
last head there is nothing to draft until the next commit brings a new state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from specmesh.drafter.draft_memory import resident_bytes
from specmesh.drafter.eagle.checkpoint import target_embeddings, target_identity
from specmesh.drafter.medusa.checkpoint import load_heads, read_config
from specmesh.drafter.medusa.heads import MedusaHeads
from specmesh.drafter.medusa.tree import build_tree, chain_tree
from specmesh.drafter.options import Option, OptionSchema
from specmesh.drafter.proposer import DraftTarget, ProposeCall, Proposer, shipped_or_raise
from specmesh.drafter.registry import register_proposer
from specmesh.drafter.training.medusa import train_medusa_heads
from specmesh.engine.config import ModelConfig
from specmesh.engine.dtypes import MODEL_DTYPES, model_dtype
from specmesh.engine.loader import model_files, model_identity

log = logging.getLogger(__name__)

#: where shipped heads live: <dir>/<target name, lower case>-medusa/
SHIPPED_HEADS = Path(__file__).resolve().parent.parent / "heads"


def shipped_heads(target_name: str) -> Path | None:
    """The Medusa heads shipped for the target called ``target_name``, or None."""
    p = SHIPPED_HEADS / f"{target_name.lower()}-medusa"
    return p if (p / "config.json").is_file() else None


@dataclass
class _State:
    """A request's newest target state: ``hidden`` [d] at absolute ``position``; ``top``
    [K, k] the heads' candidates from it (None until the heads ran on it)."""

    position: int
    hidden: torch.Tensor
    top: list[list[int]] | None = None


def _train(prep: dict, args) -> dict:  # noqa: ANN001
    """``specmesh train-drafter --method medusa``: drafter/training/medusa.py."""
    return train_medusa_heads(prep, args)


@register_proposer
class MedusaProposer(Proposer):
    """Kwargs: ``heads`` (checkpoint dir; default: the heads shipped for the target),
    ``model`` (the target: "smollm2", a .gguf or a HF dir; only its LM head is read),
    ``dtype`` of the heads ("float32"), ``tree_nodes`` (most nodes of a tree, the first ones
    of the checkpoint's tree; None: all of them), ``chain`` (draft the heads' top-1 chain
    instead of the tree), or ``heads_module`` (loaded :class:`MedusaHeads`, tests).

    Raises:
        drafter.eagle.checkpoint.HeadMismatch: heads trained for another target.
        FileNotFoundError: no heads given and none shipped for the target.
        ValueError: ``tree_nodes`` < 1.
    """

    name = "medusa"
    summary = ("Medusa heads on the target's last hidden state, drafting a static tree from "
               "each head's top-k (the heads shipped for the target, or from specmesh "
               "train-drafter --method medusa)")
    options = OptionSchema((
        Option("heads", "path", "the heads' checkpoint directory (specmesh train-drafter "
               "--method medusa --out DIR)", "the heads shipped for the target",
               positional=True),
        Option("dtype", str, "dtype of the heads' weights", "the cluster's dtype",
               choices=tuple(d for d in MODEL_DTYPES if d != "float16")),
        Option("nodes", int, "most nodes of a draft tree (the checkpoint's tree cut to its "
               "first ones, likeliest first)", "the whole tree", kwarg="tree_nodes",
               minimum=1),
        Option("chain", bool, "draft the heads' top-1 chain instead of the tree", False),
    ))
    trainer = staticmethod(_train)
    seed_state = "hidden"
    draft_shape = "tree"
    runs_a_model = True

    def __init__(self, heads: str | None = None, model: str | None = None,
                 dtype: str = "float32", tree_nodes: int | None = None, chain: bool = False,
                 heads_module: MedusaHeads | None = None) -> None:
        if tree_nodes is not None and tree_nodes < 1:
            raise ValueError(f"tree_nodes must be >= 1, got {tree_nodes}")
        self.heads = heads_module if heads_module is not None else load_medusa_heads(
            heads, model, dtype)
        cfg = self.heads.config
        self.tree = chain_tree(cfg.num_heads) if chain or not cfg.tree else cfg.tree
        self.max_nodes = tree_nodes
        #: candidates per head the tree reads (its deepest rank + 1)
        self.topk = 1 + max(r for p in self.tree for r in p)
        self.seed_hidden_size = cfg.hidden_size
        self.states: dict[str, _State] = {}
        self.num_head_rows = 0  # states the heads ran on (metrics, tests)
        #: drafter/draft_memory.py: the heads' resident weights (the target's LM head rows
        #: included), no draft KV (they read the target's last hidden state), one forward per
        #: batched head run
        self.draft_weights_bytes = resident_bytes(self.heads)
        self.draft_kv_pool_bytes = 0
        self.num_draft_forwards = 0

    @classmethod
    def create(cls, kwargs: dict, target: DraftTarget) -> MedusaProposer:
        """The heads of ``kwargs`` (``heads``: default the ones shipped for the target;
        ``dtype``: default the cluster's); only the target's LM head (and the embedding's
        fingerprint) is read from ``target.model``'s weights."""
        return cls(**{"model": target.model, "dtype": target.dtype, **kwargs})

    # -- interface -------------------------------------------------------------------------

    def open(self, request_id: str, context_token_ids: list[int]) -> None:
        self.states.pop(request_id, None)

    def observe_seed_state(self, request_id: str, start_position: int,
                           hidden: torch.Tensor) -> None:
        """Keep the last row of ``hidden`` [n, d] (position ``start_position + n - 1``).

        Raises:
            ValueError: rows of another width than the heads read.
        """
        if hidden.dim() != 2 or hidden.shape[0] < 1 or \
                hidden.shape[1] != self.heads.config.hidden_size:
            raise ValueError(f"seed state of shape {list(hidden.shape)}: the Medusa heads read "
                             f"[n, {self.heads.config.hidden_size}]")
        self.states[request_id] = _State(start_position + hidden.shape[0] - 1,
                                         hidden[-1].detach().to(self.heads.weight.dtype))

    def _refresh(self) -> None:
        """Run the heads on every request's state that has no candidates yet, in one batch."""
        todo = [st for st in self.states.values() if st.top is None]
        if not todo:
            return
        top = self.heads.top_tokens(torch.stack([st.hidden for st in todo]), self.topk)
        for st, rows in zip(todo, top.tolist()):
            st.top = rows
        self.num_head_rows += len(todo)
        self.num_draft_forwards += 1

    def _heads_from(self, request_id: str, context_token_ids: list[int]) -> list[list[int]]:
        """The candidates of the heads that draft the positions after the context, in order
        (head o first, ``o = len(context) - 2 - s``); [] when the request has no state that
        reaches the context."""
        st = self.states.get(request_id)
        if st is None:
            return []
        offset = len(context_token_ids) - 2 - st.position
        if offset < 0 or offset >= self.heads.config.num_heads:
            return []
        self._refresh()
        return st.top[offset:]

    def propose_tree(self, request_id: str, context_token_ids: list[int],
                     num_tokens: int) -> tuple[list[int], list[int]]:
        """The static tree over the candidates of the heads after the context, at most
        ``num_tokens`` deep and ``tree_nodes`` large; ([], []) without a state."""
        if num_tokens <= 0:
            return [], []
        top = self._heads_from(request_id, context_token_ids)
        if not top:
            return [], []
        return build_tree(top, self.tree, num_tokens, self.max_nodes)

    def propose(self, request_id: str, context_token_ids: list[int], num_tokens: int) -> list[int]:
        """The heads' top-1 tokens for the positions after the context (a chain)."""
        if num_tokens <= 0:
            return []
        return [row[0] for row in self._heads_from(request_id, context_token_ids)[:num_tokens]]

    def propose_many(self, calls: list[ProposeCall]
                     ) -> list[tuple[list[int], list[torch.Tensor | None]]]:
        """:meth:`propose` for each call after one batched head run (drafts are the same
        whatever the request's sampling: one-hot, rows None)."""
        self._refresh()
        out = []
        for c in calls:
            drafts = self.propose(c.request_id, c.context_token_ids, c.num_tokens)
            out.append((drafts, [None] * len(drafts)))
        return out

    def rollback(self, request_id: str, num_context_tokens: int) -> None:
        """Drop the state if it sits past the kept context (it read rejected tokens)."""
        st = self.states.get(request_id)
        if st is not None and st.position > num_context_tokens - 1:
            del self.states[request_id]

    def close(self, request_id: str) -> None:
        self.states.pop(request_id, None)


def _shipped_for(model: str | None) -> Path | None:
    return shipped_heads(model_identity(model, "float32", 16)["name"])


def load_medusa_heads(heads: str | None, model: str | None,
                      dtype: str = "float32") -> MedusaHeads:
    """The heads at ``heads`` (or the ones shipped for ``model``), with the target's LM head
    rows read from its weights.

    Raises:
        FileNotFoundError: no heads given and none shipped for the target; missing weights.
        drafter.eagle.checkpoint.HeadMismatch: heads trained for another target.
    """
    from transformers import AutoConfig  # transformers: slow to import, only to load heads

    files = model_files(model)
    name = model_identity(model, "float32", 16)["name"]
    if heads is None:
        heads = shipped_or_raise(shipped_heads(name), "Medusa heads", name, "medusa")
    read_config(heads)  # a clear error before the target's weights are read
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(files))
    embed, lm_head = target_embeddings(files)
    loaded = load_heads(heads, lm_head, target_identity(name, config, embed),
                        dtype=model_dtype(dtype))
    log.info("Medusa heads %s for %s: %d heads, tree of %d nodes, %.2f M parameters", heads,
             name, loaded.config.num_heads, len(loaded.config.tree) or loaded.config.num_heads,
             loaded.num_trainable_parameters() / 1e6)
    return loaded
