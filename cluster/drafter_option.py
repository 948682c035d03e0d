"""``--drafter``: which draft method a cluster runs, as a user names it.

``ngram`` (prompt lookup; ``ngram:min=1+max=4+width=2`` sets its shortest and longest suffix
match and its tree width, any subset of the three), ``eagle`` (the EAGLE head shipped for the
target), ``eagle:PATH`` (a head trained with ``specmesh train-drafter``), ``draft-model:PATH``
(a standalone draft model with the target's tokenizer), or ``auto`` (the default: the shipped
EAGLE head where the target has one and it does not slow the verifier, else n-gram;
cluster/auto.py).
"""

from __future__ import annotations

DRAFTER_CHOICES = "auto | ngram[:min=N+max=N+width=N] | eagle[:PATH] | draft-model:PATH"

#: ``ngram:KEY=N`` keys -> NgramProposer arguments
NGRAM_KEYS = {"min": "min_ngram", "max": "max_ngram", "width": "tree_width"}


def shipped_head_for(model: str | None):  # noqa: ANN201
    """The head shipped for ``model`` (its config files are read, not its weights), or None."""
    from specmesh.drafter.proposers.eagle import shipped_head
    from specmesh.engine.loader import model_name

    try:
        return shipped_head(model_name(model))
    except (FileNotFoundError, ValueError):
        return None


def parse_drafter(spec: str, model: str | None = None,
                  ngram_tree_width: int | None = None) -> tuple[str, dict]:
    """(registry method name, method kwargs) of a ``--drafter`` value for target ``model``;
    ``ngram_tree_width`` (``--ngram-tree-width``; None: the proposer's default) is the n-gram
    method's ``tree_width`` (branches of its draft trees, 1: chains only).

    Raises:
        SystemExit: an unknown form, a method that needs a path and got none, or a tree width
            below 1.
    """
    if ngram_tree_width is not None and ngram_tree_width < 1:
        raise SystemExit(f"--ngram-tree-width must be >= 1, got {ngram_tree_width}")
    method, kwargs = _parse_drafter(spec, model)
    if method == "ngram" and ngram_tree_width is not None:
        kwargs = {**kwargs, "tree_width": ngram_tree_width}
    return method, kwargs


def add_ngram_tree_option(p) -> None:  # noqa: ANN001
    """``--ngram-tree-width`` on an argparse parser."""
    p.add_argument("--ngram-tree-width", type=int, default=None, metavar="N",
                   help="n-gram drafter: up to N distinct continuations of earlier matches as "
                        "the branches of a draft tree (tree verification; 1: chains only; "
                        "default 2)")


def _parse_drafter(spec: str, model: str | None) -> tuple[str, dict]:
    spec = (spec or "auto").strip()
    kind, sep, path = spec.partition(":")
    if kind == "auto" and not sep:  # cluster/auto.py: a model drafter only where it pays
        from specmesh.cluster.auto_resolve import auto_drafter

        return _parse_drafter(auto_drafter(model)[0], model)
    if kind == "ngram":
        return "ngram", _ngram_kwargs(path) if sep else {}
    if kind == "eagle":
        if sep and not path:
            raise SystemExit("--drafter eagle:PATH needs the head's directory after the colon")
        return "eagle", ({"head": path} if path else {})
    if kind in ("draft-model", "draft_model"):
        if not path:
            raise SystemExit("--drafter draft-model:PATH needs the draft model's path "
                             "(a Hugging Face dir or .gguf with the target's tokenizer)")
        return "draft_model", {"model": path}
    raise SystemExit(f"--drafter {spec!r}: expected {DRAFTER_CHOICES}")


def _ngram_kwargs(text: str) -> dict:
    """``"min=1+width=4"`` -> ``{"min_ngram": 1, "tree_width": 4}``.

    Raises:
        SystemExit: an unknown key, a value that is not a positive integer, or min > max.
    """
    out: dict = {}
    for item in text.split("+"):
        key, eq, value = item.strip().partition("=")
        if key not in NGRAM_KEYS or not eq:
            raise SystemExit(f"--drafter ngram:{text}: expected KEY=N joined by '+', KEY one of "
                             f"{', '.join(NGRAM_KEYS)} (e.g. ngram:min=1+width=2)")
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise SystemExit(f"--drafter ngram:{text}: {key} must be a positive integer, "
                             f"got {value!r}")
        out[NGRAM_KEYS[key]] = n
    from specmesh.drafter.config import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM

    lo = out.get("min_ngram", DEFAULT_MIN_NGRAM)
    hi = out.get("max_ngram", DEFAULT_MAX_NGRAM)
    if lo > hi:
        raise SystemExit(f"--drafter ngram:{text}: min ({lo}) is above max ({hi})")
    return out
