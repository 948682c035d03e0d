"""Host of the drafter role: a DrafterWorker with the configured drafting method, built by the
method's own factory (drafter/registry.py, :meth:`drafter.proposer.Proposer.create`) for the
cluster's target."""

from __future__ import annotations

import torch

from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.hosts.base import RoleHost, role_backend, watch_model
from specmesh.drafter.draft_memory import drafter_costs
from specmesh.drafter.proposer import DraftTarget
from specmesh.drafter.registry import create_proposer, get_method, seed_state_for
from specmesh.protocol.enums import Role
from specmesh.protocol.zmq_transport import PeerInfo


def draft_target(cfg: ClusterConfig, target_identity=None):  # noqa: ANN001, ANN201
    """The :class:`drafter.proposer.DraftTarget` of ``cfg``: its model, dtype, device and block
    size, and ``target_identity`` (a ModelIdentity; None: read from the model's config files by
    a method that needs it)."""
    return DraftTarget(model=cfg.model, dtype=cfg.dtype, device=cfg.device,
                       block_size=cfg.block_size, identity=target_identity,
                       backend=role_backend(cfg), kv_cache_dtype=cfg.kv_cache_dtype)


def cluster_seed_state(cfg: ClusterConfig) -> str:
    """The seed state the drafters of ``cfg`` need (``""``, ``"hidden"`` or, for a fused EAGLE-3
    head, ``"hidden:L1,L2,..."`` read from the head's config), which the prefill and verifier
    hosts configure their workers with before any drafter runs."""
    return seed_state_for(cfg.drafter.method, cfg.drafter.method_kwargs, draft_target(cfg))


def reads_target_kv(cfg: ClusterConfig) -> bool:
    """Whether the drafters of ``cfg`` read the verifier's KV pool (frozen-KV MTP): the
    verifier then keeps it in shared memory (engine/shared_kv.py); False for a method the
    registry does not know (the drafter fails at startup with the reason)."""
    try:
        return bool(get_method(cfg.drafter.method).reads_target_kv)
    except KeyError:
        return False


def build_proposer(cfg: ClusterConfig, target_identity=None):  # noqa: ANN001, ANN201
    """The proposer of ``cfg.drafter``: its method's factory with ``method_kwargs`` for the
    cluster's target (:func:`draft_target`; ``target_identity`` a ModelIdentity or None).

    Raises:
        KeyError: an unknown method.
        ValueError, FileNotFoundError: what the method's factory refuses (e.g. a draft model
            whose vocabulary differs from the target's, a head trained for another target).
    """
    return create_proposer(cfg.drafter.method, cfg.drafter.method_kwargs,
                           draft_target(cfg, target_identity))


class DrafterHost(RoleHost):
    """Answers the verifiers that dial it; dials nobody."""

    role = Role.DRAFTER

    def build_worker(self):
        from specmesh.drafter.worker import DrafterWorker  # the drafting kernels: triton

        proposer = build_proposer(self.cfg, self.model_identity())
        worker = DrafterWorker(self.cfg.drafter, self.mailbox, proposer)
        if getattr(proposer, "reads_target_kv", False):  # a verifier off this node: refused
            self.mailbox.hello_check = proposer.check_verifier_hello
        _watch_models(worker.proposer)
        return worker

    def on_hello(self, peer: PeerInfo, is_new: bool) -> None:
        # A verifier's new incarnation (Ray restarted it): the draft states of its previous
        # life's requests are nobody's now (found by benchmarks/soak.py).
        if peer.role == Role.VERIFIER.value and is_new:
            self.worker.drop_peer(peer.name)

    def stats(self) -> dict:
        out = super().stats()
        out["num_requests"] = len(self.worker.requests)  # per-request draft states held
        # a multi-layer EAGLE head's per-module figures (drafter/proposers/eagle.py draft_stats)
        out.update(getattr(self.worker.proposer, "draft_stats", dict)())
        memory = getattr(self.worker.proposer, "draft_memory", None)
        if memory is not None:  # frozen-KV MTP: the draft KV it does not allocate
            out.update(memory())
        # weights, draft KV and forwards of the method (the bench's per-method table)
        out.update(drafter_costs(self.worker.proposer))
        return out


def _watch_models(proposer) -> None:  # noqa: ANN001
    """A model-based proposer's forwards count as the drafter's progress (health check): the
    torch modules among its attributes, and those of its attributes' ``model``."""
    for value in getattr(proposer, "__dict__", {}).values():
        try:
            inner = getattr(value, "model", None)
        except Exception:  # noqa: BLE001 - a property that cannot answer: not a model
            inner = None
        for m in (value, inner):
            if isinstance(m, torch.nn.Module):
                watch_model(m)
