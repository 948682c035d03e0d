"""``--drafter``: which draft method a cluster runs, as a user names it.

``ngram`` (prompt lookup), ``eagle`` (the EAGLE head shipped for the target), ``eagle:PATH``
(a head trained with ``specmesh train-drafter``), ``draft-model:PATH`` (a standalone draft
model with the target's tokenizer), or ``auto`` (the default: the shipped EAGLE head when the
target has one, else n-gram).
"""

from __future__ import annotations

DRAFTER_CHOICES = "auto | ngram | eagle[:PATH] | draft-model:PATH"


def shipped_head_for(model: str | None):  # noqa: ANN201
    """The head shipped for ``model`` (its config files are read, not its weights), or None."""
    from drafter.proposers.eagle import shipped_head
    from engine.loader import model_name

    try:
        return shipped_head(model_name(model))
    except (FileNotFoundError, ValueError):
        return None


def parse_drafter(spec: str, model: str | None = None) -> tuple[str, dict]:
    """(registry method name, method kwargs) of a ``--drafter`` value for target ``model``.

    Raises:
        SystemExit: an unknown form, or a method that needs a path and got none.
    """
    spec = (spec or "auto").strip()
    kind, sep, path = spec.partition(":")
    if kind == "auto" and not sep:
        return ("eagle", {}) if shipped_head_for(model) is not None else ("ngram", {})
    if kind == "ngram" and not sep:
        return "ngram", {}
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
