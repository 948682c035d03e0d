"""Logprobs, echo, a list of prompts, continuous usage and the tokenizer endpoints through the
real gateway app over the in-process workers (tiny float32 model with SmolLM2's tokenizer, no
Ray; issue 33 items 1, 2 (lists of prompts) and 5):

- completions ``logprobs: k`` and chat ``logprobs`` / ``top_logprobs`` with speculation on
  (per-request k = 4 and 8, drafts accepted) equal speculation off within 1e-5, and equal a
  reference forward (Hugging Face, the same weights) over prompt + output, streamed or not;
- ``echo`` with logprobs (what lm-evaluation-harness's loglikelihood sends: ``echo: true,
  logprobs: 1, max_tokens: 1`` or ``0``, a list of token-id prompts): the prompt's logprobs
  equal the reference forward's, the first null;
- a list of prompts: one choice per prompt, indexed as vLLM, each equal to the prompt alone,
  streamed or not, usage summed;
- /tokenize, /detokenize, /tokenizer_info, /version in vLLM's shapes;
- ``stream_options.continuous_usage_stats``: every chunk carries the usage so far.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers.served_gateway import ServedGateway
from helpers.models import hf_greedy
from helpers.proposers import OracleProposer

PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat sat on the"
MESSAGES = [{"role": "user", "content": "Say something about the sea."}]
MAX_TOKENS = 24
MAX_MODEL_LEN = 1024


class Served(ServedGateway):
    """One in-process cluster (kappa 8) driven by a thread, behind a real gateway on
    127.0.0.1; a request picks its own kappa (0: speculation off). The drafter is an oracle
    that drafts the known greedy continuation of the tests' prompts (``oracle.seqs``), so
    drafts are accepted; elsewhere it drafts nothing."""

    def __init__(self, loaded, oracle: OracleProposer) -> None:
        self.tok = loaded.tokenizer
        super().__init__(loaded, num_speculative_tokens=8, proposer=oracle,
                         max_model_len=MAX_MODEL_LEN, default_max_tokens=MAX_TOKENS)

    def post(self, url: str, body: dict) -> dict:
        r = self.client.post(url, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def events(self, url: str, body: dict) -> list[dict]:
        with self.client.stream("POST", url, json={**body, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            return [json.loads(line[6:]) for line in r.iter_lines()
                    if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from specmesh.engine.loader import load_model

    return load_model(tiny_model_dir, dtype="float32")


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def served(loaded, hf):
    tok = loaded.tokenizer
    chat = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    chat = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
    prompts = [tok(PROMPT)["input_ids"], chat]
    oracle = OracleProposer(prompts, [hf_greedy(hf, p, 2 * MAX_TOKENS) for p in prompts])
    s = Served(loaded, oracle)
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(hf):
    """float32 log_softmax of the Hugging Face model's logits over a token list (row i
    predicts token i + 1): the reference forward."""

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def _completion(served, k: int, stream: bool = False, **fields) -> tuple[dict, dict]:
    """(choice with text, token_ids and logprobs joined over chunks, spec_stats)."""
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "num_speculative_tokens": k, "return_token_ids": True, **fields}
    if not stream:
        out = served.post("/v1/completions", body)
        return out["choices"][0], out["spec_stats"]
    events = served.events("/v1/completions", body)
    choices = [ch for e in events for ch in e["choices"]]
    lp = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for ch in choices:
        for key in lp:
            lp[key] += (ch["logprobs"] or {}).get(key, [])
    joined = {"text": "".join(ch["text"] for ch in choices),
              "token_ids": [t for ch in choices for t in ch["token_ids"]],
              "logprobs": lp if fields.get("logprobs") is not None else None}
    return joined, events[-1]["spec_stats"]


def _close(a: list, b: list, tol: float = 1e-5) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert abs(x - y) <= tol, (x, y)


@pytest.mark.parametrize("k", [4, 8])
def test_completion_logprobs_spec_on_equal_spec_off_and_the_reference(served, reference, k):
    off, off_stats = _completion(served, 0, logprobs=5)
    on, on_stats = _completion(served, k, logprobs=5)
    assert off_stats["num_draft_tokens"] == 0
    assert on_stats["num_accepted_tokens"] > 0  # speculation stayed on, drafts accepted
    assert on["token_ids"] == off["token_ids"] and on["text"] == off["text"]
    a, b = off["logprobs"], on["logprobs"]
    _close(a["token_logprobs"], b["token_logprobs"])
    assert a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"]
    for ta, tb in zip(a["top_logprobs"], b["top_logprobs"]):
        assert ta.keys() == tb.keys()
        _close(list(ta.values()), list(tb.values()))
    # the reference forward over prompt + output
    prompt_ids = served.tok(PROMPT)["input_ids"]
    ids = on["token_ids"]
    lp = reference(prompt_ids + ids)
    n = len(prompt_ids)
    want = [lp[n - 1 + i, t].item() for i, t in enumerate(ids)]
    _close(b["token_logprobs"], want, 1e-4)
    for i, top in enumerate(b["top_logprobs"]):
        assert 5 <= len(top) <= 6  # the top 5 and the chosen token (OpenAI: up to k + 1)
        best = lp[n - 1 + i].topk(5).values.tolist()
        _close(sorted(top.values(), reverse=True)[:5], best, 1e-4)
    # shapes: one token string per token, offsets over the token strings
    assert b["tokens"] == [served.tok.decode([t]) for t in ids]
    assert b["text_offset"] == [sum(len(t) for t in b["tokens"][:i]) for i in range(len(ids))]


def test_completion_logprobs_streamed_equal_not_streamed(served):
    whole, _ = _completion(served, 4, logprobs=3)
    streamed, stats = _completion(served, 4, stream=True, logprobs=3)
    assert stats["num_accepted_tokens"] > 0
    assert streamed["token_ids"] == whole["token_ids"] and streamed["text"] == whole["text"]
    a, b = whole["logprobs"], streamed["logprobs"]
    assert a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"]
    _close(a["token_logprobs"], b["token_logprobs"], 0.0)
    assert a["top_logprobs"] == b["top_logprobs"]


def test_completion_without_logprobs_has_null(served):
    choice, _ = _completion(served, 4)
    assert choice["logprobs"] is None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_logprobs_spec_on_equal_spec_off(served, stream):
    def run(k):
        body = {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "num_speculative_tokens": k, "logprobs": True, "top_logprobs": 4,
                "return_token_ids": True}
        if not stream:
            out = served.post("/v1/chat/completions", body)
            ch = out["choices"][0]
            return ch["token_ids"], ch["logprobs"]["content"], out["spec_stats"]
        events = served.events("/v1/chat/completions", body)
        chs = [ch for e in events for ch in e["choices"]]
        content = [c for ch in chs if ch["logprobs"] for c in ch["logprobs"]["content"]]
        return [t for ch in chs for t in ch["token_ids"]], content, events[-1]["spec_stats"]

    ids_off, off, _ = run(0)
    ids_on, on, stats = run(8)
    assert ids_on == ids_off and len(on) == len(ids_on) == MAX_TOKENS
    for a, b, t in zip(off, on, ids_on):
        assert a["token"] == b["token"] == served.tok.decode([t])
        assert abs(a["logprob"] - b["logprob"]) <= 1e-5
        assert b["bytes"] == list(b["token"].encode("utf-8", errors="replace"))
        assert len(b["top_logprobs"]) == 4
        assert [x["token"] for x in a["top_logprobs"]] == [x["token"] for x in b["top_logprobs"]]
        # greedy: the chosen token is the most likely one, listed first
        assert abs(b["top_logprobs"][0]["logprob"] - b["logprob"]) <= 1e-6
        lps = [x["logprob"] for x in b["top_logprobs"]]
        assert lps == sorted(lps, reverse=True)


def _loglikelihood_choices(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness's parse_logprobs of a local-completions answer (its code, read
    as a client reads the response)."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(t == max(top.values()) for t, top in zip(lps, tops))
        res.append((sum(lps), greedy))
    return res


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_echo_loglikelihood_as_lm_eval_sends_it(served, reference, max_tokens):
    """``echo: true, logprobs: 1, max_tokens: 1`` (or 0) over a list of token-id prompts:
    each choice's logprobs start with the prompt's (first null), equal to the reference
    forward; the summed continuation loglikelihood is the reference's."""
    ctx = served.tok("Question: what sat on the mat? Answer:")["input_ids"]
    conts = [served.tok(" the cat")["input_ids"], served.tok(" a dog")["input_ids"]]
    prompts = [ctx + c for c in conts]
    out = served.post("/v1/completions", {
        "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": max_tokens,
        "temperature": 0.0})
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for choice, ids in zip(out["choices"], prompts):
        lp = choice["logprobs"]
        n_out = max_tokens
        assert len(lp["tokens"]) == len(ids) + n_out
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert choice["text"].startswith(served.tok.decode(ids))
        ref = reference(ids)
        _close(lp["token_logprobs"][1:len(ids)], [ref[i - 1, t].item()
                                                  for i, t in enumerate(ids) if i], 1e-4)
        for top in lp["top_logprobs"][1:]:
            assert 1 <= len(top) <= 2
    if max_tokens == 1:
        got = _loglikelihood_choices(out, [len(ctx)] * 2)
        for (ll, _), ids in zip(got, prompts):
            ref = reference(ids)
            want = sum(ref[i - 1, ids[i]].item() for i in range(len(ctx), len(ids)))
            assert abs(ll - want) <= 1e-4
    else:
        assert all(c["text"] == served.tok.decode(ids) for c, ids in zip(out["choices"],
                                                                           prompts))


def test_echo_streamed_puts_the_prompt_first(served):
    events = served.events("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 2,
                                               "max_tokens": 6, "temperature": 0.0})
    first = events[0]["choices"][0]
    assert first["text"] == PROMPT
    assert first["logprobs"]["token_logprobs"][0] is None
    n = len(served.tok(PROMPT)["input_ids"])
    assert len(first["logprobs"]["tokens"]) == n
    whole = served.post("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 2,
                                            "max_tokens": 6, "temperature": 0.0})
    text = "".join(ch["text"] for e in events for ch in e["choices"])
    assert text == whole["choices"][0]["text"]
    offsets = [o for e in events for ch in e["choices"] if ch["logprobs"]
               for o in ch["logprobs"]["text_offset"]]
    assert offsets == whole["choices"][0]["logprobs"]["text_offset"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_list_of_prompts_gives_one_choice_per_prompt(served, stream):
    prompts = [PROMPT, "Once upon a time", "1, 2, 3, 4,"]
    body = {"max_tokens": 10, "temperature": 0.0, "return_token_ids": True}
    alone = [served.post("/v1/completions", {**body, "prompt": p}) for p in prompts]
    if not stream:
        out = served.post("/v1/completions", {**body, "prompt": prompts})
        texts = {c["index"]: c["text"] for c in out["choices"]}
        usage = out["usage"]
    else:
        events = served.events("/v1/completions", {
            **body, "prompt": prompts, "stream_options": {"include_usage": True}})
        texts: dict[int, str] = {}
        for e in events:
            for ch in e["choices"]:
                texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
        assert len({e["id"] for e in events}) == 1
        usage = events[-1]["usage"]
    assert texts == {i: a["choices"][0]["text"] for i, a in enumerate(alone)}
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage[key] == sum(a["usage"][key] for a in alone)


def test_continuous_usage_stats_in_every_chunk(served):
    events = served.events("/v1/completions", {
        "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    n_prompt = len(served.tok(PROMPT)["input_ids"])
    usages = [e["usage"] for e in events]
    assert all(u is not None and u["prompt_tokens"] == n_prompt for u in usages)
    done = [u["completion_tokens"] for u in usages]
    assert done == sorted(done) and done[-1] == 12
    assert all(u["total_tokens"] == n_prompt + u["completion_tokens"] for u in usages)
    # without continuous_usage_stats: null in every chunk but the last (OpenAI)
    events = served.events("/v1/completions", {
        "prompt": PROMPT, "max_tokens": 4, "stream_options": {"include_usage": True}})
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]


def test_tokenizer_endpoints(served):
    tok = served.tok
    out = served.post("/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    ids = tok(PROMPT)["input_ids"]
    assert out == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                   "token_strs": tok.convert_ids_to_tokens(ids)}
    chat = served.post("/tokenize", {"messages": MESSAGES})
    want = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert chat["tokens"] == want and chat["token_strs"] is None
    # the count a chat request reports as its prompt tokens
    usage = served.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert usage["usage"]["prompt_tokens"] == chat["count"]
    assert served.post("/detokenize", {"tokens": ids}) == {"prompt": tok.decode(ids)}
    info = served.client.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tok).__name__
    assert isinstance(info.get("chat_template"), str)
    json.dumps(info)
    assert served.client.get("/version").json()["version"]
    # bad input: 400 naming the field; another model: 404
    for url, body, param in [
            ("/tokenize", {}, "prompt"),
            ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
            ("/tokenize", {"messages": []}, "messages"),
            ("/detokenize", {"tokens": [len(tok) + 3]}, "tokens"),
            ("/detokenize", {"tokens": ["a"]}, "tokens.0")]:
        r = served.client.post(url, json=body)
        assert r.status_code == 400, (url, body, r.text)
        assert r.json()["error"]["param"] == param
    assert served.client.post("/tokenize", json={"prompt": "a", "model": "x"}).status_code == 404


def test_logprob_values_are_finite_json(served):
    choice, _ = _completion(served, 4, logprobs=20)
    for lp, top in zip(choice["logprobs"]["token_logprobs"],
                       choice["logprobs"]["top_logprobs"]):
        assert math.isfinite(lp) and lp <= 0
        assert all(math.isfinite(v) and v <= 0 for v in top.values())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_stop_string_cuts_the_logprobs_with_the_tokens(served, stream):
    full, _ = _completion(served, 4, logprobs=2)
    text = full["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut, stats = _completion(served, 4, stream=stream, logprobs=2, stop=[stop])
    assert stats["num_accepted_tokens"] > 0
    n = len(cut["token_ids"])
    assert 0 < n < len(full["token_ids"]) and cut["token_ids"] == full["token_ids"][:n]
    assert len(cut["logprobs"]["token_logprobs"]) == n
    _close(cut["logprobs"]["token_logprobs"], full["logprobs"]["token_logprobs"][:n], 0.0)


# -- n and best_of (gateway/n_choices.py, decode/siblings.py) -----------------------------


def _counts(served) -> tuple[int, int]:
    c = served.cluster
    return c.prefill.stats.num_requests, c.verifier.stats.num_sibling_forks


@pytest.mark.parametrize("k", [0, 4])
def test_n_choices_greedy_prefill_once_and_equal_n1(served, k):
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "num_speculative_tokens": k, "return_token_ids": True}
    one = served.post("/v1/completions", body)
    prefills, forks = _counts(served)
    out = served.post("/v1/completions", {**body, "n": 3})
    assert [ch["index"] for ch in out["choices"]] == [0, 1, 2]
    assert all(ch["token_ids"] == one["choices"][0]["token_ids"] for ch in out["choices"])
    assert _counts(served) == (prefills + 1, forks + 2)  # one prompt prefilled, two forked
    assert out["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]  # counted once
    assert out["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    if k:
        assert out["spec_stats"]["num_accepted_tokens"] > 0


def test_n_seeded_choices_are_the_derived_seeds_alone(served):
    from specmesh.gateway.n_choices import choice_seed

    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 5,
            "num_speculative_tokens": 4, "return_token_ids": True}
    out = served.post("/v1/completions", {**body, "n": 3})
    alone = [served.post("/v1/completions", {**body, "seed": choice_seed(5, j)})
             for j in range(3)]
    got = [ch["token_ids"] for ch in out["choices"]]
    assert got == [a["choices"][0]["token_ids"] for a in alone]
    assert len({tuple(g) for g in got}) > 1  # the seeds made the choices differ


def test_chat_n_streamed(served):
    body = {"messages": MESSAGES, "max_tokens": 10, "temperature": 0.0, "n": 2}
    whole = served.post("/v1/chat/completions", body)
    assert whole["object"] == "chat.completion" and len(whole["choices"]) == 2
    texts = {0: "", 1: ""}
    for e in served.events("/v1/chat/completions", body):
        for ch in e["choices"]:
            texts[ch["index"]] += ch["delta"].get("content") or ""
    assert texts[0] == texts[1] == whole["choices"][0]["message"]["content"]


def test_best_of_returns_the_best_per_token(served):
    from specmesh.gateway.n_choices import choice_seed

    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.5, "seed": 11,
            "num_speculative_tokens": 4, "return_token_ids": True}
    out = served.post("/v1/completions", {**body, "best_of": 3, "n": 1, "logprobs": 0})
    cands = [served.post("/v1/completions", {**body, "seed": choice_seed(11, j),
                                             "logprobs": 0})["choices"][0] for j in range(3)]
    means = [sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["token_logprobs"])
             for c in cands]
    best = cands[max(range(3), key=lambda j: (means[j], -j))]
    assert len(out["choices"]) == 1 and out["choices"][0]["index"] == 0
    assert out["choices"][0]["token_ids"] == best["token_ids"]
    assert out["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in cands)


@pytest.mark.parametrize("url,body,param", [
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
    ("/v1/chat/completions", {"messages": MESSAGES, "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": ["x"] * 600, "n": 2}, "n"),
])
def test_bad_n_or_best_of_is_a_400(served, url, body, param):
    r = served.client.post(url, json={"max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
def test_vllm_prompt_logprobs(served, reference):
    """vLLM's ``prompt_logprobs: k`` on completions: per prompt token None (the first) or
    ``{id: {logprob, rank, decoded_token}}``, the token first then the top k, equal to the
    reference forward; with ``echo`` and a smaller ``logprobs`` the echoed top lists keep
    their own k."""
    ids = served.tok(PROMPT)["input_ids"]
    out = served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2,
                                          "temperature": 0.0, "prompt_logprobs": 3,
                                          "echo": True, "logprobs": 1})
    choice = out["choices"][0]
    pl = choice["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    ref = reference(ids)
    for i, (tok, entry) in enumerate(zip(ids[1:], pl[1:]), start=1):
        first = next(iter(entry))
        assert first == str(tok)
        row = ref[i - 1]
        assert abs(entry[first]["logprob"] - row[tok].item()) <= 1e-4
        assert entry[first]["rank"] == int((row > row[tok]).sum()) + 1
        assert entry[first]["decoded_token"] == served.tok.decode([tok])
        top = row.topk(3)
        for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert abs(entry[str(t)]["logprob"] - v) <= 1e-4 and entry[str(t)]["rank"] == rank
        assert len(entry) in (3, 4)
    # the echoed logprobs keep logprobs: 1 (top 1 plus the token itself)
    assert all(len(t) <= 2 for t in choice["logprobs"]["top_logprobs"][1:])
    r = served.client.post("/v1/completions", json={"prompt": PROMPT, "prompt_logprobs": 1,
                                                    "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = served.client.post("/v1/chat/completions", json={"messages": MESSAGES,
                                                         "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_echo_without_generation_streamed(served):
    events = served.events("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 1,
                                               "max_tokens": 0})
    chunks = [ch for e in events for ch in e["choices"]]
    assert "".join(ch["text"] for ch in chunks) == PROMPT
    n = len(served.tok(PROMPT)["input_ids"])
    assert sum(len(ch["logprobs"]["tokens"]) for ch in chunks if ch["logprobs"]) == n
    assert chunks[-1]["finish_reason"] == "length"


def test_n_choices_carry_logprobs_and_echo_like_one(served):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "logprobs": 2, "echo": True,
            "num_speculative_tokens": 4}
    one = served.post("/v1/completions", body)["choices"][0]
    out = served.post("/v1/completions", {**body, "n": 3})
    for ch in out["choices"]:  # the forked choices' first token and prompt logprobs too
        assert ch["text"] == one["text"]
        assert ch["logprobs"]["tokens"] == one["logprobs"]["tokens"]
        assert ch["logprobs"]["token_logprobs"][1:] == pytest.approx(
            one["logprobs"]["token_logprobs"][1:], abs=1e-5)
