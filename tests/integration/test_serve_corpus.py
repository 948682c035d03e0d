"""Corpora through the Ray cluster (prefill, verifier, drafter, gateway in their own processes,
ZMQ between them, HTTP in front) on the tiny random model (issue 32, a corpus pushed into a
running server):

- a ``--corpus`` file given at start is on every drafter once the cluster is up;
- the must-show: a prompt whose greedy answer is a passage the prompt does not contain (its
  bigrams never repeat, so the n-gram drafter has nothing of its own to draft from) has no
  draft accepted before the passage is posted as a corpus and drafts accepted after, with the
  token ids of plain decode both times; dropping the corpus takes that back;
- a drafter that restarts (a new incarnation) gets the corpora again from its verifier;
- clearing the drafters' history answers for every drafter.

With a tiny random model the passage is the model's own greedy output of the prompt, taken
first with speculation off: then the passage is exactly what it will emit.
"""

from __future__ import annotations

import time

import httpx
import pytest
import ray

from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.cluster.launcher import start_cluster
from specmesh.engine.loader import load_model
from specmesh.protocol.messages import SamplingParams

pytestmark = pytest.mark.ray

MAX_TOKENS = 24
CANDIDATES = ["The capital of France is", "Write a haiku about the sea.",
              "Explain photosynthesis briefly.", "In 1492 Columbus sailed",
              "The mitochondria is the", "Once upon a time in a land"]
BOOT_TEXT = ("Specmesh drafts tokens on a drafter and verifies them on a verifier. "
             "A corpus loaded at start is searched for the context's last tokens.")


@pytest.fixture(scope="module")
def boot_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "boot.txt"
    path.write_text(BOOT_TEXT)
    return path


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_model_dir, boot_file):
    cfg = ClusterConfig.create(model=tiny_model_dir, dtype="float32", num_speculative_tokens=3,
                               kv_cache_mb=32, port=0, max_model_len=1024,
                               namespace="specmesh-corpus-test", draft_method="ngram",
                               corpus_files=(f"boot={boot_file}",))
    handle = start_cluster(cfg)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def passage(tiny_model_dir):
    """(prompt, its prompt ids, its plain greedy output): the first candidate prompt whose
    prompt + output repeats no bigram and shares none with the boot corpus."""
    loaded = load_model(tiny_model_dir, dtype="float32")
    tok = loaded.tokenizer
    plain = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=0,
                             eos_token_ids=loaded.config.eos_token_ids)
    boot = tok(BOOT_TEXT, add_special_tokens=False)["input_ids"]
    boot_bigrams = set(zip(boot, boot[1:]))
    for prompt in CANDIDATES:
        ids = list(tok(prompt)["input_ids"])
        (out,) = plain.generate([ids], SamplingParams(max_tokens=MAX_TOKENS))
        seq = ids + out.token_ids
        bigrams = list(zip(seq, seq[1:]))
        if len(out.token_ids) == MAX_TOKENS and len(set(bigrams)) == len(bigrams) \
                and not boot_bigrams & set(bigrams):
            return prompt, ids, list(out.token_ids)
    raise AssertionError("no candidate prompt repeats no bigram")


def _complete(url: str, prompt: str, **extra) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "return_token_ids": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _wait_for(what, check, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _drafter_series(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {s.name: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name.startswith("specmesh:drafter_")
            and s.labels.get("instance") == "drafter-0"}


def test_a_corpus_file_given_at_start_reaches_the_drafter(cluster):
    boot = _wait_for("the boot corpus on drafter-0", lambda: next(
        (c for c in httpx.get(f"{cluster.url}/v1/specmesh/corpus", timeout=30).json()["data"]
         if c["drafters"].get("drafter-0", {}).get("status") == "applied"), None))
    assert boot["name"] == "boot" and boot["num_tokens"] > 0
    assert cluster.stats()["drafter-0"]["num_corpus_tokens"] == boot["num_tokens"]


def test_a_posted_corpus_turns_no_accepted_drafts_into_accepted_ones(cluster, passage):
    prompt, prompt_ids, want = passage
    plain = _complete(cluster.url, prompt, num_speculative_tokens=0)
    assert plain["choices"][0]["token_ids"] == want  # speculation off: plain decode
    before = _complete(cluster.url, prompt)
    assert before["choices"][0]["token_ids"] == want
    assert before["spec_stats"]["num_accepted_tokens"] == 0

    r = httpx.post(f"{cluster.url}/v1/specmesh/corpus", timeout=120,
                   json={"name": "answer", "token_ids": want})
    assert r.status_code == 200, r.text
    assert r.json()["drafters"]["drafter-0"] == {"status": "applied", "num_tokens": len(want),
                                                 "error": ""}
    after = _complete(cluster.url, prompt)
    assert after["choices"][0]["token_ids"] == want
    assert after["spec_stats"]["num_accepted_tokens"] > 0, after["spec_stats"]
    series = _drafter_series(cluster.url)
    assert series["specmesh:drafter_corpora"] == 2
    assert series["specmesh:drafter_corpus_draft_tokens_total"] > 0
    assert series["specmesh:drafter_proposed_draft_tokens_total"] >= \
        series["specmesh:drafter_corpus_draft_tokens_total"]

    r = httpx.delete(f"{cluster.url}/v1/specmesh/corpus/answer", timeout=120)
    assert r.status_code == 200, r.text
    dropped = _complete(cluster.url, prompt)
    assert dropped["choices"][0]["token_ids"] == want
    assert dropped["spec_stats"]["num_accepted_tokens"] == 0


def test_clear_history_answers_for_every_drafter(cluster):
    r = httpx.post(f"{cluster.url}/v1/specmesh/drafters/clear_history", timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["drafters"]["drafter-0"]["status"] == "applied"


def test_a_restarted_drafter_gets_the_corpora_again(cluster, passage):
    prompt, _, want = passage
    r = httpx.post(f"{cluster.url}/v1/specmesh/corpus", timeout=120,
                   json={"name": "answer", "token_ids": want})
    assert r.status_code == 200, r.text
    old = ray.get(cluster.actors["drafter-0"].info.remote())
    ray.kill(cluster.actors["drafter-0"], no_restart=False)

    def restarted():
        try:
            new = ray.get(cluster.actors["drafter-0"].info.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - restarting
            return None
        return new if new["incarnation"] != old["incarnation"] else None

    new = _wait_for("drafter-0's restart", restarted)
    _wait_for("the verifier reconnected to the new drafter", lambda: cluster.stats()[
        "verifier-0"]["peer_incarnations"].get("drafter-0") == new["incarnation"])
    st = _wait_for("both corpora on the new drafter", lambda: (
        s := cluster.stats()["drafter-0"])["num_corpora"] == 2 and s)
    assert st["num_corpus_tokens"] > len(want)
    after = _complete(cluster.url, prompt)
    assert after["choices"][0]["token_ids"] == want
    assert after["spec_stats"]["num_accepted_tokens"] > 0
