"""The interface of a drafting method (docs/architecture.md, 'Drafting'): what a method
declares to the rest of the system (name, options, seed state, trainer, whether it runs a
model, its factory) and what its proposer answers. The registry that finds methods by name is drafter/registry.py."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from specmesh.drafter.options import NO_OPTIONS, OptionSchema

if TYPE_CHECKING:
    import torch

    from specmesh.drafter.draft_sampling import DraftSampling


class CorpusUnsupported(NotImplementedError):
    """The drafting method keeps no cross-request memory, so it cannot draft from a corpus
    (:meth:`Proposer.load_corpus` / :meth:`Proposer.drop_corpus` of a method whose
    ``supports_corpus`` is False). The drafter answers the operation ``unsupported`` and the
    gateway turns that into HTTP 400."""


@dataclass(frozen=True)
class DraftTarget:
    """The target a proposer drafts for, as the cluster describes it to a method's factory
    (:meth:`Proposer.create`): ``model`` (a Hugging Face dir, a ``.gguf`` or None for the
    default SmolLM2), ``dtype`` and ``device`` of the cluster's model roles, ``block_size``
    (tokens per KV block), ``identity`` (its ``protocol.messages.ModelIdentity`` when the
    caller has it; None: a method that needs it reads it from the model's config files),
    ``backend`` (the ``engine.backend.CpuBackend`` a method that computes uses: the role's,
    this machine with the cluster's overrides; None: the process's default),
    ``kv_cache_dtype`` (the target's ``--kv-cache-dtype``, part of its identity)."""

    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    identity: Any = None
    backend: Any = None
    kv_cache_dtype: str = "auto"


@dataclass
class ProposeCall:
    """One request's part of :meth:`Proposer.propose_many`: up to ``num_tokens`` drafts
    continuing ``context_token_ids``, drafted for the sampling ``how`` (None: as
    :meth:`Proposer.propose` drafts)."""

    request_id: str
    context_token_ids: list[int]
    num_tokens: int
    how: DraftSampling | None = None


@dataclass
class BranchCall:
    """One request's part of :meth:`Proposer.propose_branches`: likely tokens at the position
    after ``context_token_ids`` other than ``path_token_id`` (the drafter's own draft there),
    up to ``num_candidates`` of them."""

    request_id: str
    context_token_ids: list[int]
    path_token_id: int
    num_candidates: int


class Proposer(ABC):
    """One draft method. The drafter worker owns the per-request token state; a proposer only
    answers ``propose`` for a context and keeps whatever private per-request state it needs
    (a model drafter's KV, a suffix tree), rolled back with ``rollback``.

    A subclass is one drafting method. It declares, as class attributes: ``name`` (the
    registry key and what ``--drafter`` calls it; ``cli_name`` when users type another
    spelling, e.g. ``draft-model``), ``summary`` (one line of ``--help``), ``options`` (the
    keys of ``--drafter NAME:KEY=VALUE+...``, drafter/options.py; the parsed values are the
    keyword arguments of :meth:`create`), ``trainer`` (``specmesh train-drafter --method
    NAME``: a callable ``(prepared data, args) -> evaluation``, see drafter/training/; None:
    the method is not trained), ``runs_a_model`` and ``seed_state`` (below), and the factory
    :meth:`create`.

    ``seed_state`` declares the seed state the method needs
    from the target (docs/architecture.md, 'Messages'): ``""`` none (the seed is rebuilt from tokens);
    ``"hidden"`` the target's final hidden states (final-norm output, the input of its LM
    head), which reach the proposer through :meth:`observe_seed_state`; an instance may
    narrow it to ``"hidden:L1,L2,..."`` (those decoder layers' outputs, engine/hidden_layers.py),
    which :meth:`seed_state_for` tells the cluster before any drafter starts. ``seed_hidden_size``
    (class or instance attribute): the width of the hidden rows it expects (an EAGLE head's
    input size); the drafter worker refuses rows of another width as a protocol error for the
    request. None: not checked.
    """

    name: ClassVar[str]
    cli_name: ClassVar[str | None] = None
    summary: ClassVar[str] = ""
    options: ClassVar[OptionSchema] = NO_OPTIONS
    trainer: ClassVar[Callable[[dict, Any], dict] | None] = None
    #: whether the trainer reads the samples' hidden-state rows (``Sample.features``); False:
    #: it learns from the token ids alone, so any ``--data`` cache of the same outputs will do,
    #: whatever target layers it captured (drafter/training/eagle.py)
    trainer_reads_features: ClassVar[bool] = True
    seed_state: ClassVar[str] = ""
    #: most drafts the worker asks for per request per call (0: as many as the window has
    #: room for). Model drafters pay a forward per draft: asking for one at a time streams each
    #: draft the moment it exists, so a verifier that cannot wait for a whole tail still gets
    #: the first drafts (docs/benchmarks.md, 'Drafting').
    max_drafts_per_call: ClassVar[int] = 0
    #: whether :meth:`propose_sampled` draws drafts the way the request samples (a model
    #: drafter: drafter/draft_sampling.py) and returns the rows of unseeded sampled drafts;
    #: False: drafts are the same whatever the sampling (n-gram), one-hot for the verifier
    returns_draft_probs: ClassVar[bool] = False
    #: whether, asked with ``DraftSampling.token_probs``, a greedy draft comes with its
    #: probability (a float in place of its row), sent as DraftTailStream.draft_token_probs
    #: for the verifier's confidence budget (decode/confidence_calibration.py)
    returns_token_probs: ClassVar[bool] = False
    #: whether each row :meth:`propose_many` returns is a drafter.head_confidences
    #: WithConfidence (the row and a trained confidence head's survival prediction), sent as
    #: DraftTailStream.draft_confidences for the verifier's confidence budget (dspark)
    returns_draft_confidences: ClassVar[bool] = False
    #: whether drafting runs a model (torch forwards competing with the verifier's for the
    #: cores): the cluster's default thread plan leaves such a drafter a core of its own
    runs_a_model: ClassVar[bool] = False
    seed_hidden_size: int | None = None
    #: whether the method reads the target's committed KV (frozen-KV MTP,
    #: drafter/proposers/frozen_kv_mtp.py): the verifier then keeps its KV pool in shared
    #: memory and tells each request's committed rows (:meth:`observe_target_kv`), and the
    #: drafter serves only verifiers on its own node (:meth:`check_verifier_hello`)
    reads_target_kv: ClassVar[bool] = False
    #: whether the method's first draft step can run at the prefill (EAGLE family, SGLang's
    #: P/D EAGLE seed; docs/drafters.md 'The seed across P/D'): the cluster builds a prefill-
    #: side instance whose :meth:`make_prefill_seed` runs it after the prompt, PrefillDone and
    #: the first DraftSync carry it, and the drafter's :meth:`adopt_prefill_seed` installs it
    #: instead of running it. Needs a ``seed_state`` (the step reads it)
    makes_prefill_seed: ClassVar[bool] = False
    #: whether the method drafts from corpora loaded at run time (:meth:`load_corpus`,
    #: :meth:`drop_corpus`; ``specmesh serve --corpus``, ``POST /v1/specmesh/corpus``)
    supports_corpus: ClassVar[bool] = False
    #: counters a method with corpora keeps for the drafter's metrics (docs/drafters.md,
    #: 'Corpora'): draft tokens it returned, and how many of them it copied from a corpus
    num_draft_tokens_proposed: int = 0
    num_corpus_draft_tokens: int = 0
    #: what the method costs the drafter (drafter/draft_memory.py; the bench's per-method
    #: table): resident bytes of its weights, bytes of its draft KV, and the model forwards it
    #: has run (a batched call counting once); None: not reported (a blank in the bench)
    draft_weights_bytes: int | None = None
    draft_kv_pool_bytes: int | None = None
    num_draft_forwards: int | None = None

    @abstractmethod
    def open(self, request_id: str, context_token_ids: list[int]) -> None:
        """Start (or restart) a request whose known tokens are ``context_token_ids``."""

    @abstractmethod
    def propose(self, request_id: str, context_token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` draft tokens continuing ``context_token_ids`` (prompt + output,
        committed and speculative). May return fewer, or none."""

    def propose_sampled(self, request_id: str, context_token_ids: list[int], num_tokens: int,
                        how: DraftSampling) -> tuple[list[int], list[torch.Tensor | None]]:
        """Like :meth:`propose`, drafting for the request's sampling ``how``
        (drafter/draft_sampling.py). Returns the drafts and one row per draft: the float32
        ``[vocab_size]`` distribution it was drawn from (unseeded sampled requests with
        ``how.with_probs``), else None. The default drafts with :meth:`propose` (rows None)."""
        drafts = self.propose(request_id, context_token_ids, num_tokens)
        return drafts, [None] * len(drafts)

    def propose_many(self, calls: list[ProposeCall]
                     ) -> list[tuple[list[int], list[torch.Tensor | None]]]:
        """Drafts and rows (as :meth:`propose_sampled` returns them) for several requests in
        one call, in the order of ``calls``. The default answers them one by one; a model
        drafter overrides it to run one batched forward for all of them (the verifier's
        continuous batch is the drafter's batch too)."""
        out = []
        for c in calls:
            if c.how is None:
                drafts = self.propose(c.request_id, c.context_token_ids, c.num_tokens)
                out.append((drafts, [None] * len(drafts)))
            else:
                out.append(self.propose_sampled(c.request_id, c.context_token_ids,
                                                c.num_tokens, c.how))
        return out

    @classmethod
    def create(cls, kwargs: dict, target: DraftTarget) -> Proposer:
        """The method's factory: a proposer for ``target`` from ``kwargs`` (what ``--drafter``
        parsed with :attr:`options`, or ``DrafterConfig.method_kwargs``). The default is
        ``cls(**kwargs)``; a method that loads weights for the target overrides it.

        Raises:
            ValueError, FileNotFoundError: what the method refuses (the drafter role fails
                at startup with it).
        """
        return cls(**kwargs)

    @classmethod
    def seed_state_for(cls, kwargs: dict, target: DraftTarget | None = None) -> str:
        """The seed state an instance built with ``kwargs`` for ``target`` needs (default: the
        class's), told to the prefill and verifier roles before any drafter starts."""
        return cls.seed_state

    @abstractmethod
    def rollback(self, request_id: str, num_context_tokens: int) -> None:
        """Forget state beyond the first ``num_context_tokens`` tokens of the context."""

    @abstractmethod
    def close(self, request_id: str) -> None:
        """Drop every trace of the request."""

    def observe_seed_state(self, request_id: str, start_position: int, hidden) -> None:  # noqa: ANN001
        """Target hidden states ``hidden`` (torch.Tensor [n, hidden_size]) at absolute context
        positions ``[start_position, start_position + n)``; row i is the state from which the
        target predicted the token at ``start_position + i + 1``. Called after :meth:`open`
        (DraftSync: the states the verifier holds, ending at position ``len(context) - 2``)
        and after each VerifyCommit (``accept_len + 1`` rows, ending at the same place).
        Only for methods whose ``seed_state`` is not empty; the default ignores them. May
        raise ValueError for states it cannot use: the drafter then asks for a DraftSync."""

    def make_prefill_seed(self, request_id: str, context_token_ids: list[int],
                          hidden, topk: int):  # noqa: ANN001, ANN201 - a DraftSeed or None
        """The method's first draft step for a request, run at the prefill (methods whose
        ``makes_prefill_seed`` is True): ``context_token_ids`` the prompt and its first output
        token, ``hidden`` (torch.Tensor ``[1, seed width]``) the target's seed state at the last
        prompt position, ``topk`` the most likely tokens to report (at most 16). Returns a
        ``protocol.messages.DraftSeed``, or None (the default: nothing to seed). Leaves no
        request state behind. May raise ValueError for rows it cannot read (the prefill ships
        no seed then)."""
        return None

    def adopt_prefill_seed(self, request_id: str, context_token_ids: list[int],
                           seed) -> bool:  # noqa: ANN001
        """Install the prefill's DraftSeed ``seed`` in the request's state, after :meth:`open`
        and :meth:`observe_seed_state`, so that drafting does not run that step again; the
        drafts are those it would make without it. Returns False, changing nothing, when the
        seed does not fit the request or the method (the default: never adopted)."""
        return False

    def observe_target_kv(self, request_id: str, verifier: str, rows) -> None:  # noqa: ANN001
        """The committed rows of the request in verifier ``verifier``'s shared KV pool
        (``rows``: protocol.messages.TargetKVRows), after :meth:`open` and after each commit
        is applied. Only for methods whose ``reads_target_kv`` is True; the default ignores
        them."""

    def check_verifier_hello(self, verifier: str, hello) -> str:  # noqa: ANN001
        """Why this drafter refuses the Hello of ``verifier`` (protocol.messages.Hello), ""
        to accept it; asked only of methods whose ``reads_target_kv`` is True (the default
        accepts)."""
        return ""

    def propose_branches(self, calls: list[BranchCall]) -> list[dict[int, list[int]]]:
        """Drafts prepared for verification outcomes other than the path (the speculation
        cache of SSD / Saguaro, arXiv 2603.03251; the drafter sends them as DraftBranches while
        the verifier runs its forward): per call ``{candidate token: the drafts after it}``,
        at most ``num_candidates`` candidates, never ``path_token_id``, greedy one-hot drafts.
        The default prepares none: a method that drafts in microseconds (n-gram) gains
        nothing from it."""
        return [{} for _ in calls]

    # -- cross-request memory (docs/drafters.md, 'Corpora') -------------------------------
    # The drafter worker calls these three from one background thread of its own, one at a
    # time and in the order the operations arrived, while its loop thread goes on calling
    # propose / open / rollback / close: an implementation builds new state aside and installs
    # it with one reference assignment (atomic in CPython), or guards what both threads touch
    # with a lock held only briefly, so drafting never waits for a load.

    def load_corpus(self, name: str, token_ids: list[int]) -> None:
        """Draft from ``token_ids`` (a corpus: documentation, code, earlier conversations,
        token ids of the target's vocabulary) from now on, under ``name``; a corpus already
        loaded under ``name`` is replaced. SGLang's external corpus
        (``external_corpus_manager.py``, notes_drafters_2 section 1) is the model.

        Raises:
            CorpusUnsupported: the method keeps no cross-request memory (the default).
            ValueError: token ids it cannot hold (e.g. negative).
        """
        raise CorpusUnsupported(f"the {self.name!r} drafting method keeps no cross-request "
                                "memory: it cannot draft from a corpus")

    def drop_corpus(self, name: str) -> bool:
        """Forget corpus ``name``; False when no corpus of that name is loaded.

        Raises:
            CorpusUnsupported: the method keeps no cross-request memory (the default).
        """
        raise CorpusUnsupported(f"the {self.name!r} drafting method keeps no cross-request "
                                "memory: it holds no corpus")

    def clear_history(self) -> None:
        """Forget what earlier requests left in the method's cross-request memory (a suffix
        drafter's global tree of earlier outputs), so that no request is drafted from its own
        earlier run (the bench calls it between repeats). Corpora stay. The default keeps no
        such memory: nothing to forget."""

    #: what the method drafts: "chain" (one path) or "tree" (several branches from the same
    #: context: :meth:`propose_tree`; the drafter worker asks for a tree for the segment at the
    #: committed prefix, chains for its run-ahead)
    draft_shape: ClassVar[str] = "chain"

    def propose_tree(self, request_id: str, context_token_ids: list[int],
                     num_tokens: int) -> tuple[list[int], list[int]]:
        """A token tree continuing ``context_token_ids``: ``(draft_token_ids, parents)``,
        ``parents[j] < j`` the index of node j's parent, -1 for the context's last token
        (DraftTailStream.parents); each branch at most ``num_tokens`` deep, branch 0 (always
        the first child) the method's best path. The default is :meth:`propose`'s chain."""
        drafts = self.propose(request_id, context_token_ids, num_tokens)
        return drafts, list(range(-1, len(drafts) - 1))


    def propose_tree_sampled(self, request_id: str, context_token_ids: list[int],
                             num_tokens: int, how: DraftSampling | None
                             ) -> tuple[list[int], list[int], list[torch.Tensor | None]]:
        """:meth:`propose_tree` drafted for the request's sampling ``how`` (None: as
        :meth:`propose_tree`): ``(draft_token_ids, parents, rows)``, a row per node: the
        float32 ``[vocab_size]`` distribution it was drawn from given its parent and its
        earlier siblings (the tree rule's multi-draft rejection is exact with such rows,
        kernels/tree_rejection_sample.py), or None (verified one-hot: exact for drafts that
        are a function of the context). The default: :meth:`propose_tree`, rows None."""
        tokens, parents = self.propose_tree(request_id, context_token_ids, num_tokens)
        return tokens, parents, [None] * len(tokens)

    def propose_trees(self, calls: list[ProposeCall]
                      ) -> list[tuple[list[int], list[int], list[torch.Tensor | None]]]:
        """:meth:`propose_tree_sampled` for several requests (``num_tokens``: each tree's
        depth), in the order of ``calls``. The default answers them one by one; a model
        drafter overrides it to grow all the trees with one forward per depth."""
        return [self.propose_tree_sampled(c.request_id, c.context_token_ids, c.num_tokens,
                                          c.how) for c in calls]


#: what a proposer may draft (Proposer.draft_shape)
DRAFT_SHAPES = ("chain", "tree")


def shipped_or_raise(found: object, what: str, target_name: str, method: str,
                     train_args: str = "") -> str:
    """``found`` (the path of what is shipped for the target, or None) as a string.

    Raises:
        FileNotFoundError: nothing shipped, naming the ``specmesh train-drafter`` command
            (``train_args``: its options beyond ``--method``).
    """
    if found is None:
        command = f"specmesh train-drafter --method {method}" + (f" {train_args}" if train_args
                                                                 else "")
        raise FileNotFoundError(f"no {what} shipped for {target_name!r}: train one with "
                                f"`{command}` and pass --drafter {method}:PATH")
    return str(found)
