"""llama.cpp's ``llama-server`` as the bench's peer (``--baselines llama-server``): finding the
binary, the command line that runs the bench's GGUF the way specmesh runs it, the server
process (started on a free port of 127.0.0.1, health-waited, always stopped), and one pass of
prompts through it with the served system's client code.

The command: the same GGUF, ``-t`` the specmesh verifier's thread count, ``--parallel`` the
highest concurrency level, a context of ``parallel x (longest prompt + max_tokens + kappa +
slack)`` (llama.cpp splits it among its slots), the GGUF's own chat template (``--jinja``),
no prompt cache (``--no-cache-prompt``: specmesh reuses no KV across requests, and a level's
prompts repeat). Speculative servers add ``--spec-type TYPE`` with drafts capped at kappa
(:func:`spec_args`). The build: benchmarks/build_llama_server.sh. Imports no torch and no
Ray.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from specmesh.benchmarks.harness.report import System
from specmesh.cluster.runs import RunResult, openai_client, run_openai_concurrent
from specmesh.protocol.spec_stats import SpecStats

#: llama-server's speculation types that need no draft model, each with the option that caps
#: its draft length (None: not settable; ngram-cache drafts up to 8 tokens)
NGRAM_SPEC_TYPES: dict[str, tuple[str, ...] | None] = {
    "ngram-mod": ("--spec-ngram-mod-n-max",),
    "ngram-simple": ("--spec-ngram-simple-size-m",),
    "ngram-map-k": ("--spec-ngram-map-k-size-m",),
    "ngram-map-k4v": ("--spec-ngram-map-k4v-size-m",),
    "ngram-cache": None,
}
#: The bench's default: the fastest type on the bundled prompts (docs/benchmarks.md,
#: 'llama.cpp as the peer')
DEFAULT_SPEC_TYPE = "ngram-mod"
#: Context tokens per slot beyond prompt + max_tokens + kappa (llama-server keeps 2 free)
CONTEXT_SLACK = 16
#: How long a server may take to load its model and answer /health, seconds
HEALTH_TIMEOUT_S = 300.0


def default_binary() -> Path:
    """Where benchmarks/build_llama_server.sh puts the binary:
    ``$SPECMESH_CACHE_DIR/llama.cpp/build/bin/llama-server`` (default cache dir
    ``~/.cache/specmesh``)."""
    from specmesh.engine.weights_cache import cache_root  # the engine's module: torch

    return cache_root() / "llama.cpp" / "build" / "bin" / "llama-server"


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_llama_server(path: str | None = None) -> tuple[str | None, str]:
    """(binary, how it was found) or (None, why not): ``path`` when given (``--llama-server``),
    else ``llama-server`` on ``$PATH``, else :func:`default_binary`."""
    if path:
        p = Path(path).expanduser()
        if _executable(p):
            return str(p), f"--llama-server {path}"
        return None, f"--llama-server {path} is not an executable file"
    found = shutil.which("llama-server")
    if found:
        return found, "found on $PATH"
    if _executable(default_binary()):
        return str(default_binary()), "the build script's location"
    return None, (f"no llama-server on $PATH nor at {default_binary()} (build it with "
                  f"bash benchmarks/build_llama_server.sh)")


def spec_args(spec_type: str | None, kappa: int) -> list[str]:
    """llama-server options for ``spec_type`` speculation with at most ``kappa`` drafts per
    step (none for plain decode; ``ngram-mod`` also takes drafts from one token on, where its
    default discards drafts under 48 tokens).

    Raises:
        ValueError: a type that is not one of :data:`NGRAM_SPEC_TYPES`, or kappa < 1 with a
            type.
    """
    if spec_type is None:
        return []
    if spec_type not in NGRAM_SPEC_TYPES:
        raise ValueError(f"llama-server speculation type {spec_type!r} is not one of "
                         f"{', '.join(NGRAM_SPEC_TYPES)}")
    if kappa < 1:
        raise ValueError(f"speculation needs kappa >= 1, got {kappa}")
    out = ["--spec-type", spec_type]
    for opt in NGRAM_SPEC_TYPES[spec_type] or ():
        out += [opt, str(kappa)]
    if spec_type == "ngram-mod":
        out += ["--spec-ngram-mod-n-min", "1"]
    return out


def context_size(parallel: int, max_prompt_tokens: int, max_tokens: int, kappa: int) -> int:
    """Total context of a server with ``parallel`` slots, each fitting the longest prompt, its
    completion and a draft of kappa, rounded up to a multiple of 256."""
    per_slot = max_prompt_tokens + max_tokens + kappa + CONTEXT_SLACK
    total = parallel * per_slot
    return -(-total // 256) * 256


@dataclass(frozen=True)
class LlamaServerConfig:
    """One llama-server: ``binary``, the ``gguf`` it serves, ``threads`` (``-t``, and the
    batch threads with it), ``parallel`` slots, ``ctx_size`` tokens in all, ``spec_type``
    (None: plain decode) with ``kappa`` drafts at most, ``extra_args`` appended as given."""

    binary: str
    gguf: str
    threads: int
    parallel: int
    ctx_size: int
    spec_type: str | None = None
    kappa: int = 0
    extra_args: tuple[str, ...] = ()

    def command(self, port: int) -> list[str]:
        """The command line serving on 127.0.0.1:``port``."""
        return [self.binary, "-m", self.gguf, "--host", "127.0.0.1", "--port", str(port),
                "-t", str(self.threads), "--parallel", str(self.parallel),
                "-c", str(self.ctx_size), "--jinja", "--no-cache-prompt",
                *spec_args(self.spec_type, self.kappa), *self.extra_args]

    def as_dict(self) -> dict:
        return {"binary": self.binary, "gguf": self.gguf, "threads": self.threads,
                "parallel": self.parallel, "ctx_size": self.ctx_size,
                "spec_type": self.spec_type, "kappa": self.kappa,
                "extra_args": list(self.extra_args)}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LlamaServer:
    """One llama-server process for the length of a bench. :meth:`start` launches it on a free
    port of 127.0.0.1 (its output to an anonymous temporary file, quoted in errors) and waits
    until ``/health`` answers 200; :meth:`stop` ends it (SIGTERM, then SIGKILL after
    ``stop_timeout_s``) and is safe to call twice. As a context manager it stops on any exit,
    an error or Ctrl-C included. ``clock`` and ``sleep`` pace the health wait."""

    def __init__(self, config: LlamaServerConfig, health_timeout_s: float = HEALTH_TIMEOUT_S,
                 stop_timeout_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.config = config
        self.health_timeout_s, self.stop_timeout_s = health_timeout_s, stop_timeout_s
        self.clock, self.sleep = clock, sleep
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        """The server's base URL (``http://127.0.0.1:PORT``)."""
        if self.port is None:
            raise RuntimeError("llama-server is not started")
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LlamaServer:
        """Launch the server and wait for its health.

        Raises:
            RuntimeError: it exited before answering (its exit code and last output quoted).
            TimeoutError: no healthy answer within ``health_timeout_s`` (it is stopped).
        """
        if self.proc is not None:
            raise RuntimeError("llama-server already started")
        self.port = free_port()
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.config.command(self.port), stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def log_tail(self, num_chars: int = 2000) -> str:
        """The last ``num_chars`` characters the server printed."""
        if self._log is None or self._log.closed:
            return ""
        self._log.flush()
        self._log.seek(0, os.SEEK_END)
        size = self._log.tell()
        self._log.seek(max(0, size - num_chars))
        return self._log.read().decode("utf-8", "replace")

    def healthy(self) -> bool:
        """Does ``/health`` answer 200 now? (503 while the model loads.)"""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # local: no proxy
        try:
            with opener.open(f"{self.url}/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def wait_healthy(self) -> None:
        """Poll ``/health`` until it answers 200.

        Raises:
            RuntimeError: the process exited first.
            TimeoutError: ``health_timeout_s`` passed.
        """
        deadline = self.clock() + self.health_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"llama-server exited with code {code} before it was "
                                   f"healthy: {' '.join(self.config.command(self.port))}\n"
                                   f"{self.log_tail()}")
            if self.healthy():
                return
            if self.clock() >= deadline:
                raise TimeoutError(f"llama-server was not healthy within "
                                   f"{self.health_timeout_s:g} s\n{self.log_tail()}")
            self.sleep(0.2)

    def stop(self) -> None:
        """End the process (SIGTERM, then SIGKILL) and drop its output; a no-op when not
        running."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> LlamaServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def llama_spec_stats(extra: dict) -> SpecStats:
    """Spec stats from llama-server's ``timings`` (``draft_n`` drafted, ``draft_n_accepted``
    accepted; it reports no verify steps, so the mean accept length is unknown)."""
    t = extra.get("timings") or {}
    return SpecStats(int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0)), 0)


def run_llama(client, model: str, prompts: list[dict], max_tokens: int, system: str,
              concurrency: int) -> RunResult:
    """``prompts`` through a llama-server from ``concurrency`` clients, streamed, with the
    served system's client code (:func:`cluster.runs.run_openai_concurrent`): the same
    messages, greedy, the same ``max_tokens``; spec stats from its ``timings``."""
    return run_openai_concurrent(client, model, prompts, max_tokens, system, concurrency,
                                 stream=True, extra_body=None, spec_stats=llama_spec_stats)


#: The warm-up request after a restart: not one of the bench's prompts, so a fresh server's
#: n-gram state holds nothing of them
NEUTRAL_MESSAGES = [{"role": "user", "content": "Say hello."}]


class LlamaServers:
    """The bench's llama-servers, one per system name, started together and stopped together
    (:meth:`stop_all`, also when one of them fails to start), each with its ``openai``
    client. :meth:`restart` gives one a fresh process: llama.cpp's n-gram speculators keep
    state across requests (``ngram-mod`` one hash of every request's n-grams for the whole
    server, ``ngram-cache`` one cache per slot), so a server that saw a prompt's output
    drafts it from memory the next time the prompt comes."""

    def __init__(self, configs: dict[str, LlamaServerConfig], **server_kwargs) -> None:
        self.configs = dict(configs)
        self.servers: dict[str, LlamaServer] = {}
        self.clients: dict = {}
        self.server_kwargs = server_kwargs

    def start_all(self) -> None:
        """Start every server in turn (the ones already started are stopped if one fails)."""
        try:
            for name, cfg in self.configs.items():
                server = LlamaServer(cfg, **self.server_kwargs)
                self.servers[name] = server
                server.start()
                self.clients[name] = openai_client(server.url)
        except BaseException:
            self.stop_all()
            raise

    def restart(self, name: str, model: str) -> None:
        """Replace the server of system ``name`` by a fresh process (a new port, a new
        client), warmed up with :data:`NEUTRAL_MESSAGES`."""
        self.servers[name].stop()
        server = LlamaServer(self.configs[name], **self.server_kwargs)
        self.servers[name] = server
        server.start()
        self.clients[name] = openai_client(server.url)
        self.warm_up(name, model, NEUTRAL_MESSAGES)

    def warm_up(self, name: str, model: str, messages: list[dict]) -> int:
        """One short greedy request to the server of system ``name``; returns the prompt
        tokens it counted (to check that its chat template renders the prompt as specmesh
        does)."""
        resp = self.clients[name].chat.completions.create(
            model=model, messages=messages, max_tokens=4, temperature=0)
        return resp.usage.prompt_tokens

    def run(self, name: str, model: str, prompts: list[dict], max_tokens: int,
            concurrency: int) -> RunResult:
        """:func:`run_llama` on the server of system ``name``."""
        return run_llama(self.clients[name], model, prompts, max_tokens, name, concurrency)

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()

    def __enter__(self) -> LlamaServers:
        self.start_all()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()


def llama_configs(binary: str, gguf: str, threads: int, levels: Sequence[int],
                  max_prompt_tokens: int, max_tokens: int, kappa: int,
                  systems: Sequence[System], extra_args: Sequence[str] = ()
                  ) -> dict[str, LlamaServerConfig]:
    """The server of each llama system of ``systems`` (kind ``llama``; speculative when its
    kappa > 0, of type ``method``), by name, all with ``max(levels)`` slots and room for the
    longest prompt."""
    parallel = max(levels)
    ctx = context_size(parallel, max_prompt_tokens, max_tokens, kappa)
    return {s.name: LlamaServerConfig(binary, gguf, threads, parallel, ctx,
                                      s.method if s.kappa > 0 else None, s.kappa,
                                      tuple(extra_args))
            for s in systems if s.kind == "llama"}
