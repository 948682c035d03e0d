"""engine/forward_probe.py: the measurement ``--dtype auto`` makes at first start runs every
candidate's decode and verify forwards and reports each (its values are timings, so only
their presence is checked, never their size), and a candidate that cannot load is a reason,
not an error."""

from __future__ import annotations

import pytest

import specmesh.engine.loader as loader
from specmesh.engine.forward_probe import ForwardTiming, measure_dtypes


def test_every_candidate_is_measured_in_turn(tiny_model_dir):
    import torch

    before = torch.get_num_threads()
    got = measure_dtypes(tiny_model_dir, ["float32", "bfloat16"], 1, context_len=40,
                         num_verify_tokens=3, rounds=2)
    assert list(got) == ["float32", "bfloat16"]
    for timing in got.values():
        assert isinstance(timing, ForwardTiming)
        assert (timing.context_len, timing.num_verify_tokens) == (40, 3)
        assert timing.decode_ms > 0 and timing.verify_ms > 0
        assert timing.as_dict()["decode_ms"] == timing.decode_ms
    assert torch.get_num_threads() == before  # the caller's threads are back


def test_a_candidate_that_cannot_load_is_a_reason(tiny_model_dir, monkeypatch):
    real = loader.load_model

    def load(model, dtype="float32", device="cpu"):
        if dtype == "bfloat16":
            raise ValueError("no bf16 here")
        return real(model, dtype=dtype, device=device)

    monkeypatch.setattr(loader, "load_model", load)
    got = measure_dtypes(tiny_model_dir, ["float32", "bfloat16"], 1, context_len=16, rounds=1)
    assert isinstance(got["float32"], ForwardTiming)
    assert got["bfloat16"] == "cannot run in bfloat16: no bf16 here"
    with pytest.raises(FileNotFoundError):
        measure_dtypes("/nonexistent/model", ["float32"], 1)
    with pytest.raises(ValueError):
        measure_dtypes(tiny_model_dir, ["float32"], 1, rounds=0)
