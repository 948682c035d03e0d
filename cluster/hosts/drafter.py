"""Host of the drafter role: a DrafterWorker with the configured draft method.

The n-gram drafter needs no weights: its model identity comes from the model's config files.
The ``draft_model`` method loads its draft model from ``method_kwargs["model"]`` and checks its
vocabulary against the target's tokenizer at startup (:func:`build_proposer`).
"""

from __future__ import annotations

from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.hosts.base import RoleHost, watch_model
from specmesh.protocol.enums import Role


def cluster_seed_state(cfg: ClusterConfig) -> str:
    """The seed state the drafters of ``cfg`` need (``""``, ``"hidden"`` or, for a fused EAGLE-3
    head, ``"hidden:L1,L2,..."`` read from the head's config), which the prefill and verifier
    hosts configure their workers with before any drafter runs."""
    import specmesh.drafter.proposers  # noqa: F401  (registers the built-in methods)
    from specmesh.drafter.proposer import seed_state_for

    return seed_state_for(cfg.drafter.method, {"model": cfg.model, **cfg.drafter.method_kwargs})


def build_proposer(cfg: ClusterConfig, target_identity=None):  # noqa: ANN001, ANN201
    """The proposer of ``cfg.drafter`` when its method needs more than its ``method_kwargs``,
    else None (the worker builds it from the registry).

    ``eagle``: ``method_kwargs`` may hold ``head`` (a checkpoint dir; default: the head shipped
    for the target) and ``dtype`` of the head (default: the cluster's, so a bfloat16 cluster
    drafts with bfloat16 weights: half the bytes per draft, which the drafter's core otherwise
    pulls through the memory bus the verifier's forward is bound by); only the target's
    embedding and LM head are read from ``cfg.model``'s weights, and a head trained for another
    target is refused (:class:`~drafter.eagle.checkpoint.HeadMismatch`).

    ``draft_model``: ``method_kwargs`` holds ``model`` (the draft model's path) and optionally
    ``dtype`` / ``device`` (default: the cluster's) and further
    :class:`~drafter.proposers.draft_model.DraftModelProposer` arguments; the target is
    ``cfg.model``, whose tokenizer and vocabulary size (``target_identity``, a ModelIdentity,
    read from its config files when None) the draft model must match.

    Raises:
        ValueError: no ``model`` in ``method_kwargs``, or the vocabularies differ.
        FileNotFoundError: a model cannot be found.
    """
    if cfg.drafter.method == "eagle":
        from specmesh.drafter.proposers.eagle import EagleProposer

        kwargs = dict(cfg.drafter.method_kwargs)
        return EagleProposer(head=kwargs.get("head"), model=kwargs.get("model", cfg.model),
                             dtype=kwargs.get("dtype", cfg.dtype))
    if cfg.drafter.method != "draft_model":
        return None
    from specmesh.drafter.proposers.draft_model import build_draft_model_proposer
    from specmesh.engine.devices import resolve_device
    from specmesh.engine.loader import load_tokenizer, model_identity, model_name
    from specmesh.protocol.messages import ModelIdentity

    kwargs = dict(cfg.drafter.method_kwargs)
    path = kwargs.pop("model", None)
    if not path:
        raise ValueError("draft method 'draft_model' needs the draft model's path: "
                         "method_kwargs={'model': PATH}")
    if target_identity is None:
        target_identity = ModelIdentity(**model_identity(cfg.model, cfg.dtype, cfg.block_size,
                                                         cfg.kv_cache_dtype))
    dtype = kwargs.pop("dtype", cfg.dtype)
    device = resolve_device(kwargs.pop("device", cfg.device))
    return build_draft_model_proposer(path, target_identity, load_tokenizer(cfg.model), dtype,
                                      target_name=model_name(cfg.model), device=device,
                                      **kwargs)


class DrafterHost(RoleHost):
    """Answers the verifiers that dial it; dials nobody."""

    role = Role.DRAFTER

    def build_worker(self):
        import specmesh.drafter.proposers  # noqa: F401  (registers the built-in methods)
        from specmesh.drafter.worker import DrafterWorker

        proposer = build_proposer(self.cfg, self.model_identity())
        worker = DrafterWorker(self.cfg.drafter, self.mailbox, proposer)
        _watch_models(worker.proposer)
        return worker

    def stats(self) -> dict:
        out = super().stats()
        out["num_requests"] = len(self.worker.requests)  # per-request draft states held
        return out


def _watch_models(proposer) -> None:  # noqa: ANN001
    """A model-based proposer's forwards count as the drafter's progress (health check): the
    torch modules among its attributes, and those of its attributes' ``model``."""
    import torch

    for value in getattr(proposer, "__dict__", {}).values():
        try:
            inner = getattr(value, "model", None)
        except Exception:  # noqa: BLE001 - a property that cannot answer: not a model
            inner = None
        for m in (value, inner):
            if isinstance(m, torch.nn.Module):
                watch_model(m)
