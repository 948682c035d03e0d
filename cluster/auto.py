"""What ``auto`` means for the settings a user feels: the model dtype, the drafter and the
context length. Plain decision logic over facts and measurements handed in (a test gives fake
ones); ``cluster/auto_resolve.py`` gathers the real facts, measures and caches.

- dtype (:func:`choose_dtype`): the fastest *exact* candidate. Exact: its greedy output is the
  float32 reference's (Hugging Face float32 on the same weights). On CPU the candidates are
  float32 (exact) and bfloat16 (not: it rounds weights and activations, and its greedy output
  drifts from the reference; with and without speculation it agrees with itself). Every
  candidate is timed (a decode and a verify forward, :mod:`engine.forward_probe`) so that the
  reason says what the others would cost, and the result is cached per model, CPU, torch
  version and thread count (:class:`AutoCache`).
- drafter (:func:`resolve_auto_drafter`): a model drafter (the EAGLE head shipped for the
  target) only where it does not slow the verifier: the verifier computes on a GPU, or the
  CPU has cores enough that the drafter's take at most :data:`MAX_VERIFIER_THREAD_LOSS` of the
  verifier's; otherwise n-gram, which costs no forward.
- context (:func:`default_max_model_len`): the model's ``max_position_embeddings`` bounded
  by the tokens a role's KV memory holds, as vLLM derives ``max_model_len``.
- decided once (:func:`follow_settled`): the cluster's controller keeps the first value each
  setting was given; a role launched later takes it where its own is ``auto`` and is refused
  with a clear error where the user gave another.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: the command-line flag of each setting (for error messages)
FLAGS = {"dtype": "--dtype", "max_model_len": "--max-model-len", "drafter": "--drafter"}


# --------------------------------------------------------------------------------------------
# dtype
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """A configuration ``--dtype auto`` may choose; ``exact``: its greedy output is the float32
    reference's; ``note``: why not, where it is not."""

    dtype: str
    exact: bool
    note: str = ""


#: CPU candidates, the exact first (the choice where nothing could be measured)
CPU_CANDIDATES = (
    Candidate("float32", True),
    Candidate("bfloat16", False, "rounds weights and activations: its greedy output drifts "
                                 "from the float32 reference"),
)


@dataclass(frozen=True)
class DtypeChoice:
    """What ``--dtype auto`` chose and why. ``source``: ``measured`` (now), ``cached`` (an
    earlier measurement of this model on this CPU) or ``rule`` (the choice was not measured).
    ``timings``: dtype -> {"decode_ms", "verify_ms", ...} of the measurement, or why a
    candidate could not be measured (a string)."""

    dtype: str
    reason: str
    source: str
    timings: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"dtype": self.dtype, "reason": self.reason, "source": self.source,
                "timings": dict(self.timings)}


def _cost(timing: Mapping) -> float:
    return float(timing["decode_ms"]) + float(timing["verify_ms"])


def pick_dtype(candidates: tuple[Candidate, ...], timings: Mapping[str, Any]) -> DtypeChoice:
    """The fastest exact candidate by ``timings`` (dtype -> a mapping with ``decode_ms`` and
    ``verify_ms``, or why it could not be measured); the first exact candidate where no exact
    one was measured; the fastest inexact one only where ``candidates`` has no exact one.

    Raises:
        ValueError: no candidates.
    """
    if not candidates:
        raise ValueError("no dtype candidates")
    measured = {c.dtype: _cost(timings[c.dtype]) for c in candidates
                if isinstance(timings.get(c.dtype), Mapping)}
    exact = [c for c in candidates if c.exact]
    pool = [c for c in (exact or candidates) if c.dtype in measured]
    if pool:
        best = min(pool, key=lambda c: measured[c.dtype])
    else:
        best = (exact or candidates)[0]
    whys = {str(timings.get(c.dtype) or "") for c in candidates}
    shared_why = whys.pop() if not measured and len(whys) == 1 else None
    parts = []
    for c in candidates:
        t = timings.get(c.dtype)
        if isinstance(t, Mapping):
            what = (f" decode {float(t['decode_ms']):.1f} ms + verify "
                    f"{float(t['verify_ms']):.1f} ms")
            if c is not best and best.dtype in measured:
                what += f" ({measured[c.dtype] / measured[best.dtype]:.2f}x {best.dtype}'s)"
        elif shared_why is None:
            what = f" not measured ({t})" if t else " not measured"
        else:
            what = ""
        if not c.exact:
            what += (", not exact" if what else " not exact") + (f": {c.note}" if c.note else "")
        if what:
            parts.append(c.dtype + what)
    head = ("the fastest exact candidate" if best.exact and best.dtype in measured
            else "the exact candidate" if best.exact else "no exact candidate: the fastest")
    if shared_why is not None:
        head += f", not measured ({shared_why})" if shared_why else ", not measured"
    busy = [t for t in timings.values() if isinstance(t, Mapping)
            and 0 < float(t.get("num_cpus", 0)) < float(t.get("load_avg", -1))]
    if busy:
        parts.append(f"measured while other processes shared the cores (load average "
                     f"{float(busy[0]['load_avg']):.1f} on {int(busy[0]['num_cpus'])} CPUs): "
                     f"the times are higher than on an idle machine")
    return DtypeChoice(best.dtype, "; ".join([head, *parts]),
                       "measured" if best.dtype in measured else "rule", dict(timings))


class AutoCache:
    """Measurements kept as JSON files under ``root`` (the weights cache's ``auto/``), one per
    key (a dict: model fingerprint, CPU identity, torch version, threads...): a key that
    differs in anything (another model file, another CPU) finds nothing and is measured
    again. Unreadable or foreign files count as missing; a failed write is logged, not
    raised (the next start measures again)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path(self, key: Mapping) -> Path:
        text = json.dumps(key, sort_keys=True, default=str)
        return self.root / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"

    def get(self, key: Mapping) -> dict | None:
        """The value stored for ``key``, or None."""
        try:
            entry = json.loads(self.path(key).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(entry, dict) or entry.get("key") != json.loads(
                json.dumps(key, sort_keys=True, default=str)):
            return None
        value = entry.get("value")
        return value if isinstance(value, dict) else None

    def put(self, key: Mapping, value: dict) -> None:
        """Store ``value`` for ``key`` (written to a temporary file, then renamed)."""
        target = self.path(key)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
            with os.fdopen(fd, "w") as f:
                json.dump({"key": key, "value": value}, f, sort_keys=True, default=str)
            os.replace(tmp, target)
        except OSError as err:
            log.warning("could not write the auto measurement cache %s: %s", target, err)


def choose_dtype(candidates: tuple[Candidate, ...],
                 measure: Callable[[list[str]], Mapping[str, Any]],
                 cache: AutoCache | None = None, key: Mapping | None = None) -> DtypeChoice:
    """The dtype ``auto`` runs (:func:`pick_dtype`) from a measurement of every candidate:
    ``measure(dtypes)`` -> dtype -> timing mapping (or why not measured). With a ``cache`` and
    ``key``, a measurement stored under ``key`` is used instead of measuring (``source``
    ``cached``), and a new one is stored.

    Raises:
        ValueError: no candidates.
    """
    stored = cache.get(key) if cache is not None and key is not None else None
    if stored is not None:
        try:
            got = pick_dtype(candidates, stored["timings"])
        except (KeyError, TypeError, ValueError, AttributeError):
            got = None  # a malformed entry: measured again
        if got is not None and got.source == "measured":
            return DtypeChoice(got.dtype, got.reason + "; measured at an earlier start, "
                               "cached", "cached", got.timings)
    timings = {d: (t.as_dict() if hasattr(t, "as_dict") else t)
               for d, t in dict(measure([c.dtype for c in candidates])).items()}
    got = pick_dtype(candidates, timings)
    if cache is not None and key is not None and got.source == "measured":
        cache.put(key, {"timings": timings, "dtype": got.dtype})
    return got


# --------------------------------------------------------------------------------------------
# drafter
# --------------------------------------------------------------------------------------------

#: the largest share of the verifier's threads a model drafter may take from it: on 2 cores
#: (the drafter's 1 of 2) the verifier's forward slowed more than the shipped EAGLE head's
#: drafts bring back, and served EAGLE fell below served n-gram and k=0 on both CPU kinds
#: measured (benchmarks/bench_eagle_float32_avx2_plan29.md, docs/benchmarks.md)
MAX_VERIFIER_THREAD_LOSS = 1 / 8
MAX_VERIFIER_THREAD_LOSS_TEXT = "1/8"


def resolve_auto_drafter(head: str | None, target: str, num_cores: int, verifier_on_gpu: bool,
                         verifier_threads: int, plain_verifier_threads: int,
                         drafter_threads: int = 1) -> tuple[str, str]:
    """``--drafter auto``: (the ``--drafter`` form it means, why).

    ``head``: the EAGLE head shipped for ``target`` (None: none). A model drafter computes
    while the verifier does; it pays only where it takes nothing the verifier needs: the
    verifier runs on a GPU (the head drafts on the CPU), or the thread plan gives it its own
    cores (``verifier_threads + drafter_threads <= num_cores``) and costs the verifier at most
    :data:`MAX_VERIFIER_THREAD_LOSS` of the threads it has with a drafter that runs no model
    (``plain_verifier_threads``). Otherwise n-gram (prompt lookup), which costs no forward.
    """
    if head is None:
        return "ngram", f"no EAGLE head ships for {target}: n-gram, which costs no forward"
    if verifier_on_gpu:
        return "eagle", (f"the EAGLE head shipped for {target}: the verifier computes on the "
                         "GPU, the head on the CPU, so drafting takes nothing from it")
    own = verifier_threads + drafter_threads <= num_cores
    loss = 1 - verifier_threads / max(1, plain_verifier_threads)
    plan = (f"{num_cores} cores: the verifier would have {verifier_threads} of them beside the "
            f"head's {drafter_threads}, {plain_verifier_threads} beside n-gram")
    if own and loss <= MAX_VERIFIER_THREAD_LOSS + 1e-9:
        return "eagle", f"the EAGLE head shipped for {target}; {plan}"
    return "ngram", (f"n-gram, which costs no forward: the EAGLE head shipped for {target} "
                     f"would slow the verifier ({plan}; a model drafter needs its own device "
                     f"or cores enough to cost the verifier at most "
                     f"{MAX_VERIFIER_THREAD_LOSS_TEXT} of its threads)")


# --------------------------------------------------------------------------------------------
# context length
# --------------------------------------------------------------------------------------------


def default_max_model_len(model_max: int, kv_tokens: int) -> tuple[int, str]:
    """``--max-model-len`` when not given: (the model's context ``model_max``, its
    ``max_position_embeddings``, bounded by ``kv_tokens``, the tokens a role's KV memory
    holds; why).

    Raises:
        ValueError: either is below 2 (no room for a prompt token and an output token).
    """
    if model_max < 2 or kv_tokens < 2:
        raise ValueError(f"no room for a request: the model's context is {model_max} tokens "
                         f"and the KV memory holds {kv_tokens}")
    if kv_tokens < model_max:
        return kv_tokens, (f"the tokens a role's KV memory holds (--kv-cache-mb), below the "
                           f"model's context of {model_max}")
    return model_max, f"the model's context (max_position_embeddings {model_max})"


def check_max_model_len(value: int, model_max: int, kv_tokens: int) -> str:
    """Why a given ``--max-model-len`` cannot be served ("" when it can): below 2, above the
    model's context or above the tokens a role's KV memory holds."""
    if value < 2:
        return f"--max-model-len must be >= 2 (a prompt token and an output token), got {value}"
    if value > model_max:
        return (f"--max-model-len {value} is above the model's context (max_position_embeddings "
                f"{model_max})")
    if value > kv_tokens:
        return (f"--max-model-len {value} is above the {kv_tokens} tokens a role's KV memory "
                f"holds: raise --kv-cache-mb or lower --max-model-len")
    return ""


# --------------------------------------------------------------------------------------------
# decided once
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One decided setting: ``value`` (dtype name, token count, or ``[method, kwargs]`` of the
    drafter), ``reason`` (why this value) and ``given`` (the user typed it: not auto)."""

    value: Any
    reason: str
    given: bool = False

    def as_dict(self) -> dict:
        return {"value": self.value, "reason": self.reason, "given": self.given}

    @classmethod
    def from_dict(cls, d: Mapping) -> Setting:
        return cls(d["value"], str(d.get("reason", "")), bool(d.get("given", False)))


#: settings a role may hold without the cluster agreeing: the gateway runs no model and holds
#: no KV, so its dtype is never compared (protocol/handshake.py) nor proposed
UNSHARED = {"gateway": frozenset({"dtype"})}


def proposal(settings: Mapping[str, Setting], role: str | None = None) -> dict[str, dict]:
    """What a launch of ``role`` (None: a whole cluster) proposes to the controller."""
    skip = UNSHARED.get(role or "", frozenset())
    return {k: s.as_dict() for k, s in settings.items() if k not in skip}


def follow_settled(ours: Mapping[str, Setting], settled: Mapping[str, Mapping],
                   role: str | None = None) -> dict[str, Setting]:
    """``ours`` with each setting the controller settled (``settled``: name -> Setting dict)
    taken in place of one resolved by ``auto`` here.

    Raises:
        ValueError: the user gave a value other than the settled one (the role would never be
            admitted), naming the flag, both values and how to launch it.
    """
    skip = UNSHARED.get(role or "", frozenset())
    out = dict(ours)
    for name, mine in ours.items():
        theirs = settled.get(name)
        if theirs is None:
            continue
        other = Setting.from_dict(theirs)
        if _same(other.value, mine.value):
            continue
        if mine.given and name not in skip:
            raise ValueError(f"{FLAGS.get(name, name)} {_show(mine.value)}: this cluster runs "
                             f"{_show(other.value)}, {settled_reason(other)}; launch with "
                             f"{FLAGS.get(name, name)} {_show(other.value)} or leave it to "
                             f"auto")
        out[name] = Setting(other.value, settled_reason(other))
    return out


def settled_reason(setting: Setting) -> str:
    """Why a role runs a value the cluster's controller settled."""
    why = "given to the launch that settled it" if setting.given else setting.reason
    return f"settled by the cluster's controller ({why})"


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True,
                                                                    default=str)


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[1], dict):
        method, kwargs = value
        return method + (":" + "+".join(f"{k}={v}" for k, v in kwargs.items()) if kwargs else "")
    return str(value)


def banner(settings: Mapping[str, Setting]) -> list[str]:
    """One line per setting: its value and why (the serve / demo / bench / launch banner)."""
    names = {"dtype": "dtype", "max_model_len": "max_model_len", "drafter": "drafter"}
    return [f"[specmesh] {names.get(k, k)} {_show(s.value)}: "
            f"{'given' if s.given else s.reason}" for k, s in settings.items()]
