"""Which verifier a new request goes to (docs/architecture.md, 'Life of a request' step 2):
the one its sibling group (the ``n`` choices of a prompt, decode/siblings.py) went to, so the
prompt is prefilled once for all of them, else ``pick_verifier()`` (least loaded), asked again
while no verifier is connected (a cluster still starting, a verifier restarting), for at most
``verifier_wait_s``. A mixin of :class:`gateway.backend.MailboxBackend` (its ``_groups``,
``_gone``, ``_lock``, ``clock``, ``pick_verifier`` and ``verifier_wait_s``)."""

from __future__ import annotations

import asyncio

from specmesh.protocol.messages import GenerateRequest

#: How long a new request waits for a verifier to be connected (a cluster still starting, a
#: verifier restarting) before it fails, seconds; and how often it looks again.
VERIFIER_WAIT_S = 30.0
VERIFIER_POLL_S = 0.05


class VerifierChoice:
    """Picks the verifier of a new request (see the module docstring)."""

    def _group_verifier(self, req: GenerateRequest) -> str | None:
        """The verifier the other requests of ``req``'s sibling group (the ``n`` choices of a
        prompt, decode/siblings.py) went to: one verifier prefills the prompt once for all."""
        if not req.group:
            return None
        with self._lock:
            entry = self._groups.get(req.group)
        return entry[0] if entry is not None and entry[0] not in self._gone else None

    def _join_group(self, req: GenerateRequest, verifier: str) -> None:
        """Remember ``req``'s group's verifier until all ``group_size`` requests were sent."""
        if not req.group or req.group_size < 2:
            return
        with self._lock:
            _, sent = self._groups.get(req.group, (verifier, 0))
            if sent + 1 >= req.group_size:
                self._groups.pop(req.group, None)
            else:
                self._groups[req.group] = (verifier, sent + 1)

    async def _wait_for_verifier(self) -> str:
        """``pick_verifier()``, asked again every VERIFIER_POLL_S while it raises, for at most
        ``verifier_wait_s``.

        Raises:
            ConnectionError: still no verifier after ``verifier_wait_s`` (the last error says
                why).
        """
        deadline = self.clock() + self.verifier_wait_s
        while True:
            try:
                return self.pick_verifier()
            except Exception as err:  # noqa: BLE001 - whatever says "not now"
                if self.clock() >= deadline:
                    raise ConnectionError(f"{err} (waited {self.verifier_wait_s:g} s)") from err
            await asyncio.sleep(VERIFIER_POLL_S)
