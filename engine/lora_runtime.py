"""LoRA adapters loaded and unloaded while a role serves (vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``; docs/operations.md, 'LoRA adapters'): what a prefill worker or a
verifier does to its model's bank (engine/lora.py) when told, apart from any message.

An unload never pulls an adapter from under a request: the adapter is only marked *unloading*
(it is no longer in :meth:`RuntimeAdapters.current`), and :meth:`RuntimeAdapters.reap` frees it
once ``in_use(name)`` (the role's requests on it) is 0. vLLM keeps serving the requests already
running on an adapter it unloads too (each carries its adapter), so running requests finish
with the adapter they started with, and their KV is freed as usual. Loading a name that is
still unloading from the same path keeps it (the unload is called off); from another path it is
refused until the old one is freed.

Requests name their adapter (``lora_name``), never its slot, so a slot freed by an unload and
reused by a later load never mixes two adapters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from specmesh.engine.lora import load_lora_modules, lora_bank

log = logging.getLogger(__name__)


class LoraOpError(Exception):
    """A load or unload that cannot be applied; ``not_found``: because the adapter does not
    exist (a load's path, an unload's name: vLLM answers 404), else a bad request (400)."""

    def __init__(self, message: str, not_found: bool = False) -> None:
        super().__init__(message)
        self.not_found = not_found


class RuntimeAdapters:
    """The run-time changes of one model's LoRA adapters (module docstring). ``in_use(name)``:
    how many of the role's requests run on adapter ``name`` now. Loop thread only."""

    def __init__(self, model: torch.nn.Module, in_use: Callable[[str], int]) -> None:
        self.model = model
        self.in_use = in_use
        #: adapters to free once no request uses them
        self.unloading: set[str] = set()
        #: called with an adapter's name when it is freed (a prefill worker drops its cached
        #: prompt blocks then: they hold that adapter's KV)
        self.on_freed: Callable[[str], None] | None = None

    def held(self) -> dict[str, str]:
        """Every adapter in the bank, unloading ones included (still computing for their
        requests): name -> path."""
        bank = getattr(self.model, "lora", None)
        if bank is None:
            return {}
        # (a snapshot: a role's stats read it from another thread)
        return {a.name: a.path for a in list(bank.adapters.values())}

    def current(self) -> dict[str, str]:
        """The adapters served now ({name: path}): loaded and not unloading."""
        unloading = set(self.unloading)
        return {n: p for n, p in self.held().items() if n not in unloading}

    def load(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at ``path`` as ``name``. Loading the same name and path
        again is a no-op (a prefill worker hears every verifier's load), and calls off its
        pending unload.

        Raises:
            LoraOpError: the name serves another path (or is still unloading one), the path
                holds no adapter (``not_found``), or the adapter cannot be served (its reason:
                another model's shapes, embeddings, DoRA ...).
        """
        loaded = self.held()
        if name in loaded:
            if _same_path(loaded[name], path):
                self.unloading.discard(name)
                return
            if name in self.unloading:
                raise LoraOpError(f"LoRA adapter {name!r} is still in use by "
                                  f"{self.in_use(name)} running requests (unloading); load it "
                                  "again once they finish")
            raise LoraOpError(f"The lora adapter '{name}' has already been loaded.")
        try:
            load_lora_modules(self.model, {name: path})
        except FileNotFoundError as err:
            raise LoraOpError(f"No adapter found for {name!r} at {path!r}: {err}",
                              not_found=True) from None
        except Exception as err:  # noqa: BLE001 - a bad adapter never kills a role
            raise LoraOpError(f"LoRA adapter {name!r} at {path!r} cannot be served: {err}"
                              ) from None
        log.info("LoRA adapter %s loaded from %s", name, path)

    def unload(self, name: str) -> int:
        """Stop serving ``name``; returns the requests still running on it (it is freed at
        once when none, else by :meth:`reap` after them).

        Raises:
            LoraOpError: (``not_found``) no adapter of that name is served.
        """
        if name not in self.current():
            raise LoraOpError(f"The lora adapter '{name}' cannot be found.", not_found=True)
        self.unloading.add(name)
        self.reap()
        return self.in_use(name) if name in self.unloading else 0

    def sync(self, adapters: dict[str, str]) -> list[str]:
        """Serve exactly ``adapters`` ({name: path}): unload what is not listed (or listed
        with another path), load what is missing. Returns the errors (one per adapter that
        could not be loaded), applying all it can."""
        errors = []
        for name, path in self.current().items():
            if name not in adapters or not _same_path(path, adapters[name]):
                self.unload(name)
        for name, path in sorted(adapters.items()):
            try:
                self.load(name, path)
            except LoraOpError as err:
                errors.append(str(err))
        return errors

    def reap(self) -> list[str]:
        """Free the unloading adapters no request uses any more; returns their names."""
        freed = []
        for name in sorted(self.unloading):
            if self.in_use(name):
                continue
            self.unloading.discard(name)
            bank = lora_bank(self.model)
            if name in bank.names:  # (roles of one process may share a model and its bank)
                bank.remove(name)
            freed.append(name)
            log.info("LoRA adapter %s unloaded", name)
            if self.on_freed is not None:
                self.on_freed(name)
        return freed


def _same_path(a: str, b: str) -> bool:
    """Whether two adapter paths name one directory."""
    return a == b or Path(a).resolve() == Path(b).resolve()


__all__ = ["LoraOpError", "RuntimeAdapters"]
