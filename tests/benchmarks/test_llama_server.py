"""The llama.cpp peer of ``specmesh bench`` against a fake ``llama-server``
(tests/helpers/fake_llama_server.py, an OpenAI-compatible streaming server in Python, so no
llama.cpp is needed): finding the binary, its command line, the process lifecycle (started on
a free port, health-waited, stopped on success, on error and when it ignores SIGTERM), and a
pass of prompts through it with the served system's streaming client (texts, tokens, spec
stats from its ``timings``, TTFT and inter-token latency on an injected clock)."""

from __future__ import annotations

import itertools
import signal
import stat
import sys
import threading
from pathlib import Path

import pytest

from specmesh.benchmarks.harness.bench import sigterm_unwinds
from specmesh.benchmarks.harness.llama_server import (
    LlamaServer,
    LlamaServerConfig,
    LlamaServers,
    context_size,
    find_llama_server,
    llama_configs,
    llama_spec_stats,
    run_llama,
    spec_args,
)
from specmesh.benchmarks.harness.report import systems_for
from specmesh.cluster.runs import RequestLatency, openai_client, run_openai_concurrent

FAKE = Path(__file__).resolve().parents[1] / "helpers" / "fake_llama_server.py"
PROMPTS = [{"messages": [{"role": "user", "content": "one two three"}]},
           {"messages": [{"role": "user", "content": "four five"}]},
           {"messages": [{"role": "user", "content": "six"}]}]


@pytest.fixture
def fake_binary(tmp_path) -> Path:
    """An executable ``llama-server`` that runs the fake server with this interpreter."""
    path = tmp_path / "bin" / "llama-server"
    path.parent.mkdir()
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _config(binary, **kw) -> LlamaServerConfig:
    return LlamaServerConfig(str(binary), "/models/m.gguf", threads=3, parallel=4,
                             ctx_size=1024, **kw)


class Counter:
    """A clock that reads 0, 1, 2, ... (thread-safe): each reading is one event later."""

    def __init__(self) -> None:
        self._it = itertools.count()
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return float(next(self._it))


# -- finding the binary and its command line ---------------------------------------------------


def test_find_llama_server_by_path_then_PATH_then_the_build_location(fake_binary, tmp_path,
                                                                    monkeypatch):
    assert find_llama_server(str(fake_binary)) == (str(fake_binary), f"--llama-server "
                                                                     f"{fake_binary}")
    binary, why = find_llama_server(str(tmp_path / "missing" / "llama-server"))
    assert binary is None and "is not an executable file" in why
    monkeypatch.setenv("PATH", str(fake_binary.parent))
    assert find_llama_server() == (str(fake_binary), "found on $PATH")
    cache = tmp_path / "cache"
    built = cache / "llama.cpp" / "build" / "bin" / "llama-server"
    built.parent.mkdir(parents=True)
    built.write_bytes(fake_binary.read_bytes())
    built.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(cache))
    assert find_llama_server() == (str(built), "the build script's location")
    built.unlink()
    binary, why = find_llama_server()
    assert binary is None and "build_llama_server.sh" in why


def test_spec_args_cap_the_drafts_at_kappa():
    assert spec_args(None, 4) == []
    assert spec_args("ngram-mod", 4) == ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-max",
                                         "4", "--spec-ngram-mod-n-min", "1"]
    assert spec_args("ngram-simple", 3) == ["--spec-type", "ngram-simple",
                                            "--spec-ngram-simple-size-m", "3"]
    assert spec_args("ngram-map-k", 5)[-2:] == ["--spec-ngram-map-k-size-m", "5"]
    assert spec_args("ngram-cache", 4) == ["--spec-type", "ngram-cache"]  # not settable
    with pytest.raises(ValueError, match="draft-simple"):
        spec_args("draft-simple", 4)
    with pytest.raises(ValueError, match="kappa >= 1"):
        spec_args("ngram-mod", 0)


def test_the_servers_of_a_bench_share_threads_slots_and_context():
    systems = systems_for(4, 16, baselines=("hf", "llama-server"), llama_spec_type="ngram-mod")
    cfgs = llama_configs("/bin/llama-server", "/m.gguf", 2, [1, 4, 16], 300, 64, 4, systems,
                         ["--flash-attn", "off"])
    assert list(cfgs) == ["llama-server", "llama-server ngram-mod"]
    plain, spec = cfgs.values()
    assert (plain.spec_type, spec.spec_type, spec.kappa) == (None, "ngram-mod", 4)
    assert plain.parallel == spec.parallel == 16 and plain.threads == 2
    assert plain.ctx_size == context_size(16, 300, 64, 4) >= 16 * (300 + 64 + 4)
    assert plain.ctx_size % 256 == 0
    cmd = spec.command(8123)
    for pair in (["--port", "8123"], ["--host", "127.0.0.1"], ["-t", "2"], ["--parallel", "16"],
                 ["-m", "/m.gguf"], ["--spec-type", "ngram-mod"]):
        i = cmd.index(pair[0])
        assert cmd[i:i + 2] == pair
    assert "--jinja" in cmd and "--no-cache-prompt" in cmd and cmd[-2:] == ["--flash-attn",
                                                                            "off"]
    assert "--spec-type" not in plain.command(8123)


# -- the process -------------------------------------------------------------------------------


def test_started_health_waited_driven_and_stopped(fake_binary, tmp_path, monkeypatch):
    argv_file = tmp_path / "argv"
    monkeypatch.setenv("FAKE_LLAMA_ARGV", str(argv_file))
    monkeypatch.setenv("FAKE_LLAMA_LOADING", "3")  # 503 three times: still loading
    server = LlamaServer(_config(fake_binary, spec_type="ngram-simple", kappa=2))
    with server:
        proc = server.proc
        assert server.healthy()
        assert argv_file.read_text().split("\n")[:4] == ["-m", "/models/m.gguf", "--host",
                                                         "127.0.0.1"]
        assert f"{server.port}" in argv_file.read_text().split("\n")
        res = run_llama(openai_client(server.url), "m", PROMPTS, 4, "llama-server", 2)
    assert proc.poll() is not None and server.proc is None  # stopped
    assert res.texts == ["one two three one ", "four five four five ", "six six six six "]
    assert res.num_tokens == 12 and res.token_ids is None  # compared as texts
    assert (res.spec.num_draft_tokens, res.spec.num_accepted_tokens) == (12, 6)
    assert len(res.latencies) == 3 and all(x.num_tokens == 4 for x in res.latencies)
    server.stop()  # twice is fine


@pytest.mark.parametrize("error", [KeyError, KeyboardInterrupt])
def test_stopped_when_the_bench_fails_or_is_interrupted(fake_binary, error):
    server = LlamaServer(_config(fake_binary))
    with pytest.raises(error):
        with server:
            proc = server.proc
            raise error("a failing run, or Ctrl-C")
    assert proc.poll() is not None


def test_sigterm_unwinds_the_bench_like_ctrl_c():
    """A SIGTERM during the runs raises KeyboardInterrupt, so the bench's ``finally`` stops
    its servers (Ray's handler would end the process at once); a second one does not cut
    that cleanup short; the handler is restored."""
    before = signal.getsignal(signal.SIGTERM)
    cleaned = False
    with pytest.raises(KeyboardInterrupt, match="signal 15"):
        with sigterm_unwinds():
            try:
                signal.raise_signal(signal.SIGTERM)
            finally:
                signal.raise_signal(signal.SIGTERM)  # a second one: ignored during cleanup
                cleaned = True
    assert cleaned
    assert signal.getsignal(signal.SIGTERM) is before


def test_ctrl_c_does_not_wait_for_the_requests_in_flight():
    """Ctrl-C during a pass: run_openai_concurrent raises at once (so the bench goes on to
    stop its servers), leaving the request in flight to its thread."""
    in_flight, release, finished = threading.Event(), threading.Event(), threading.Event()

    class Completions:
        def create(self, messages, **kw):
            if messages == "interrupt":
                in_flight.wait(10)
                raise KeyboardInterrupt
            in_flight.set()
            release.wait(10)
            finished.set()
            raise RuntimeError("the server is gone")

    class Client:
        chat = type("Chat", (), {"completions": Completions()})()

    prompts = [{"messages": "interrupt"}, {"messages": "slow"}, {"messages": "never sent"}]
    with pytest.raises(KeyboardInterrupt):
        run_openai_concurrent(Client(), "m", prompts, 4, "s", 2)
    assert not finished.is_set()  # did not wait for the slow request
    release.set()


def test_killed_when_it_ignores_sigterm(fake_binary, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_IGNORE_TERM", "1")
    server = LlamaServer(_config(fake_binary), stop_timeout_s=0.5).start()
    proc = server.proc
    server.stop()
    assert proc.poll() == -9  # SIGKILL after the grace


def test_a_server_that_exits_at_start_is_a_clear_error(fake_binary, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_EXIT", "3")
    server = LlamaServer(_config(fake_binary))
    with pytest.raises(RuntimeError, match=r"exited with code 3 before it was healthy"
                                           r"(.|\n)*failing at start as told"):
        server.start()
    assert server.proc is None


def test_a_server_never_healthy_times_out_and_is_stopped(fake_binary, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_LOADING", "1000000")
    clock = Counter()  # each reading one second later: the deadline passes on the 3rd poll
    server = LlamaServer(_config(fake_binary), health_timeout_s=2, clock=clock,
                         sleep=lambda s: None)
    with pytest.raises(TimeoutError, match="not healthy within 2 s"):
        server.start()
    assert server.proc is None


def test_servers_started_together_are_all_stopped_when_one_fails(fake_binary, tmp_path):
    bad = tmp_path / "bad-llama-server"
    bad.write_text("#!/bin/sh\necho 'no such option' >&2\nexit 2\n")
    bad.chmod(0o755)
    servers = LlamaServers({"llama-server": _config(fake_binary),
                            "llama-server ngram-mod": _config(bad, spec_type="ngram-mod",
                                                              kappa=4)})
    with pytest.raises(RuntimeError, match=r"exited with code 2(.|\n)*no such option"):
        servers.start_all()
    first = servers.servers["llama-server"]
    assert first.proc is None  # the one that had started was stopped


def test_warm_up_reports_the_prompt_tokens_it_counted(fake_binary):
    with LlamaServers({"llama-server": _config(fake_binary)}) as servers:
        assert servers.warm_up("llama-server", "m", PROMPTS[0]["messages"]) == 3
        res = servers.run("llama-server", "m", PROMPTS[:2], 3, 1)
    assert res.system == "llama-server" and res.concurrency == 1
    assert res.texts == ["one two three ", "four five four "]


def test_restart_gives_a_fresh_process_and_stops_the_old(fake_binary, tmp_path, monkeypatch):
    """The bench restarts a speculative server before each of its passes (llama.cpp's n-gram
    state remembers earlier requests); the restart warms up on a prompt not in the bench."""
    argv_file = tmp_path / "argv"
    monkeypatch.setenv("FAKE_LLAMA_ARGV", str(argv_file))
    with LlamaServers({"llama-server ngram-mod": _config(fake_binary, spec_type="ngram-mod",
                                                         kappa=4)}) as servers:
        old = servers.servers["llama-server ngram-mod"].proc
        servers.restart("llama-server ngram-mod", "m")
        new = servers.servers["llama-server ngram-mod"].proc
        assert old.poll() is not None and new.poll() is None and new.pid != old.pid
        res = servers.run("llama-server ngram-mod", "m", PROMPTS[:1], 2, 1)
        assert "--spec-type" in argv_file.read_text().split("\n")  # the same command
    assert res.texts == ["one two "]
    assert new.poll() is not None


# -- streamed requests: TTFT and inter-token latency --------------------------------------------


def test_ttft_and_itl_on_a_counting_clock(fake_binary):
    """The clock is read before sending and at each content chunk: with one token per chunk,
    TTFT is one reading after the send and every token one more."""
    with LlamaServer(_config(fake_binary)) as server:
        res = run_openai_concurrent(openai_client(server.url), "m", PROMPTS, 5, "s", 1,
                                    stream=True, extra_body=None,
                                    spec_stats=llama_spec_stats, clock=Counter())
    assert [(x.ttft_s, x.last_token_s, x.num_tokens) for x in res.latencies] == [
        (1.0, 5.0, 5)] * 3
    assert [x.itl_s for x in res.latencies] == [1.0] * 3
    assert res.seconds == 3 * 6 + 1  # one reading to start, six per request


def test_itl_counts_tokens_not_chunks(fake_binary, monkeypatch):
    """Chunks of two tokens (a speculative step's tokens arrive together): the mean gap per
    token is half the gap per chunk."""
    monkeypatch.setenv("FAKE_LLAMA_TOKENS_PER_CHUNK", "2")
    with LlamaServer(_config(fake_binary)) as server:
        res = run_openai_concurrent(openai_client(server.url), "m", PROMPTS[:1], 8, "s", 1,
                                    stream=True, extra_body=None, clock=Counter())
    (lat,) = res.latencies
    assert (lat.ttft_s, lat.last_token_s, lat.num_tokens) == (1.0, 4.0, 8)  # 4 chunks
    assert lat.itl_s == pytest.approx(3 / 7)
    assert res.texts == ["one two three one two three one two "]


def test_request_latency_itl_needs_two_tokens():
    assert RequestLatency(0.5, 0.5, 1).itl_s is None
    assert RequestLatency(0.5, 1.5, 3).itl_s == pytest.approx(0.5)
    assert RequestLatency(0.5, 1.5, 3).as_dict()["itl_s"] == pytest.approx(0.5)


def test_unstreamed_requests_record_no_latency(fake_binary):
    with LlamaServer(_config(fake_binary)) as server:
        res = run_openai_concurrent(openai_client(server.url), "m", PROMPTS[:2], 3, "s", 2,
                                    extra_body=None, spec_stats=llama_spec_stats)
    assert res.latencies == [] and res.num_tokens == 6
    assert res.spec.num_draft_tokens == 6
