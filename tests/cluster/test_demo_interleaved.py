"""``specmesh demo`` runs speculation on and off prompt by prompt, alternating which goes first,
so a load change during the demo slows both runs alike; each run sums only its own requests."""

from __future__ import annotations

from types import SimpleNamespace

from specmesh.cluster.demo import interleaved


class FakeHandle:
    """A cluster handle that records the kappa of every switch."""

    def __init__(self) -> None:
        self.kappas: list[int] = []

    def set_num_speculative_tokens(self, k: int) -> None:
        self.kappas.append(k)


class FakeClient:
    """An OpenAI client whose chat completions answer the prompt's name as text, with 3
    tokens (5 with drafts accepted when kappa > 0) and the handle's kappa in spec_stats."""

    def __init__(self, handle: FakeHandle) -> None:
        self.handle, self.sent = handle, []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    def _create(self, model, messages, max_tokens, temperature, extra_body):  # noqa: ANN001
        k = self.handle.kappas[-1]
        self.sent.append((messages[0]["content"], k))
        stats = {"num_draft_tokens": 4 * k, "num_accepted_tokens": 2 * k, "num_verify_steps": 3}
        choice = SimpleNamespace(message=SimpleNamespace(content=messages[0]["content"]),
                                 model_extra={"token_ids": [1, 2, 3]})
        return SimpleNamespace(usage=SimpleNamespace(completion_tokens=3), choices=[choice],
                               model_extra={"spec_stats": stats})


def test_the_runs_alternate_prompt_by_prompt_and_sum_their_own_requests():
    handle = FakeHandle()
    client = FakeClient(handle)
    prompts = [{"name": f"p{i}", "category": "c",
                "messages": [{"role": "user", "content": f"p{i}"}]} for i in range(3)]
    spec, plain = interleaved(client, "m", prompts, 8, handle, kappa=4)
    assert client.sent == [("p0", 4), ("p0", 0), ("p1", 0), ("p1", 4), ("p2", 4), ("p2", 0)]
    assert handle.kappas[-1] == 4  # left as the cluster was configured
    assert spec.texts == plain.texts == ["p0", "p1", "p2"]
    assert spec.num_tokens == plain.num_tokens == 9
    assert spec.spec.num_draft_tokens == 3 * 16 and spec.spec.num_accepted_tokens == 3 * 8
    assert plain.spec.num_draft_tokens == 0
    assert spec.token_ids == plain.token_ids == [[1, 2, 3]] * 3
    assert spec.seconds > 0 and plain.seconds > 0
