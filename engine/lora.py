"""LoRA adapters served next to the base model: a batch mixes rows of several adapters and of the
base in one forward.

An adapter is a PEFT directory (read and checked by engine/lora_peft.py): per target linear layer
a pair ``lora_A`` [r, in] / ``lora_B`` [out, r] and the scale ``lora_alpha / r`` (``/ sqrt(r)``
with rsLoRA). The base weights are never changed (no merge): every row of a forward carries an
adapter index (``-1``: the base model), and each adapted linear layer adds, for the rows of each
adapter, ``delta = (x[rows] @ A.T) @ B.T * scale`` to its base output, as PEFT's unmerged
``LoraLayer`` computes it (``lora_B(lora_A(x)) * scaling``). Rows are grouped per adapter: two
small products per adapter and layer (the "grouped products" of S-LoRA / vLLM's punica path,
here a torch reference on the CPU).

Row invariance (docs/architecture.md, 'Batch invariance'): a row's delta does not depend on the
other rows of the call, so a prefill chunk, a one-token decode step and a ragged verify chunk
compute a row alike and greedy speculation stays exact. The products run on oneDNN packs where
they apply (engine/onednn.py: checked row-invariant, one-row inputs run as two rows), otherwise on
``F.linear`` with a one-row input run as two rows; the add is elementwise. Base rows are not
touched at all: their outputs are the base model's bit for bit, whatever adapters share the batch.

Targets: the decoder layers' q/k/v/o and gate/up/down projections and ``lm_head``. An adapter
on the embeddings (``embed_tokens``), with DoRA, biases, ``modules_to_save`` or per-module rank /
alpha patterns is refused (ValueError) rather than served differently from PEFT.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specmesh.engine import onednn
from specmesh.engine.linear import RowInvariantLinear
from specmesh.engine.lora_peft import HEAD, LoraAdapter

log = logging.getLogger(__name__)

#: Adapter index of a row of the base model.
BASE = -1


@dataclass
class LoraWeights:
    """One adapted layer of one adapter: ``a`` [r, in], ``b`` [out, r] (the model's dtype),
    ``scale`` (alpha / r), and their oneDNN packs (None where F.linear runs)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    a_packed: torch.Tensor | None = None
    b_packed: torch.Tensor | None = None

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] -> (x @ a.T @ b.T) * scale, [M, out]; each row as if computed alone."""
        return _product(_product(x, self.a, self.a_packed), self.b, self.b_packed) * self.scale


def _product(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] @ w.T, row-invariant: a pack where one was made for x's dtype, else F.linear
    with a one-row input run as two rows (module docstring)."""
    if packed is not None and x.dtype == w.dtype and x.is_cpu:
        return onednn.linear(x, packed, None)
    if x.shape[0] == 1:
        return F.linear(torch.cat([x, x]), w)[:1]
    return F.linear(x, w)


class LinearLora:
    """The adapters of one linear layer, by slot; adds their deltas to the rows of the
    current batch (:meth:`LoraBank.batch`)."""

    def __init__(self, bank: "LoraBank", head: bool) -> None:
        self.bank = bank
        self.head = head  # lm_head: its rows are the forward's logits rows
        self.slots: dict[int, LoraWeights] = {}

    def add_to(self, x: torch.Tensor, y: torch.Tensor, cols: slice | None = None) -> None:
        """Add in place, to the rows of each adapter of the current batch, ``x`` [M, in]'s
        delta to ``y`` [M, out] (``cols``: the columns of ``y`` this layer fills, for
        products fused with other layers)."""
        groups = self.bank.head_groups if self.head else self.bank.groups
        for slot, rows in groups:
            w = self.slots.get(slot)
            if w is None:
                continue
            d = w.delta(x[rows])
            if cols is None:
                y[rows] += d
            else:
                y[rows, cols] += d


class LoraBank:
    """The adapters one model serves, in slots 0, 1, ... (a request names its slot; -1 is the
    base). Attached to the model's linear layers as :class:`LinearLora` (``_lora``); the
    model's forward opens :meth:`batch` with each row's slot.

    Not thread-safe: one forward at a time, as every role runs its model.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.adapters: dict[int, LoraAdapter] = {}
        self.groups: list[tuple[int, torch.Tensor]] = []
        self.head_groups: list[tuple[int, torch.Tensor]] = []
        self._linears = {n: m for n, m in model.named_modules()
                         if isinstance(m, RowInvariantLinear)}

    @property
    def names(self) -> dict[str, int]:
        """Adapter name -> slot."""
        return {a.name: slot for slot, a in self.adapters.items()}

    def slot(self, name: str) -> int:
        """The slot of adapter ``name``. Raises KeyError: not loaded."""
        for slot, a in self.adapters.items():
            if a.name == name:
                return slot
        raise KeyError(f"LoRA adapter {name!r} is not loaded")

    def add(self, adapter: LoraAdapter) -> int:
        """Attach ``adapter`` in the lowest free slot and return it.

        Raises:
            ValueError: its name is taken, or a module it adapts is not a linear layer of the
                model or has another shape.
        """
        if adapter.name in self.names:
            raise ValueError(f"LoRA adapter {adapter.name!r} is already loaded")
        ref = self.model.lm_head.weight
        prepared = {}
        for module, (a, b) in adapter.weights.items():
            lin = self._linears.get(module)
            if lin is None:
                raise ValueError(f"adapter {adapter.name!r}: the model has no linear layer "
                                 f"{module!r}")
            if a.shape[1] != lin.in_features or b.shape[0] != lin.out_features:
                raise ValueError(f"adapter {adapter.name!r}: {module} is [{b.shape[0]}, "
                                 f"{a.shape[1]}], the model's [{lin.out_features}, "
                                 f"{lin.in_features}] (another base model?)")
            saved = adapter.base_weights.get(module)
            if saved is not None and not torch.allclose(
                    saved.float(), lin.weight.detach().float().cpu(), rtol=1e-3, atol=1e-5):
                raise ValueError(f"adapter {adapter.name!r}: the {module} weight it saved is "
                                 "not the model's (another base model, or a trained base "
                                 "layer, which is not served)")
            a, b = a.to(ref.dtype).to(ref.device), b.to(ref.dtype).to(ref.device)
            prepared[module] = LoraWeights(a, b, adapter.scale, onednn.pack(a, None),
                                           onednn.pack(b, None))
        slot = next(i for i in range(len(self.adapters) + 1) if i not in self.adapters)
        for module, w in prepared.items():
            lin = self._linears[module]
            if getattr(lin, "_lora", None) is None:
                lin._lora = LinearLora(self, head=module == HEAD)
            lin._lora.slots[slot] = w
        self.adapters[slot] = adapter
        return slot

    def remove(self, name: str) -> int:
        """Detach adapter ``name``; returns the slot it held. Raises KeyError: not loaded."""
        slot = self.slot(name)
        for lin in self._linears.values():
            lora = getattr(lin, "_lora", None)
            if lora is not None:
                lora.slots.pop(slot, None)
        del self.adapters[slot]
        return slot

    @contextlib.contextmanager
    def batch(self, adapter_rows: torch.Tensor | None,
              logits_indices: torch.Tensor | list[int] | None = None) -> Iterator[bool]:
        """Within the block the model's linear layers add each row's adapter delta:
        ``adapter_rows`` LongTensor [T] (slot per row, -1 base; None: all base),
        ``logits_indices`` the rows ``lm_head`` sees (None: all). Yields whether any row uses
        an adapter (the compiled stack, which knows no adapters, must then not run).

        Raises:
            ValueError: a slot that holds no adapter.
        """
        groups: list[tuple[int, torch.Tensor]] = []
        head: list[tuple[int, torch.Tensor]] = []
        if adapter_rows is not None and bool((adapter_rows != BASE).any()):
            head_rows = adapter_rows if logits_indices is None else \
                adapter_rows[torch.as_tensor(logits_indices, device=adapter_rows.device)]
            for slot in sorted(set(adapter_rows.tolist()) - {BASE}):
                if slot not in self.adapters:
                    raise ValueError(f"no LoRA adapter in slot {slot}")
                groups.append((slot, (adapter_rows == slot).nonzero().flatten()))
                rows = (head_rows == slot).nonzero().flatten()
                if rows.numel():
                    head.append((slot, rows))
        self.groups, self.head_groups = groups, head
        try:
            yield bool(groups)
        finally:
            self.groups, self.head_groups = [], []


def load_lora_modules(model: torch.nn.Module, modules: dict[str, str],
                      warn=None) -> LoraBank:  # noqa: ANN001
    """Load every adapter of ``modules`` ({name: path}) into ``model``'s bank, in name order
    (so that every role gives a name the same slot); ``warn(message)`` (None: the module
    logger) hears of an adapter that adapts ``lm_head``: drafters that borrow the target's
    LM head read the base one, so acceptance may drop (outputs do not change).

    Raises:
        FileNotFoundError, ValueError: as :meth:`LoraAdapter.load` and :meth:`LoraBank.add`.
    """
    bank = lora_bank(model)
    for name in sorted(modules):
        adapter = LoraAdapter.load(name, modules[name])
        if adapter.targets_lm_head:
            (warn or log.warning)(
                f"LoRA adapter {name!r} adapts lm_head: drafters that borrow the target's LM "
                "head or embeddings draft from the base model's; outputs are unaffected, "
                "acceptance may drop")
        bank.add(adapter)
    return bank


def adapter_slot(model: torch.nn.Module, name: str) -> int:
    """The slot of adapter ``name`` in ``model``'s bank; ``""`` is the base model (-1).

    Raises:
        KeyError: no adapter of that name is loaded (the message names it).
    """
    if not name:
        return BASE
    bank = getattr(model, "lora", None)
    if bank is None:
        raise KeyError(f"LoRA adapter {name!r} is not loaded (none are)")
    return bank.slot(name)


def lora_refusal(model: torch.nn.Module, name: str) -> str:
    """Why a request for adapter ``name`` cannot run on ``model`` ("" when it can: the base
    model, or a loaded adapter)."""
    try:
        adapter_slot(model, name)
    except KeyError as err:
        return str(err.args[0])
    return ""


def lora_bank(model: torch.nn.Module) -> LoraBank:
    """The model's bank of adapters, made on first use (``model.lora``)."""
    if getattr(model, "lora", None) is None:
        model.lora = LoraBank(model)
    return model.lora


__all__ = ["BASE", "LinearLora", "adapter_slot", "lora_refusal", "LoraAdapter", "LoraBank",
           "LoraWeights", "load_lora_modules", "lora_bank"]
