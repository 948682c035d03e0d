"""The gateway's control of run-time LoRA adapters (gateway/lora_control.py), against fake
verifiers that answer from another thread as the backend's reader does: a load waits for every
verifier and the prefill workers each relayed to, a load that failed anywhere is unloaded
again everywhere and answered with vLLM's status, a role that never answers is a 504, and a
verifier that restarts is sent the whole list."""

from __future__ import annotations

import asyncio
import threading

import pytest

from specmesh.gateway.lora_control import LoraControl, LoraRefusal
from specmesh.protocol.messages import LoraAdapterOp, LoraAdapterResult


class FakeVerifiers:
    """Each verifier answers an operation (and, for its prefill workers, their answers) on a
    thread, as the backend's reader delivers them; ``fail``: (instance, op) -> error."""

    def __init__(self, verifiers: dict[str, list[str]]) -> None:
        self.verifiers = verifiers  # verifier -> its prefill workers
        self.sent: list[tuple[str, LoraAdapterOp]] = []
        self.fail: dict[tuple[str, str], tuple[str, bool]] = {}
        self.silent: set[str] = set()
        self.control: LoraControl | None = None

    def send(self, peer: str, msg: LoraAdapterOp) -> None:
        self.sent.append((peer, msg))
        threading.Thread(target=self._answer, args=(peer, msg)).start()

    def _answer(self, peer: str, msg: LoraAdapterOp) -> None:
        def result(who: str, **kw) -> LoraAdapterResult:
            error, not_found = self.fail.get((who, msg.op), ("", False))
            return LoraAdapterResult(op=msg.op, op_id=msg.op_id, instance_id=who,
                                     lora_name=msg.lora_name, error=error,
                                     not_found=not_found, **kw)
        own = result(peer, relayed_to=self.verifiers[peer])
        self.control.on_result(peer, own)
        if own.error:
            return
        for p in self.verifiers[peer]:
            if p not in self.silent:
                self.control.on_result(peer, result(p))


def _control(verifiers: dict[str, list[str]], wait_s: float = 5.0):
    fake = FakeVerifiers(verifiers)
    fake.control = LoraControl(fake.send, lambda: list(verifiers), {"start": "/a/start"},
                               wait_s=wait_s)
    return fake, fake.control


def test_load_waits_for_every_role_then_lists_the_adapter():
    fake, c = _control({"v0": ["p0"], "v1": ["p0", "p1"]})
    text = asyncio.run(c.load("new", "/a/new"))
    assert text == "Success: LoRA adapter 'new' added successfully."
    assert c.adapters == {"start": "/a/start", "new": "/a/new"}
    assert sorted(p for p, m in fake.sent) == ["v0", "v1"]
    with pytest.raises(LoraRefusal, match="has already been loaded") as err:
        asyncio.run(c.load("new", "/a/new"))
    assert err.value.status_code == 400


@pytest.mark.parametrize("not_found,status", [(True, 404), (False, 400)])
def test_a_load_failed_on_a_prefill_worker_is_unloaded_everywhere(not_found, status):
    fake, c = _control({"v0": ["p0"], "v1": ["p1"]})
    fake.fail[("p1", "load")] = ("No adapter found" if not_found else "bad shapes", not_found)
    with pytest.raises(LoraRefusal) as err:
        asyncio.run(c.load("new", "/a/new"))
    assert err.value.status_code == status and "(on p1)" in err.value.message
    assert err.value.type == ("NotFoundError" if not_found else "BadRequestError")
    assert "new" not in c.adapters
    ops = [(p, m.op, m.lora_name) for p, m in fake.sent]
    assert sorted(ops[2:]) == [("v0", "unload", "new"), ("v1", "unload", "new")]


def test_a_silent_role_is_a_504_and_the_load_is_undone():
    fake, c = _control({"v0": ["p0"]}, wait_s=0.5)
    fake.silent.add("p0")
    with pytest.raises(LoraRefusal, match="no answer from p0") as err:
        asyncio.run(c.load("new", "/a/new"))
    assert err.value.status_code == 504 and "new" not in c.adapters
    assert [m.op for _, m in fake.sent] == ["load", "unload"]


def test_unload_and_its_errors():
    fake, c = _control({"v0": ["p0"]})
    with pytest.raises(LoraRefusal, match="cannot be found") as err:
        asyncio.run(c.unload("nope"))
    assert err.value.status_code == 404
    with pytest.raises(LoraRefusal, match="needs to be provided") as err:
        asyncio.run(c.unload(""))
    assert err.value.status_code == 400
    assert asyncio.run(c.unload("start")) == "Success: LoRA adapter 'start' removed successfully."
    assert c.adapters == {} and fake.sent[-1][1].op == "unload"


def test_no_verifier_is_a_503():
    c = LoraControl(lambda p, m: None, lambda: [])
    with pytest.raises(LoraRefusal) as err:
        asyncio.run(c.load("new", "/a/new"))
    assert err.value.status_code == 503


def test_a_restarted_verifier_gets_the_whole_list():
    fake, c = _control({"v0": []})
    asyncio.run(c.load("new", "/a/new"))
    c.verifier_joined("v0")
    peer, msg = fake.sent[-1]
    assert peer == "v0" and msg.op == "sync"
    assert msg.adapters == {"start": "/a/start", "new": "/a/new"}
