"""Penalties and token constraints through the real gateway app over the in-process workers
(tiny model with SmolLM2's tokenizer, float32, no Ray; issue 33 item 3):

- out-of-range values and ids outside the vocabulary are HTTP 400 naming the field;
- what reaches the wire: logit_bias as aligned lists, bad words tokenized with and without a
  leading space (vLLM), allowed ids;
- for each parameter, completions and chat, greedy and seeded: the output differs from the
  same request without it, and speculation at k = 4 and k = 8 (an oracle drafter of the
  speculation-off output: drafts accepted > 0) gives the same tokens as speculation off,
  streaming and not.
"""

from __future__ import annotations

import json

import httpx
import pytest

from helpers.served_gateway import ServedGateway
from helpers.proposers import OracleProposer
from specmesh.gateway.penalties import bad_words_token_ids

PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat sat on the"
MESSAGES = [{"role": "user", "content": "Say something about the sea."}]
MAX_TOKENS = 16


class Served(ServedGateway):
    """An in-process cluster driven by a thread behind a real gateway, drafting with an
    oracle whose sequences the test adds (the speculation-off outputs)."""

    def __init__(self, loaded) -> None:
        self.oracle = OracleProposer([], [])
        super().__init__(loaded, proposer=self.oracle, default_max_tokens=MAX_TOKENS)

    def post(self, chat: bool, **fields) -> httpx.Response:
        body = {"max_tokens": MAX_TOKENS, **fields}
        body.update({"messages": MESSAGES} if chat else {"prompt": PROMPT})
        return self.client.post("/v1/chat/completions" if chat else "/v1/completions",
                                json=body)

    def output(self, chat: bool, stream: bool = False, **fields) -> tuple[tuple[int, ...], dict]:
        """Output token ids and spec stats of one request."""
        fields = {**fields, "stream": stream, "return_token_ids": True}
        if not stream:
            r = self.post(chat, **fields)
            assert r.status_code == 200, r.text
            out = r.json()
            return tuple(out["choices"][0]["token_ids"]), out["spec_stats"]
        body = {"max_tokens": MAX_TOKENS, **fields}
        body.update({"messages": MESSAGES} if chat else {"prompt": PROMPT})
        url = "/v1/chat/completions" if chat else "/v1/completions"
        with self.client.stream("POST", url, json=body) as r:
            assert r.status_code == 200, r.read()
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        ids = tuple(t for e in events for ch in e["choices"] for t in ch["token_ids"])
        return ids, events[-1]["spec_stats"]

    def prompt_ids(self, chat: bool) -> list[int]:
        r = self.post(chat, max_tokens=1, return_token_ids=True)
        out = r.json()
        return out["prompt_token_ids"] if chat else out["choices"][0]["prompt_token_ids"]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from specmesh.engine.loader import load_model

    return load_model(tiny_model_dir, dtype="float32")


@pytest.fixture(scope="module")
def served(loaded):
    s = Served(loaded)
    yield s
    s.close()


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("field, value", [
    ("frequency_penalty", 2.5), ("frequency_penalty", "1"), ("presence_penalty", -2.01),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("logit_bias", {"5": 100.5}),
    ("logit_bias", {"5": -101}), ("logit_bias", {"abc": 1}), ("logit_bias", {"99999999": 1}),
    ("logit_bias", {"-3": 1}), ("logit_bias", [1, 2]), ("min_tokens", -1),
    ("min_tokens", 3), ("bad_words", [1]), ("bad_words", [""]), ("allowed_token_ids", []),
    ("allowed_token_ids", [-1]), ("allowed_token_ids", [10**9]), ("allowed_token_ids", 5),
])
def test_bad_values_are_400_naming_the_field(served, chat, field, value) -> None:
    r = served.post(chat, max_tokens=2, **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == field, r.text


def test_what_reaches_the_wire(served, loaded) -> None:
    tok = loaded.tokenizer
    r = served.post(False, max_tokens=2, logit_bias={"7": -2.5, "19556": 100},
                    bad_words=["hello", " world"], allowed_token_ids=[9, 3, 3, 19556],
                    min_tokens=1, frequency_penalty=0.25, presence_penalty=-1,
                    repetition_penalty=1.5)
    assert r.status_code == 200, r.text
    sp = served.sent[-1].sampling
    assert (sp.logit_bias_token_ids, sp.logit_bias_values) == ([7, 19556], [-2.5, 100.0])
    assert sp.allowed_token_ids == [3, 9, 19556] and sp.min_tokens == 1
    assert (sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty) == (0.25, -1.0, 1.5)
    words = [tok("hello", add_special_tokens=False)["input_ids"],
             tok(" hello", add_special_tokens=False)["input_ids"],
             tok("world", add_special_tokens=False)["input_ids"],
             tok(" world", add_special_tokens=False)["input_ids"]]
    assert sp.bad_words_token_ids == [w for w in words if w]
    assert words[0] != words[1]  # both spellings banned
    r = served.post(False, max_tokens=2)
    sp = served.sent[-1].sampling
    assert not sp.has_logits_processors


def _cases(plain: tuple[int, ...], tokenizer) -> dict[str, dict]:
    """Each parameter with a value that changes the plain output ``plain``."""
    # two output tokens whose text the gateway tokenizes back to them
    pairs = [list(plain[i:i + 2]) for i in range(len(plain) - 1)]
    word = next(w for w in (tokenizer.decode(p) for p in pairs)
                if any(t in pairs for t in bad_words_token_ids(tokenizer, [w], len(tokenizer))))
    # negative penalties (and a repetition penalty below 1) favour tokens already seen: the
    # tiny random model rarely repeats itself, so favouring repeats is what changes its output
    return {
        "frequency_penalty": {"frequency_penalty": -2.0},
        "presence_penalty": {"presence_penalty": -2.0},
        "repetition_penalty": {"repetition_penalty": 0.3},
        "logit_bias": {"logit_bias": {str(plain[0]): -100, str(plain[3]): -100}},
        "bad_words": {"bad_words": [word]},
        "allowed_token_ids": {"allowed_token_ids": sorted(set(range(0, 4000, 7))
                                                          - {plain[0], plain[1]})},
        "min_tokens": {"min_tokens": 12, "stop_token_ids": [plain[2]]},
    }


MODES = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.2, "seed": 11}}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ["frequency_penalty", "presence_penalty", "repetition_penalty",
                                  "logit_bias", "bad_words", "allowed_token_ids", "min_tokens"])
def test_speculation_on_equals_off(served, loaded, name, mode, chat) -> None:
    base = {**MODES[mode], "ignore_eos": True}
    plain, _ = served.output(chat, num_speculative_tokens=0, **base)
    fields = {**base, **_cases(plain, loaded.tokenizer)[name]}
    if name == "min_tokens":
        fields["ignore_eos"] = False
    off, stats = served.output(chat, num_speculative_tokens=0, **fields)
    assert stats["num_draft_tokens"] == 0
    if name == "min_tokens":  # the stop token came at position 2; now not before 12
        stopped, _ = served.output(chat, num_speculative_tokens=0,
                                   **{**fields, "min_tokens": 0})
        assert len(stopped) <= 3 and plain[2] not in off[:12] and len(off) >= 12
    assert off != plain, "the parameter changes nothing"
    served.oracle.seqs.append(served.prompt_ids(chat) + list(off))
    for k in (4, 8):
        for stream in (False, True):
            on, stats = served.output(chat, stream, num_speculative_tokens=k, **fields)
            assert on == off, (k, stream)
            assert stats["num_accepted_tokens"] > 0, (k, stream, stats)
