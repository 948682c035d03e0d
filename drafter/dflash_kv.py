"""One request's DFlash context KV (drafter/dflash_model.py): per draft layer, the K/V of the
target hidden-state rows at contiguous positions ``[start, end)``, written when the verifier's
rows arrive (DraftSync, VerifyCommit) and never by the draft's own forwards.

Storage grows by doubling (amortised O(1) per row), so :attr:`ContextKV.nbytes` is what the
request holds, capacity included: the ``draft_kv_pool_bytes`` a DFlash drafter reports is the
sum over its requests.
"""

from __future__ import annotations

import torch

from specmesh.drafter.dflash_model import LayerKV


class ContextKV:
    """K/V rows at positions ``[start, end)`` for each layer (empty: ``start`` is -1)."""

    def __init__(self) -> None:
        self.start = -1
        self.length = 0
        self._k: list[torch.Tensor] = []  # per layer [nkv, capacity, hd]
        self._v: list[torch.Tensor] = []

    @property
    def end(self) -> int:
        """One past the last position held (``start`` when empty)."""
        return self.start + self.length

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._k, *self._v))

    def layers(self, end: int | None = None) -> list[LayerKV]:
        """Per layer, views ``(k, v)`` [nkv, n, hd] of the rows at positions before ``end``
        (default: all held)."""
        n = self.length if end is None else max(0, min(self.length, end - self.start))
        return [(k[:, :n], v[:, :n]) for k, v in zip(self._k, self._v)]

    def write(self, start: int, kv: list[LayerKV]) -> None:
        """Hold ``kv`` (per layer [nkv, n, hd]) at positions ``[start, start + n)``: rows from
        ``start`` on are replaced; a ``start`` outside ``[self.start, self.end]`` (a gap, or an
        empty KV) restarts the KV there.

        Raises:
            ValueError: layers of differing row counts.
        """
        n = kv[0][0].shape[1] if kv else 0
        if any(k.shape[1] != n or v.shape[1] != n for k, v in kv):
            raise ValueError("context K/V rows differ between layers")
        if n == 0:
            return
        if self.length == 0 or not self.start <= start <= self.end:
            self.start, self.length = start, 0
            if not self._k or len(self._k) != len(kv):
                self._k = [k.new_empty(k.shape[0], max(n, 16), k.shape[2]) for k, _ in kv]
                self._v = [v.new_empty(v.shape[0], max(n, 16), v.shape[2]) for _, v in kv]
        keep = start - self.start
        need = keep + n
        if need > self._k[0].shape[1]:
            cap = max(need, 2 * self._k[0].shape[1])
            self._k = [_grown(t, cap, keep) for t in self._k]
            self._v = [_grown(t, cap, keep) for t in self._v]
        for dst_k, dst_v, (k, v) in zip(self._k, self._v, kv):
            dst_k[:, keep:need] = k
            dst_v[:, keep:need] = v
        self.length = need

    def truncate(self, end: int) -> None:
        """Forget the rows at positions ``>= end``."""
        if self.length:
            self.length = max(0, min(self.length, end - self.start))


def _grown(t: torch.Tensor, cap: int, keep: int) -> torch.Tensor:
    out = t.new_empty(t.shape[0], cap, t.shape[2])
    out[:, :keep] = t[:, :keep]
    return out
