"""``specmesh bench --drafters``: the draft methods one bench run compares, each a
``--drafter`` form (``ngram``, ``eagle:PATH``, ``auto``, a plugin...: cluster/drafter_option.py),
optionally with a thread plan of its served cluster after ``@`` (``eagle@verifier=1+drafter=1``:
the same method again under another plan, served only, so that plans are compared in one run),
and the cluster configuration of each (the bench's config with that method, in its own Ray
namespace, so the methods' served clusters run side by side in one Ray session). Imports no
torch and no Ray at load."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import PurePath

from specmesh.cluster.config import DEFAULT_NAMESPACE, ClusterConfig
from specmesh.cluster.drafter_option import parse_drafter



@dataclass(frozen=True)
class BenchDrafter:
    """One compared method: ``label`` (in system names, e.g. ``served k=4 eagle``), ``spec``
    (as typed), ``method`` (registry name) and its ``method_kwargs``."""

    label: str
    spec: str
    method: str
    method_kwargs: dict = field(default_factory=dict, hash=False)
    #: torch threads per role of its served cluster over the bench's plan (empty: the plan)
    threads: dict = field(default_factory=dict, hash=False)

    @property
    def served_only(self) -> bool:
        """A thread-plan variant: in-process runs would repeat its method's."""
        return bool(self.threads)

    def as_dict(self) -> dict:
        return {"label": self.label, "spec": self.spec, "method": self.method,
                "method_kwargs": dict(self.method_kwargs), "threads": dict(self.threads)}


def _label(method: str, kwargs: dict) -> str:
    """The method as users type it (drafter/registry.py), with the last part of the value of
    its positional option (a head's or a draft model's path) when it has one."""
    from specmesh.drafter.registry import get_method, spelling

    kind = spelling(method)
    positional = get_method(method).options.positional
    path = kwargs.get(positional.kwarg) if positional is not None else None
    return f"{kind}:{PurePath(str(path)).name or path}" if path else kind


def parse_drafters(text: str, model: str | None = None) -> list[BenchDrafter]:
    """``"ngram,eagle"`` -> one :class:`BenchDrafter` per form, in order (``auto`` resolved for
    target ``model``). Two forms that name the same method and arguments are refused; two
    different heads whose directory names agree are labelled by their forms as typed.

    Raises:
        SystemExit: an empty list, an unknown form (naming it and the forms accepted), or a
            method listed twice.
    """
    from specmesh.cluster.options import parse_thread_plan

    out: list[BenchDrafter] = []
    for part in (text or "").split(","):
        spec = part.strip()
        if not spec:
            continue
        form, _, plan = spec.partition("@")
        try:
            method, kwargs = parse_drafter(form, model)
            threads = parse_thread_plan(plan.replace("+", ",")) if plan else {}
        except SystemExit as e:
            raise SystemExit(f"--drafters: {e}") from None
        for d in out:
            if (d.method, d.method_kwargs, d.threads) == (method, kwargs, threads):
                raise SystemExit(f"--drafters: {spec!r} is the same method as {d.spec!r} "
                                 f"({d.label}); list each method once")
        suffix = "@" + "+".join(f"{r}={n}" for r, n in threads.items()) if threads else ""
        label = _label(method, kwargs) + suffix
        if any(d.label == label for d in out):
            label = form + suffix
        out.append(BenchDrafter(label, spec, method, kwargs, threads))
    if not out:
        raise SystemExit("--drafters: no draft method given (e.g. ngram,eagle)")
    return out


def cluster_drafter(cfg: ClusterConfig) -> BenchDrafter:
    """The method ``cfg`` already runs (the bench's default: the cluster's ``--drafter``)."""
    kwargs = dict(cfg.drafter.method_kwargs)
    return BenchDrafter(_label(cfg.drafter.method, kwargs), cfg.drafter.method,
                        cfg.drafter.method, kwargs)


def namespace_for(d: BenchDrafter, index: int) -> str:
    """A Ray namespace of its own for the served cluster of the ``index``-th method."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", d.label).strip("-") or "method"
    return f"{DEFAULT_NAMESPACE}-bench-{index}-{slug}"


def with_drafter(cfg: ClusterConfig, d: BenchDrafter, namespace: str | None = None,
                 ) -> ClusterConfig:
    """``cfg`` running method ``d`` on verifier and drafter (and in ``namespace`` when
    given), under ``d``'s thread plan over ``cfg``'s (``cfg``'s default plan becomes ``d``'s
    method's default: a model drafter leaves the verifier one core fewer); everything else
    as it is."""
    from specmesh.cluster.config import default_threads
    from specmesh.cluster.options import is_model_drafter

    threads = cfg.threads
    if threads == default_threads(model_drafter=is_model_drafter(cfg.drafter.method)):
        # the default plan, not one the user set: each method gets its own default
        threads = default_threads(model_drafter=is_model_drafter(d.method))
    out = replace(cfg, verifier=replace(cfg.verifier, draft_method=d.method),
                  drafter=replace(cfg.drafter, method=d.method,
                                  method_kwargs=dict(d.method_kwargs)),
                  threads={**threads, **d.threads})
    return replace(out, namespace=namespace) if namespace else out
