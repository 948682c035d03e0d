"""One request's EAGLE-head KV for drafting (drafter/eagle/head.py ``EagleHead.extend``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class HeadKV:
    """One request's head KV: per layer keys/values at entry positions ``[start, start + n)``
    (``start``: the first entry's absolute position), held in buffers ``[nkv, capacity, hd]``
    that grow by doubling, so appending an entry copies only that entry and a rollback
    copies nothing."""

    start: int = 0
    n: int = 0
    key_buffers: list[torch.Tensor] = field(default_factory=list)
    value_buffers: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.n

    @property
    def end(self) -> int:
        """Absolute position after the last entry."""
        return self.start + self.n

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per layer the keys [nkv, n, hd] (views)."""
        return [k[:, :self.n] for k in self.key_buffers]

    @property
    def values(self) -> list[torch.Tensor]:
        """Per layer the values [nkv, n, hd] (views)."""
        return [v[:, :self.n] for v in self.value_buffers]

    def write(self, layer: int, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``layer``'s keys/values ``[nkv, m, hd]`` of the entries after the current
        ``n`` and return that layer's keys and values up to them ([nkv, n + m, hd] views).
        :meth:`commit` then counts the m entries (after every layer is written)."""
        m = k.shape[1]
        need = self.n + m
        if layer == len(self.key_buffers):  # first entries of this layer
            cap = max(64, need)
            self.key_buffers.append(k.new_empty((k.shape[0], cap, k.shape[2])))
            self.value_buffers.append(v.new_empty((v.shape[0], cap, v.shape[2])))
        kb, vb = self.key_buffers[layer], self.value_buffers[layer]
        if need > kb.shape[1]:  # grow by doubling: amortised one copy per entry
            cap = max(need, 2 * kb.shape[1])
            kb = torch.cat([kb[:, :self.n], kb.new_empty((kb.shape[0], cap - self.n, kb.shape[2]))], 1)
            vb = torch.cat([vb[:, :self.n], vb.new_empty((vb.shape[0], cap - self.n, vb.shape[2]))], 1)
            self.key_buffers[layer], self.value_buffers[layer] = kb, vb
        kb[:, self.n:need] = k
        vb[:, self.n:need] = v
        return kb[:, :need], vb[:, :need]

    def commit(self, m: int) -> None:
        """Count ``m`` entries written to every layer by :meth:`write`."""
        self.n += m

    def truncate(self, end: int) -> None:
        """Keep entries at positions ``< end``."""
        self.n = min(self.n, max(end - self.start, 0))


__all__ = ["HeadKV"]
