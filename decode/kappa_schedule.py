"""SGLang's adaptive speculation schedule, for every drafter: kappa per batch-size slot, moved
by an EMA of accepted drafts (pure Python, no torch; ``--speculative-policy schedule``).

SGLang (``--speculative-adaptive``, python/sglang/srt/speculative/adaptive_spec_params.py;
the speculative decoding chapter, 'adaptive speculation') keeps, per configured batch size, a
list of candidate draft counts and a current one:

- the slot of a step is its running batch rounded up to the next configured size (batch 40
  with slots 1, 8, 32, 64 -> slot 64); a batch past the largest uses the largest;
- each slot keeps an EMA (weight :data:`EMA_WEIGHT`) of the accepted drafts per request of
  its steps (the bonus token excluded: ``E - 1`` of the chapter), over the requests that
  verified drafts;
- it decides after :data:`WARMUP_STEPS` steps of its own and then every
  :data:`DECISION_EVERY`: down first, one candidate at a time while the EMA is at or below
  the previous candidate minus 0.5 (0.5 to reach a zero floor) plus ``down_hysteresis``; only
  if it did not move down, up while the EMA is above the current candidate minus 0.5 plus
  ``up_hysteresis`` (so it probes one step past what is accepted). At kappa 0 nothing is
  verified, so the EMA stands still and a decision probes the next candidate up;
- every change is logged (``adaptive: kappa 3 -> 1 (ema_accept_len=0.42, batch=1)``).

The default slots are the chapter's: 1 -> [1, 3, 7] (down_hysteresis -0.25: a quarter token
harder to drop than to rise, so batch 1 leans toward speculating), 8 -> [0, 1, 3],
32 -> [0, 1], 64 -> [0]. SGLang restricts the schedule to EAGLE at top-k 1 because changing
its step count swaps CUDA graphs; specmesh's verifier takes any number of drafts per request
each step, so it runs with every drafter, and a change reaches running requests at their
next step. Never changes the output, only the cost.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

#: Weight of the newest step in a slot's EMA of accepted drafts per request (SGLang's).
EMA_WEIGHT = 0.2
#: Steps a slot runs before its first decision (SGLang's warm-up batches).
WARMUP_STEPS = 10
#: After the warm-up, a slot decides every this-many of its steps (SGLang's update interval).
DECISION_EVERY = 5
#: ``down_hysteresis`` of a slot a schedule file does not give one (SGLang's default).
DEFAULT_DOWN_HYSTERESIS = -0.25
#: Keys a slot of a schedule file may have (SGLang's names; ``ceiling_coeff`` only 0).
SLOT_KEYS = ("candidate_steps", "up_hysteresis", "down_hysteresis", "ceiling_coeff")
#: Keys a schedule file may have besides its slots (SGLang's names).
TOP_KEYS = ("ema_alpha", "warmup_batches", "update_interval")


@dataclass(frozen=True)
class ScheduleSlot:
    """The candidates of one batch-size slot: ``candidates`` (ascending kappas) and the
    hysteresis added to the drop / rise thresholds (draft tokens)."""

    batch_size: int
    candidates: tuple[int, ...]
    up_hysteresis: float = 0.0
    down_hysteresis: float = 0.0


@dataclass(frozen=True)
class ScheduleConfig:
    """A whole schedule: ``slots`` (ascending batch sizes), the EMA weight, the warm-up steps
    and the decision cadence.

    Raises:
        ValueError: no slot, a batch size below 1 or repeated, an empty or negative candidate
            list, an EMA weight outside (0, 1], a negative warm-up or a cadence below 1.
    """

    slots: tuple[ScheduleSlot, ...]
    ema_weight: float = EMA_WEIGHT
    warmup_steps: int = WARMUP_STEPS
    decision_every: int = DECISION_EVERY

    def __post_init__(self) -> None:
        if not self.slots:
            raise ValueError("a speculative schedule needs at least one batch-size slot")
        sizes = [s.batch_size for s in self.slots]
        if sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"schedule slots must have distinct batch sizes >= 1 in ascending "
                             f"order, got {sizes}")
        for s in self.slots:
            if not s.candidates or list(s.candidates) != sorted(set(s.candidates)) \
                    or s.candidates[0] < 0:
                raise ValueError(f"slot {s.batch_size}: candidate kappas must be distinct "
                                 f"integers >= 0 in ascending order, got {list(s.candidates)}")
        if not 0 < self.ema_weight <= 1:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_weight}")
        if self.warmup_steps < 0 or self.decision_every < 1:
            raise ValueError(f"warmup_batches must be >= 0 and update_interval >= 1, got "
                             f"{self.warmup_steps} and {self.decision_every}")

    @property
    def max_kappa(self) -> int:
        """The largest candidate of any slot."""
        return max(s.candidates[-1] for s in self.slots)


#: The chapter's default (SGLang's DEFAULT_ADAPTIVE_CONFIG as the chapter quotes it).
DEFAULT_SCHEDULE = ScheduleConfig((
    ScheduleSlot(1, (1, 3, 7), up_hysteresis=0.0, down_hysteresis=-0.25),
    ScheduleSlot(8, (0, 1, 3)),
    ScheduleSlot(32, (0, 1)),
    ScheduleSlot(64, (0,)),
))


def parse_schedule(obj: object) -> ScheduleConfig:
    """A schedule from SGLang's ``--speculative-adaptive-config`` JSON shape:
    ``{"1": {"candidate_steps": [1, 3, 7], "up_hysteresis": 0.0, "down_hysteresis": -0.25},
    "8": {...}, "ema_alpha": 0.2, "warmup_batches": 10, "update_interval": 5}`` (a slot's
    hysteresis defaults to 0.0 up and -0.25 down, SGLang's; the three top-level keys to
    :data:`EMA_WEIGHT`, :data:`WARMUP_STEPS`, :data:`DECISION_EVERY`). A slot may also be a
    bare list of candidates (``{"1": [1, 3, 7]}``).

    Raises:
        ValueError: not an object, an unknown key, a malformed slot, or what
            :class:`ScheduleConfig` refuses.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"a speculative schedule must be a JSON object, got "
                         f"{type(obj).__name__}")
    slots, top = [], {}
    for key, entry in obj.items():
        if key in TOP_KEYS:
            top[key] = entry
            continue
        if not (isinstance(key, str) and key.isdigit()):
            raise ValueError(f"unknown schedule key {key!r}: a slot is a batch size (\"8\"), "
                             f"else one of {', '.join(TOP_KEYS)}")
        slots.append(_parse_slot(int(key), entry))
    for key, value in top.items():
        integer = key != "ema_alpha"
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            kind = "an integer" if integer else "a number"
            raise ValueError(f"schedule {key} must be {kind}, got {value!r}")
    return ScheduleConfig(tuple(sorted(slots, key=lambda s: s.batch_size)),
                          ema_weight=float(top.get("ema_alpha", EMA_WEIGHT)),
                          warmup_steps=int(top.get("warmup_batches", WARMUP_STEPS)),
                          decision_every=int(top.get("update_interval", DECISION_EVERY)))


def _parse_slot(batch_size: int, entry: object) -> ScheduleSlot:
    if isinstance(entry, list):
        entry = {"candidate_steps": entry}
    if not isinstance(entry, dict):
        raise ValueError(f"slot {batch_size}: expected an object with candidate_steps or a "
                         f"list of kappas, got {entry!r}")
    unknown = set(entry) - set(SLOT_KEYS)
    if unknown:
        raise ValueError(f"slot {batch_size}: unknown keys {sorted(unknown)} (known: "
                         f"{', '.join(SLOT_KEYS)})")
    if entry.get("ceiling_coeff", 0) != 0:
        raise ValueError(f"slot {batch_size}: ceiling_coeff is not supported (0 only)")
    steps = entry.get("candidate_steps")
    if not isinstance(steps, list) or not steps or not all(
            isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in steps):
        raise ValueError(f"slot {batch_size}: candidate_steps must be a non-empty list of "
                         f"integers >= 0, got {steps!r}")
    hyst = {}
    for name, default in (("up_hysteresis", 0.0), ("down_hysteresis", DEFAULT_DOWN_HYSTERESIS)):
        value = entry.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"slot {batch_size}: {name} must be a number, got {value!r}")
        hyst[name] = float(value)
    return ScheduleSlot(batch_size, tuple(sorted(set(steps))), **hyst)


def load_schedule(path: str) -> ScheduleConfig:
    """:func:`parse_schedule` of a JSON file.

    Raises:
        ValueError: an unreadable file, malformed JSON or a schedule it refuses (the message
            names the file).
    """
    try:
        with open(path) as f:
            return parse_schedule(json.load(f))
    except (OSError, ValueError) as err:
        raise ValueError(f"speculative schedule {path}: {err}") from None


@dataclass
class SlotState:
    """One slot's running state: its current ``kappa``, the EMA of accepted drafts per
    request, and the steps it has run."""

    slot: ScheduleSlot
    kappa: int
    ema_accept_len: float
    num_steps: int = 0


@dataclass(frozen=True)
class KappaChange:
    """A decision that moved a slot's kappa."""

    batch_size: int  # the slot's
    batch: int  # the step's running batch
    old: int
    new: int
    ema_accept_len: float


@dataclass
class KappaSchedule:
    """The controller: :meth:`kappa_for` before a verify step, :meth:`observe` after it.

    ``initial_kappa`` starts every slot that lists it as a candidate; the others start at
    their middle candidate (SGLang's rule). A slot's EMA starts at its kappa - 1 (neutral).
    """

    config: ScheduleConfig = DEFAULT_SCHEDULE
    initial_kappa: int = 3
    states: dict[int, SlotState] = field(init=False)
    #: the kappa of the latest step (:meth:`kappa_for`); the ``specmesh:spec_decode_kappa`` gauge
    current_kappa: int = field(init=False)
    #: every change so far, oldest first
    changes: list[KappaChange] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.states = {}
        for s in self.config.slots:
            k = self.initial_kappa if self.initial_kappa in s.candidates \
                else s.candidates[len(s.candidates) // 2]
            self.states[s.batch_size] = SlotState(s, k, float(k - 1))
        self.current_kappa = self.states[self.config.slots[0].batch_size].kappa

    def slot_for(self, batch: int) -> SlotState:
        """The slot of a step running ``batch`` requests: the smallest configured size >=
        ``batch``, else the largest."""
        for s in self.config.slots:
            if batch <= s.batch_size:
                return self.states[s.batch_size]
        return self.states[self.config.slots[-1].batch_size]

    def kappa_for(self, batch: int) -> int:
        """The kappa of a verify step running ``batch`` requests (its slot's current one)."""
        self.current_kappa = self.slot_for(batch).kappa
        return self.current_kappa

    def observe(self, batch: int, accepted_drafts: list[int]) -> KappaChange | None:
        """One verify step of ``batch`` requests is done: ``accepted_drafts`` per request
        that verified drafts (none: the EMA stands still). Counts the step in its slot and,
        on a decision step, moves the slot's kappa (logged); returns the change, if any."""
        st = self.slot_for(batch)
        if st.kappa > 0 and accepted_drafts:
            mean = sum(accepted_drafts) / len(accepted_drafts)
            st.ema_accept_len += self.config.ema_weight * (mean - st.ema_accept_len)
        st.num_steps += 1
        after = st.num_steps - self.config.warmup_steps
        if after <= 0 or after % self.config.decision_every:
            return None
        new = self._decide(st)
        if new == st.kappa:
            return None
        change = KappaChange(st.slot.batch_size, batch, st.kappa, new, st.ema_accept_len)
        log.info("adaptive: kappa %d -> %d (ema_accept_len=%.2f, batch=%d)", st.kappa, new,
                 st.ema_accept_len, batch)
        st.kappa = new
        self.changes.append(change)
        return change

    @staticmethod
    def _decide(st: SlotState) -> int:
        """The slot's next kappa (module doc: down before up, hysteresis; a probe up from 0)."""
        cands = st.slot.candidates
        i = old = cands.index(st.kappa)
        if st.kappa == 0:
            i = min(i + 1, len(cands) - 1)
            if cands[i] > 0 and st.ema_accept_len < 0:
                st.ema_accept_len = float(cands[i] - 1)  # no history yet: start neutral
            return cands[i]
        while i > 0:
            prev = cands[i - 1]
            drop = (0.5 if prev == 0 else prev - 0.5) + st.slot.down_hysteresis
            if st.ema_accept_len > drop:
                break
            i -= 1
        if i == old:
            while i < len(cands) - 1 and \
                    st.ema_accept_len > cands[i] - 0.5 + st.slot.up_hysteresis:
                i += 1
        return cands[i]


__all__ = ["DECISION_EVERY", "DEFAULT_SCHEDULE", "EMA_WEIGHT", "WARMUP_STEPS", "KappaChange",
           "KappaSchedule", "ScheduleConfig", "ScheduleSlot", "load_schedule", "parse_schedule"]
