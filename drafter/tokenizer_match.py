"""The vocabulary check of a model drafter (docs/architecture.md, 'Drafting'): a draft model
proposes token ids,
and the verifier compares them with the target's, so both tokenizers must map every token to
the same id. Checked by size (tokenizer lengths, not embedding rows, which may be padded) and
by the token-to-id maps (``tokenizer.get_vocab()``)."""

from __future__ import annotations

from typing import Any


def _show(token: str | None) -> str:
    return "absent" if token is None else repr(token)


def first_vocabulary_difference(
    target_vocab: dict[str, int], draft_vocab: dict[str, int]
) -> tuple[int, str | None, str | None] | None:
    """The lowest id whose token differs between two token-to-id maps, as
    ``(id, target token or None, draft token or None)``; None when the maps are equal."""
    if target_vocab == draft_vocab:
        return None
    target_by_id = {i: t for t, i in target_vocab.items()}
    draft_by_id = {i: t for t, i in draft_vocab.items()}
    for i in sorted(set(target_by_id) | set(draft_by_id)):
        if target_by_id.get(i) != draft_by_id.get(i):
            return i, target_by_id.get(i), draft_by_id.get(i)
    # same ids and tokens by id, yet different maps: a token listed under two ids in one map
    for tok in sorted(set(target_vocab) | set(draft_vocab)):
        if target_vocab.get(tok) != draft_vocab.get(tok):
            i = target_vocab.get(tok, draft_vocab.get(tok))
            return int(i), tok if tok in target_vocab else None, tok if tok in draft_vocab else None
    return None  # pragma: no cover  (unequal dicts differ at some key)


def check_same_vocabulary(target_tokenizer: Any, draft_tokenizer: Any,
                          target_name: str = "target", draft_name: str = "draft") -> None:
    """Refuse a draft model whose tokenizer does not map every token to the target's id.

    Args:
        target_tokenizer, draft_tokenizer: Hugging Face tokenizers (``len()`` and
            ``get_vocab()``, added tokens included).
        target_name, draft_name: model names for the error message.

    Raises:
        ValueError: a tokenizer is missing, the tokenizer lengths differ, or the token-to-id
            maps differ; the message names both models and the first differing token (lowest
            id whose token differs).
    """
    if target_tokenizer is None or draft_tokenizer is None:
        which = draft_name if draft_tokenizer is None else target_name
        raise ValueError(f"cannot check that draft model {draft_name!r} and target "
                         f"{target_name!r} share a vocabulary: {which!r} has no tokenizer")
    n_target, n_draft = len(target_tokenizer), len(draft_tokenizer)
    diff = first_vocabulary_difference(target_tokenizer.get_vocab(), draft_tokenizer.get_vocab())
    where = ""
    if diff is not None:
        i, t_tok, d_tok = diff
        where = (f"; first differing token: id {i} is {_show(t_tok)} in {target_name!r} "
                 f"and {_show(d_tok)} in {draft_name!r}")
    if n_target != n_draft:
        raise ValueError(f"draft model {draft_name!r} has a vocabulary of {n_draft} tokens, "
                         f"target {target_name!r} one of {n_target}{where}")
    if diff is not None:
        raise ValueError(f"draft model {draft_name!r} and target {target_name!r} map tokens "
                         f"to different ids{where}")
