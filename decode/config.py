"""Settings of the verifier (the decode role) and the named constants its policies use."""

from __future__ import annotations

from dataclasses import dataclass, field

from specmesh.decode.kappa_schedule import DEFAULT_SCHEDULE, ScheduleConfig
from specmesh.decode.rules import AUTO as AUTO_VERIFY_RULE
from specmesh.decode.rules import check_rule_settings
from specmesh.engine.hidden_layers import check_seed_state

#: Weight of the newest verify step in a request's accept-length EMA (SGLang's adaptive
#: speculation keeps a similar moving average of accepted drafts).
ACCEPT_LEN_EMA_WEIGHT = 0.5
#: Initial accept-length EMA of a new request: optimistic, so that a request starts with the
#: full kappa and only loses drafts after it has shown that they fail.
INITIAL_ACCEPT_LEN_EMA = 16.0
#: Default for ``num_prediction_tokens``: a prediction draft costs the drafter nothing, so a run
#: that keeps matching may grow to as many as the default ``max_num_speculative_tokens``.
DEFAULT_NUM_PREDICTION_TOKENS = 16
#: Weight of the newest step in the verify-step time EMA that sizes the tail-wait budget.
STEP_TIME_EMA_WEIGHT = 0.2
#: Default for ``max_num_batched_tokens``: large enough that a full batch of ``max_num_seqs``
#: requests with kappa drafts each always fits (the budget only bites when set lower).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
#: ``speculative_policy`` values: how kappa follows the batch and the acceptance.
SPECULATIVE_POLICIES = ("goodput", "schedule", "fixed", "confidence")
#: Hidden-state rows the verifier keeps per request for a re-sync (DraftSync after DraftNeedSync
#: or a drafter change): the latest ones, ending at the last committed token's predecessor.
MAX_SEED_ROWS = 64
# AUTO_VERIFY_RULE: ``verify_rule`` of a deployment that picks no rule (decode/rules.py: each
# request gets the rules that apply by themselves)


@dataclass(frozen=True)
class VerifierConfig:
    """Knobs of the verifier.

    ``num_speculative_tokens`` is kappa, the most drafts verified per request per step (vLLM's
    name; 0 turns speculation off); a request may ask for fewer or more, capped at
    ``max_num_speculative_tokens``. ``max_num_seqs``: requests admitted at once (prefilling or
    running). ``max_num_batched_tokens``: tokens in one verify forward (last committed token
    plus drafts of every request in the batch). ``max_queue_len``: requests waiting for
    admission; one more is refused (HTTP 429 at the gateway). ``tail_wait_fraction`` bounds how
    long a step may wait for a draft tail in flight, as a fraction of the measured step time.
    ``prefill_timeout_s``: a KV transfer not complete by then is cancelled and the request
    fails; a cancel not acknowledged by then frees the blocks. ``drafter_silence_s``: a
    drafter that owes a tail (a DraftSync or VerifyCommit it has not answered) for longer is
    treated as gone for the tail wait: no step waits for its requests until it is heard from
    again. ``drafter_lost_grace_s``: a drafter whose connection dropped (closed, reset, the
    transport's heartbeat timed out) and that has not come back within this long is lost: its
    requests are re-opened on another drafter (or run as plain decode) at once, not when the
    health check deregisters it; they go back to it when it is back. ``adaptive_drafts``: cap each request's drafts at one more than its recent mean
    accept length (never changes the output, only the cost). ``goodput_drafts``: cap each step's
    drafts where expected committed tokens per second of verify forward peak, from each
    request's measured acceptance and the forward's measured cost per token count
    (decode/goodput.py, SmartSpec arXiv 2406.14066; 0 drafts when verifying them costs more
    than they bring; the cluster turns it on, off here so a bare worker verifies every draft
    it is given). ``speculation_gate``: with the goodput caps, turn drafting off where it
    measures slower (decode/speculation_gate.py; the command line's ``--speculation-gate on``;
    off by default until the adaptive sweep has measured it, and a test's acceptance must not
    depend on its machine's timing). ``draft_method`` is told to the
    prefill worker so that it ships the right seed state. ``seed_state``: the seed state that
    method needs (``""`` none, ``"hidden"`` the target's final hidden states, which the verify
    forward then returns and DraftSync / VerifyCommit carry; the cluster fills it from the
    drafter's registry, decode/ may not import drafter/). ``incarnation`` is this process's
    (a ``time.time_ns()`` stamp, as in Hello): transfer ids are ``incarnation + 1, + 2, ...``,
    so a restarted verifier's ids never collide with its previous life's
    (docs/architecture.md, 'KV transfer').
    ``verify_rule``: ``"auto"`` or a rule the deployment picks (decode/rules.py, the registry
    that lists them and chooses each request's rule: ``"block"``, block verification of
    unseeded sampled requests; ``"synthetic"``, the ablation harness of decode/synthetic.py,
    which accepts every request's drafts along ``synthetic_acceptance``, a per-position
    acceptance curve required with that rule and refused without it); checked by the
    registry. ``max_tree_nodes``: most draft-tree nodes verified per request per step (tree
    verification; 0: twice the request's kappa); the tree's depth is capped by kappa like a
    chain.
    ``num_prediction_tokens``: most drafts verified per request per step while the drafts at
    the head of its tail were copied from its prediction (OpenAI Predicted Outputs): a run of
    prediction drafts from the last committed token is verified up to the request's
    prediction width, which starts at kappa, doubles after each run accepted whole up to this
    many and falls back to kappa after a rejected prediction draft, whatever
    ``adaptive_drafts`` and ``goodput_drafts`` allow its method's drafts (a prediction draft
    costs no forward, so a method's accept history says nothing about it); at most kappa:
    prediction drafts get kappa like any other (decode/scheduler.py,
    Scheduler.prediction_drafts).
    ``speculative_policy``: how many drafts a step verifies, within kappa: ``"goodput"``
    (the default, the caps ``adaptive_drafts`` and ``goodput_drafts`` turn on), ``"schedule"``
    (SGLang's adaptive schedule, decode/kappa_schedule.py: one kappa per step from the running
    batch's slot and an EMA of accepted drafts; a request that sets no kappa of its own gets
    the schedule's largest candidate, so the step's kappa is what caps it; the two caps off),
    ``"fixed"`` (every usable draft up to kappa; the two caps off) or ``"confidence"`` (the
    confidence budget, decode/confidence_budget.py: a global top-k over (request, position)
    slots scored by the running product of each draft's confidence, k chosen on the profiled
    verify cost table; without a table, warned, the goodput caps).
    ``speculative_schedule``: the schedule's slots (None: the chapter's default,
    :data:`decode.kappa_schedule.DEFAULT_SCHEDULE`); with ``"schedule"`` only.
    ``max_prefill_pause_s``: where a prefill worker shares this verifier's CPU cores, the
    verifier pauses its verify steps while a prefill it waits on is in flight, for windows of
    at most this long with one verify step between them, so the prompt runs on every core
    (decode/prefill_pause.py); 0: never pauses (a prompt is then run on every core only when
    the verifier has nothing else to do).

    Raises:
        ValueError: a setting out of range.
    """

    instance_id: str = "verifier-0"
    incarnation: int = 0
    num_speculative_tokens: int = 4
    max_num_speculative_tokens: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_queue_len: int = 256
    max_model_len: int = 2048
    tail_wait_fraction: float = 0.25
    prefill_timeout_s: float = 120.0
    drafter_silence_s: float = 1.0
    drafter_lost_grace_s: float = 2.0
    draft_method: str = "ngram"
    seed_state: str = ""
    eos_token_ids: tuple[int, ...] = ()
    adaptive_drafts: bool = True
    goodput_drafts: bool = False
    speculation_gate: bool = False
    verify_rule: str = AUTO_VERIFY_RULE
    synthetic_acceptance: tuple[float, ...] = ()
    max_tree_nodes: int = 0
    num_prediction_tokens: int = DEFAULT_NUM_PREDICTION_TOKENS
    max_prefill_pause_s: float = 1.0
    speculative_policy: str = "goodput"
    speculative_schedule: ScheduleConfig | None = None
    #: the goodput policy's profiled verify cost (decode/cost_table.py): ``""`` none (the
    #: online per-token-count EMA only), ``"auto"`` measured at the verifier's start (cached
    #: per model, dtype, KV-cache dtype and CPU), or the file it was read from, its table in
    #: ``verify_cost_table_data`` (read where the command runs)
    verify_cost_table: str = ""
    verify_cost_table_data: dict | None = field(default=None, hash=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.num_speculative_tokens <= self.max_num_speculative_tokens:
            raise ValueError(f"num_speculative_tokens must be in "
                             f"[0, {self.max_num_speculative_tokens}], got "
                             f"{self.num_speculative_tokens}")
        if self.max_num_seqs < 1 or self.max_queue_len < 0:
            raise ValueError("max_num_seqs must be >= 1 and max_queue_len >= 0")
        if self.max_num_batched_tokens < 1 + self.max_num_speculative_tokens:
            raise ValueError(f"max_num_batched_tokens must be >= {1 + self.max_num_speculative_tokens}"
                             " (one request with its full kappa)")
        check_seed_state(self.seed_state)
        if self.verify_rule != AUTO_VERIFY_RULE or self.synthetic_acceptance:
            # the registry checks a picked rule and the rules' own settings (it loads the
            # rules, and torch, so a default config does not)
            check_rule_settings(self)
        if self.tail_wait_fraction < 0:
            raise ValueError("tail_wait_fraction must be >= 0")
        if self.max_tree_nodes < 0:
            raise ValueError("max_tree_nodes must be >= 0")
        if self.num_prediction_tokens < 0:
            raise ValueError(f"num_prediction_tokens must be >= 0 (0: kappa), got "
                             f"{self.num_prediction_tokens}")
        if not self.max_prefill_pause_s >= 0:
            raise ValueError(f"max_prefill_pause_s must be >= 0 (0: never pause), got "
                             f"{self.max_prefill_pause_s}")
        self._check_policy()
        if self.verify_cost_table not in ("", "auto") and self.verify_cost_table_data is None:
            raise ValueError(f"verify_cost_table {self.verify_cost_table!r}: a file's table "
                             f"goes in verify_cost_table_data")

    def _check_policy(self) -> None:
        """``speculative_policy`` is known; a schedule goes with the schedule policy and its
        candidates stay within ``max_num_speculative_tokens``."""
        if self.speculative_policy not in SPECULATIVE_POLICIES:
            raise ValueError(f"speculative_policy must be one of "
                             f"{', '.join(SPECULATIVE_POLICIES)}, got {self.speculative_policy!r}")
        if self.speculative_policy != "schedule":
            if self.speculative_schedule is not None:
                raise ValueError(f"a speculative schedule is used by speculative_policy "
                                 f"'schedule' only, not {self.speculative_policy!r}")
            return
        if self.schedule.max_kappa > self.max_num_speculative_tokens:
            raise ValueError(f"the speculative schedule's largest kappa "
                             f"{self.schedule.max_kappa} exceeds "
                             f"max_num_speculative_tokens {self.max_num_speculative_tokens}")

    @property
    def schedule(self) -> ScheduleConfig:
        """The schedule of the schedule policy: ``speculative_schedule`` or the default."""
        return self.speculative_schedule or DEFAULT_SCHEDULE

    @property
    def widest_kappa(self) -> int:
        """The most drafts a request that sets no kappa of its own may verify in a step:
        kappa, or under the schedule policy (and kappa > 0) the schedule's largest candidate
        (the drafter's run-ahead is sized from it)."""
        if self.speculative_policy == "schedule" and self.num_speculative_tokens > 0:
            return self.schedule.max_kappa
        return self.num_speculative_tokens

    @property
    def accept_len_caps(self) -> bool:
        """Whether each request's drafts are capped by its accept-length EMA
        (``adaptive_drafts`` under the goodput policy)."""
        return self.adaptive_drafts and self.speculative_policy == "goodput"

    @property
    def uses_cost_table(self) -> bool:
        """Whether the policy decides on the profiled verify cost table (decode/cost_table.py):
        the goodput caps, or the confidence budget."""
        return self.goodput_caps or self.speculative_policy == "confidence"

    @property
    def goodput_caps(self) -> bool:
        """Whether each step's drafts are capped for goodput (``goodput_drafts`` under the
        goodput policy, decode/goodput.py)."""
        return self.goodput_drafts and self.speculative_policy == "goodput"

    @property
    def gates_speculation(self) -> bool:
        """Whether drafting is turned on and off on measured throughput
        (``speculation_gate`` with the goodput caps, decode/speculation_gate.py)."""
        return self.speculation_gate and self.goodput_caps
