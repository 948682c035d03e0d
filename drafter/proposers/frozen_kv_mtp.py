"""Frozen-KV MTP drafting: an assistant that owns no KV pool and attends over the target's
committed KV, read-only, through shared memory (SGLang's FROZEN_KV_MTP, vLLM's
``constant_draft_positions``; drafter/frozen_kv/assistant.py; docs/drafters.md, 'Frozen-KV
MTP').

What reaches the proposer, per request: the seed state ``"hidden"`` (the target's final hidden
states, as EAGLE's) and, with every DraftSync and VerifyCommit, the request's committed rows in
the verifier's KV pool (protocol.messages.TargetKVRows: block table and ``num_rows``). The pool
itself is mapped read-only when the verifier says Hello (:meth:`check_verifier_hello`, which
refuses a verifier on another node: the pool is a file in its ``/dev/shm``).

Anchor: a request whose newest seed row sits at position ``num_rows - 1`` (the state from which
the target chose the last committed token at ``L - 1 = num_rows``) is anchored at its
committed length ``L``. Every draft step of that anchor attends over the same rows ``[0, L -
1)`` of the assistant's target layer with its query's RoPE phase pinned at ``L - 1``; only the
step's hidden state moves (step 0 reads the seed, step k the output of step k - 1), and the
chain of step outputs is the request's whole state (``[steps, d]``, bounded by the run-ahead,
never by the context). A context that runs ahead of the anchor (the drafter's own path)
continues the chain; a new commit moves the anchor and restarts it. Rows past ``num_rows`` are
never read, and a closed request's are never read again (its state is dropped). Drafts are the
assistant's argmax for every request (one-hot for the verifier: exact for greedy, seeded and
sampled requests alike).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specmesh.drafter.eagle.checkpoint import target_embeddings, target_identity
from specmesh.drafter.frozen_kv.assistant import FrozenKVAssistant
from specmesh.drafter.frozen_kv.checkpoint import load_assistant, read_config
from specmesh.drafter.options import Option, OptionSchema
from specmesh.drafter.proposer import DraftTarget, ProposeCall, Proposer, shipped_or_raise
from specmesh.drafter.registry import register_proposer
from specmesh.drafter.training.frozen_kv_mtp import train_frozen_kv_mtp
from specmesh.engine.config import ModelConfig
from specmesh.engine.dtypes import MODEL_DTYPES, model_dtype
from specmesh.engine.loader import model_files, model_identity
from specmesh.engine.model import rope_inv_freq
from specmesh.engine.shared_kv import ReadOnlyKV, map_read_only
from specmesh.protocol.colocation import shared_kv_refusal

log = logging.getLogger(__name__)

#: where shipped assistants live: <dir>/<target name, lower case>-frozen-kv-mtp/
SHIPPED = Path(__file__).resolve().parent.parent / "heads"


def shipped_assistant(target_name: str) -> Path | None:
    """The assistant shipped for the target called ``target_name``, or None."""
    p = SHIPPED / f"{target_name.lower()}-frozen-kv-mtp"
    return p if (p / "config.json").is_file() else None


@dataclass
class _Request:
    """One request's view of the target and its chain. ``verifier``: whose pool holds its
    rows; ``block_table`` / ``num_rows``: its committed rows there; ``seed_position`` /
    ``seed``: the newest target hidden state [d]; ``inputs`` / ``outs``: the tokens the
    chain's steps read and their outputs [d] (step k reads the token at ``anchor - 1 + k``)."""

    verifier: str = ""
    block_table: list[int] = field(default_factory=list)
    num_rows: int = 0
    seed_position: int = -1
    seed: torch.Tensor | None = None
    inputs: list[int] = field(default_factory=list)
    outs: list[torch.Tensor] = field(default_factory=list)

    @property
    def anchor(self) -> int | None:
        """The committed length the chain starts from, or None while seed and rows disagree
        (one arrived, the other not yet)."""
        if self.seed is None or self.num_rows < 1 or self.seed_position != self.num_rows - 1:
            return None
        return self.num_rows + 1

    def restart(self) -> None:
        self.inputs.clear()
        self.outs.clear()


@dataclass
class _Cursor:
    call: ProposeCall
    st: _Request
    keys: torch.Tensor
    values: torch.Tensor
    pending: list[int]
    drafts: list[int] = field(default_factory=list)


def _train(prep: dict, args) -> dict:  # noqa: ANN001
    """``specmesh train-drafter --method frozen-kv-mtp``: drafter/training/frozen_kv_mtp.py."""
    return train_frozen_kv_mtp(prep, args)


@register_proposer
class FrozenKVMTPProposer(Proposer):
    """Kwargs: ``assistant`` (checkpoint dir; default: the one shipped for the target),
    ``model`` (the target: "smollm2", a .gguf or a HF dir; only its embedding, LM head and
    config are read), ``dtype`` of the assistant ("float32"), or ``assistant_module`` (a
    loaded :class:`FrozenKVAssistant`, tests).

    Raises:
        drafter.eagle.checkpoint.HeadMismatch: an assistant trained for another target.
        FileNotFoundError: none given and none shipped for the target.
    """

    name = "frozen_kv_mtp"
    cli_name = "frozen-kv-mtp"
    summary = ("frozen-KV MTP assistant attending over the verifier's committed KV read-only "
               "(no draft KV pool; the drafter must run on the verifier's node)")
    options = OptionSchema((
        Option("assistant", "path", "the assistant's checkpoint directory (specmesh "
               "train-drafter --method frozen-kv-mtp --out DIR)",
               "the assistant shipped for the target", positional=True),
        Option("dtype", str, "dtype of the assistant's weights", "the cluster's dtype",
               choices=tuple(d for d in MODEL_DTYPES if d != "float16")),
    ))
    trainer = staticmethod(_train)
    seed_state = "hidden"
    runs_a_model = True
    reads_target_kv = True
    max_drafts_per_call = 1  # a forward per draft: stream each one as it is made

    def __init__(self, assistant: str | None = None, model: str | None = None,
                 dtype: str = "float32", assistant_module: FrozenKVAssistant | None = None
                 ) -> None:
        self.model = assistant_module if assistant_module is not None else \
            load_frozen_kv_assistant(assistant, model, dtype)
        self.seed_hidden_size = self.model.config.hidden_size
        self.requests: dict[str, _Request] = {}
        self.pools: dict[str, ReadOnlyKV] = {}  # verifier -> its pool, mapped read-only
        self.num_steps = 0  # assistant step rows run (metrics, tests)
        self.num_kv_rows_read = 0  # target K/V rows gathered for attention

    @classmethod
    def create(cls, kwargs: dict, target: DraftTarget) -> FrozenKVMTPProposer:
        """The assistant of ``kwargs`` (``assistant``: default the one shipped for the target;
        ``dtype``: default the cluster's) for ``target.model``."""
        return cls(**{"model": target.model, "dtype": target.dtype, **kwargs})

    # -- the verifier's pool ---------------------------------------------------------------

    def check_verifier_hello(self, verifier: str, hello) -> str:  # noqa: ANN001
        """Refuse (a reason naming the fix) a verifier whose Hello shares no KV pool, whose
        node is not ours (protocol/colocation.py), or whose pool does not hold the
        assistant's target layer in its head layout; else map its pool read-only."""
        pool = hello.shared_kv
        why = shared_kv_refusal(pool, verifier, self.cli_name)
        if why:
            return why
        c = self.model.config
        shape = list(pool.shape)
        if len(shape) != 5 or shape[0] <= c.target_layer or shape[1] != 2 \
                or shape[3:] != [c.num_kv_heads, c.head_dim]:
            return (f"verifier {verifier!r}'s KV pool {shape} does not hold layer "
                    f"{c.target_layer} with {c.num_kv_heads} KV heads of {c.head_dim}")
        try:
            self.pools[verifier] = map_read_only(pool)
        except (OSError, ValueError) as err:
            return f"cannot map verifier {verifier!r}'s KV pool {pool.path!r}: {err}"
        log.info("frozen-KV MTP: mapped %s's KV pool %s read-only (%d MiB)", verifier,
                 pool.path, pool.nbytes >> 20)
        return ""

    def attach_pool(self, verifier: str, pool: ReadOnlyKV) -> None:
        """Use ``pool`` as verifier ``verifier``'s (an in-process verifier, tests)."""
        self.pools[verifier] = pool

    # -- interface -------------------------------------------------------------------------

    def open(self, request_id: str, context_token_ids: list[int]) -> None:
        self.requests[request_id] = _Request()

    def observe_target_kv(self, request_id: str, verifier: str, rows) -> None:  # noqa: ANN001
        st = self.requests.get(request_id)
        if st is None:
            return
        if rows.num_rows != st.num_rows or verifier != st.verifier:
            st.restart()
        st.verifier, st.block_table, st.num_rows = verifier, list(rows.block_table), rows.num_rows

    def observe_seed_state(self, request_id: str, start_position: int,
                           hidden: torch.Tensor) -> None:
        """Keep the last row of ``hidden`` [n, d] (position ``start_position + n - 1``).

        Raises:
            ValueError: rows of another width than the assistant reads.
        """
        d = self.model.config.hidden_size
        if hidden.dim() != 2 or hidden.shape[0] < 1 or hidden.shape[1] != d:
            raise ValueError(f"seed state of shape {list(hidden.shape)}: the assistant reads "
                             f"[n, {d}]")
        st = self.requests.get(request_id)
        if st is None:
            return
        position = start_position + hidden.shape[0] - 1
        if position != st.seed_position:
            st.restart()
        st.seed_position = position
        st.seed = hidden[-1].detach().to(self.model.fc.weight.dtype).clone()

    def propose(self, request_id: str, context_token_ids: list[int], num_tokens: int) -> list[int]:
        return self.propose_many([ProposeCall(request_id, context_token_ids, num_tokens)])[0][0]

    def propose_many(self, calls: list[ProposeCall]
                     ) -> list[tuple[list[int], list[torch.Tensor | None]]]:
        """Drafts for several requests, one batched assistant step per round for all of them
        (each request attends over its own rows): the same drafts each gets alone, one-hot."""
        out: list[tuple[list[int], list[torch.Tensor | None]]] = [([], []) for _ in calls]
        live = {i: cur for i, c in enumerate(calls) if (cur := self._cursor(c)) is not None}
        with torch.inference_mode():
            while live:
                need = [i for i, cur in live.items() if not cur.pending]
                if need:
                    g = torch.stack([live[i].st.outs[-1] for i in need])
                    ids = self.model.target_ids(self.model.logits(g).argmax(-1)).tolist()
                    for i, tok in zip(need, ids):
                        live[i].drafts.append(int(tok))
                work = []
                for i, cur in list(live.items()):
                    if len(cur.drafts) >= cur.call.num_tokens:
                        out[i] = (cur.drafts, [None] * len(cur.drafts))
                        del live[i]
                        continue
                    work.append((cur, cur.pending.pop(0) if cur.pending else cur.drafts[-1]))
                if work:
                    self._step(work)
        return out

    def _cursor(self, call: ProposeCall) -> _Cursor | None:
        """Where a request's drafting starts (its chain cut to the steps that still match the
        context, and its rows gathered once for the call); None when it cannot draft."""
        st = self.requests.get(call.request_id)
        if st is None or call.num_tokens <= 0:
            return None
        anchor, pool = st.anchor, self.pools.get(st.verifier)
        ctx = call.context_token_ids
        if anchor is None or pool is None or len(ctx) < anchor:
            return None
        want = ctx[anchor - 1:]
        agree = 0
        while agree < min(len(want), len(st.inputs)) and st.inputs[agree] == want[agree]:
            agree += 1
        del st.inputs[agree:], st.outs[agree:]
        try:
            keys, values = pool.rows(self.model.config.target_layer, st.block_table,
                                     st.num_rows)
        except ValueError as err:
            log.warning("frozen-KV MTP: %s: %s", call.request_id, err)
            return None
        self.num_kv_rows_read += st.num_rows
        return _Cursor(call, st, keys, values, list(want[agree:]))

    def _step(self, work: list[tuple[_Cursor, int]]) -> None:
        """One assistant step for each cursor reading its token: hidden state its chain's
        last output (or the seed), position pinned at its anchor - 1, over its rows."""
        m = self.model
        tokens = torch.tensor([tok for _, tok in work], dtype=torch.long)
        hidden = torch.stack([cur.st.outs[-1] if cur.st.outs else cur.st.seed
                              for cur, _ in work])
        positions = torch.tensor([cur.st.anchor - 1 for cur, _ in work], dtype=torch.long)
        g = m.step(tokens, hidden, positions, [cur.keys for cur, _ in work],
                   [cur.values for cur, _ in work])
        self.num_steps += len(work)
        for (cur, tok), row in zip(work, g):
            cur.st.inputs.append(tok)
            cur.st.outs.append(row)

    def rollback(self, request_id: str, num_context_tokens: int) -> None:
        """Drop the chain's steps that read tokens past the kept context."""
        st = self.requests.get(request_id)
        if st is not None and st.anchor is not None:
            keep = max(num_context_tokens - st.anchor + 1, 0)
            del st.inputs[keep:], st.outs[keep:]

    def close(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    # -- memory ----------------------------------------------------------------------------

    def draft_memory(self) -> dict:
        """What drafting holds in memory, for the drafter's stats (the bench's per-method
        table): ``draft_weights_bytes`` (the assistant's weights with the target's embedding
        and LM-head rows it keeps), ``draft_kv_pool_bytes`` (0: no draft KV pool),
        ``draft_kv_bytes_per_token_avoided`` (what an EAGLE-style draft layer's own KV would
        take per context token: ``2 * num_kv_heads * head_dim * bytes``) and
        ``draft_kv_bytes_avoided`` (that times the committed rows of the requests held now:
        the pool this method does not allocate), ``draft_state_bytes`` (the chains' hidden
        states and seeds it does hold, ``[steps, d]`` per request)."""
        itemsize = self.model.fc.weight.element_size()
        per_token = self.model.config.kv_bytes_per_token(itemsize)
        rows = sum(st.num_rows for st in self.requests.values())
        state = sum(t.numel() * t.element_size() for st in self.requests.values()
                    for t in ([st.seed] if st.seed is not None else []) + st.outs)
        return {"draft_weights_bytes": self.model.weights_bytes(), "draft_kv_pool_bytes": 0,
                "draft_kv_bytes_per_token_avoided": per_token,
                "draft_kv_bytes_avoided": per_token * rows, "draft_state_bytes": state}


def load_frozen_kv_assistant(assistant: str | None, model: str | None,
                             dtype: str = "float32") -> FrozenKVAssistant:
    """The assistant at ``assistant`` (or the one shipped for ``model``) with the target's
    embedding, LM head and RoPE frequencies read from its files.

    Raises:
        FileNotFoundError: none given and none shipped; missing weights.
        drafter.eagle.checkpoint.HeadMismatch: trained for another target.
    """
    from transformers import AutoConfig  # transformers: slow to import, only to load one

    files = model_files(model)
    name = model_identity(model, "float32", 16)["name"]
    if assistant is None:
        assistant = shipped_or_raise(shipped_assistant(name), "frozen-KV MTP assistant", name,
                                     "frozen-kv-mtp")
    read_config(assistant)  # a clear error before the target's weights are read
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(files))
    embed, lm_head = target_embeddings(files)
    loaded = load_assistant(assistant, embed, lm_head, target_identity(name, config, embed),
                            rope_inv_freq(config), model_dtype(dtype))
    log.info("frozen-KV MTP assistant %s for %s: %.2f M parameters, reads target layer %d",
             assistant, name, loaded.num_trainable_parameters() / 1e6,
             loaded.config.target_layer)
    return loaded
