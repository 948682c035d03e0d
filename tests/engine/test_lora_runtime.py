"""LoRA adapters loaded and unloaded at run time, on the roles' side (issue 37): the model's
bank changes (engine/lora_runtime.py), an unload waits for the requests on the adapter, the
verifier relays operations to its prefill workers and their answers to the gateway
(decode/lora_relay.py), and a prefill worker shared by several verifiers unloads only once
every verifier released the adapter (prefill/lora_ops.py)."""

from __future__ import annotations

import pytest
import torch

from specmesh.decode.lora_relay import OWN_OP_ID, VerifierLora
from specmesh.engine.lora import adapter_slot
from specmesh.engine.lora_runtime import LoraOpError, RuntimeAdapters
from specmesh.prefill.lora_ops import PrefillLora
from specmesh.protocol.messages import LoraAdapterOp, LoraAdapterResult
from helpers.lora import make_tiny_adapter
from helpers.models import tiny_llama


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    hf, _, _ = tiny_llama(seed=5, dtype=torch.float32)
    root = tmp_path_factory.mktemp("lora-runtime")
    return {"a": make_tiny_adapter(hf, root / "a", seed=1),
            "b": make_tiny_adapter(hf, root / "b", seed=2, targets=["q_proj", "v_proj"])}


def _model():
    return tiny_llama(seed=5, dtype=torch.float32)[1]


def _op(op: str, op_id: int = 1, name: str = "", path: str = "", **kw) -> LoraAdapterOp:
    return LoraAdapterOp(op=op, op_id=op_id, lora_name=name, lora_path=path, **kw)


class Outbox:
    """A role's send: every message, by peer."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    def __call__(self, peer: str, msg: object) -> bool:
        self.sent.append((peer, msg))
        return True

    def to(self, peer: str) -> list:
        return [m for p, m in self.sent if p == peer]


def test_load_unload_and_the_errors_vllm_answers(adapters, tmp_path):
    model = _model()
    in_use = {"a": 0}
    rt = RuntimeAdapters(model, lambda n: in_use.get(n, 0))
    rt.load("a", adapters["a"])
    assert rt.current() == {"a": adapters["a"]} and adapter_slot(model, "a") == 0
    rt.load("a", adapters["a"])  # the same adapter again: a no-op (a shared prefill worker)
    with pytest.raises(LoraOpError, match="has already been loaded") as err:
        rt.load("a", adapters["b"])
    assert not err.value.not_found
    with pytest.raises(LoraOpError, match="No adapter found") as err:
        rt.load("c", str(tmp_path / "nowhere"))
    assert err.value.not_found and "c" not in rt.current()
    with pytest.raises(LoraOpError, match="cannot be found") as err:
        rt.unload("zzz")
    assert err.value.not_found
    in_use["a"] = 2  # two requests run on it: it is only marked
    assert rt.unload("a") == 2
    assert rt.current() == {} and adapter_slot(model, "a") == 0  # still computes for them
    with pytest.raises(LoraOpError, match="still in use by 2"):
        rt.load("a", adapters["b"])  # another adapter under its name: not while it drains
    assert rt.reap() == []
    in_use["a"] = 0
    assert rt.reap() == ["a"]
    with pytest.raises(KeyError):
        adapter_slot(model, "a")
    rt.load("a", adapters["b"])  # the name is free again
    assert rt.current() == {"a": adapters["b"]}


def test_reloading_a_draining_adapter_calls_the_unload_off(adapters):
    rt = RuntimeAdapters(_model(), lambda n: 1)
    rt.load("a", adapters["a"])
    assert rt.unload("a") == 1 and rt.current() == {}
    rt.load("a", adapters["a"])
    assert rt.current() == {"a": adapters["a"]} and rt.reap() == [] and not rt.unloading


def test_sync_serves_exactly_the_list(adapters, tmp_path):
    rt = RuntimeAdapters(_model(), lambda n: 0)
    rt.load("a", adapters["a"])
    errors = rt.sync({"b": adapters["b"], "c": str(tmp_path / "nowhere")})
    assert rt.current() == {"b": adapters["b"]}
    assert len(errors) == 1 and "'c'" in errors[0]


def test_verifier_relays_loads_and_unloads_after_its_requests(adapters, tmp_path):
    out = Outbox()
    in_use = {}
    v = VerifierLora(RuntimeAdapters(_model(), lambda n: in_use.get(n, 0)), out,
                     lambda: ["prefill-0", "prefill-1"], "verifier-0")
    v.on_op("gw", _op("load", 7, "a", adapters["a"]))
    (ans,) = out.to("gw")
    assert ans.op_id == 7 and not ans.error and ans.relayed_to == ["prefill-0", "prefill-1"]
    assert [m.lora_name for m in out.to("prefill-0")] == ["a"]
    # a bad path: refused here (404's not_found) and not relayed
    v.on_op("gw", _op("load", 8, "b", str(tmp_path / "nowhere")))
    ans = out.to("gw")[-1]
    assert ans.not_found and "No adapter found" in ans.error and ans.relayed_to == []
    assert len(out.to("prefill-0")) == 1
    # unload while a request runs on it: answered at once, relayed to prefill when freed
    in_use["a"] = 1
    v.on_op("gw", _op("unload", 9, "a"))
    ans = out.to("gw")[-1]
    assert ans.num_in_use == 1 and not ans.error and ans.relayed_to == []
    assert v.reap() == [] and len(out.to("prefill-0")) == 1
    # a prefill worker that (re)connects meanwhile still gets it: our request prefills on it
    v.prefill_joined("prefill-9")
    assert out.to("prefill-9")[-1].adapters == {"a": adapters["a"]}
    in_use["a"] = 0
    assert v.reap() == ["a"]
    relayed = out.to("prefill-1")[-1]
    assert relayed.op == "unload" and relayed.op_id == 9 and relayed.lora_name == "a"
    # a prefill worker's answer goes to the gateway of the operation; one of our own is not
    assert v.on_result("prefill-0", LoraAdapterResult(op="unload", op_id=9,
                                                      instance_id="prefill-0"))
    assert out.to("gw")[-1].instance_id == "prefill-0"
    assert not v.on_result("prefill-0", LoraAdapterResult(op="sync", op_id=OWN_OP_ID,
                                                          instance_id="prefill-0"))
    # a prefill worker that (re)joins is sent the set served here
    v.on_op("gw", _op("load", 10, "b", adapters["b"]))
    v.prefill_joined("prefill-2")
    (sync,) = out.to("prefill-2")
    assert sync.op == "sync" and sync.adapters == {"b": adapters["b"]}


def test_shared_prefill_unloads_once_every_verifier_released(adapters):
    out = Outbox()
    queued = {"a": 0}
    p = PrefillLora(RuntimeAdapters(_model(), lambda n: queued.get(n, 0)), out, "prefill-0")
    p.set_verifiers(["v0", "v1"])
    p.on_op("v0", _op("load", 1, "a", adapters["a"]))
    p.on_op("v1", _op("load", 1, "a", adapters["a"]))  # the same load by the other verifier
    assert [m.error for _, m in out.sent] == ["", ""]
    p.on_op("v0", _op("unload", 2, "a"))
    assert p.runtime.current() == {"a": adapters["a"]}  # v1 may still send prompts on it
    queued["a"] = 1
    p.on_op("v1", _op("unload", 2, "a"))
    assert out.to("v1")[-1].num_in_use == 1 and p.runtime.current() == {}
    assert p.reap() == []
    queued["a"] = 0
    assert p.reap() == ["a"]
    # a verifier leaving the roster releases what it held
    p.on_op("v0", _op("load", 3, "b", adapters["b"]))
    p.on_op("v0", _op("unload", 4, "b"))
    assert "b" in p.runtime.current()
    p.set_verifiers(["v0"])
    assert p.runtime.current() == {}
    # a sync loads what it lists and releases the rest
    p.on_op("v0", _op("sync", 5, adapters={"a": adapters["a"]}))
    assert p.runtime.current() == {"a": adapters["a"]} and out.to("v0")[-1].error == ""
    p.on_op("v0", _op("sync", 6, adapters={}))
    assert p.runtime.current() == {}
