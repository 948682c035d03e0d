"""Per-request state on the verifier and the commit rule (cut at EOS, stop token, max_tokens)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import msgspec

from specmesh.decode.config import INITIAL_ACCEPT_LEN_EMA
from specmesh.decode.draft_confidence import TokenScores
from specmesh.decode.acceptance import Acceptance
from specmesh.decode.prediction_usage import PredictionUsage
from specmesh.decode.tail_buffer import TailBuffer
from specmesh.protocol.enums import FinishReason
from specmesh.protocol.messages import SamplingParams, TokenLogprobs
from specmesh.protocol.spec_stats import SpecStats


def sampling_with_eos(sampling: SamplingParams, eos_token_ids: frozenset[int]
                      ) -> SamplingParams:
    """``sampling`` with the verifier's EOS ids in ``eos_token_ids`` when ``min_tokens`` must
    keep them away (protocol.messages.SamplingParams: the prefill worker and the drafter mask
    what the verifier would stop at); unchanged otherwise."""
    if not sampling.min_tokens or sampling.ignore_eos or not eos_token_ids:
        return sampling
    ids = sorted(set(sampling.eos_token_ids) | set(eos_token_ids))
    return msgspec.structs.replace(sampling, eos_token_ids=ids)


class RequestStatus(enum.Enum):
    """Life of a request on the verifier: WAITING -> PREFILLING -> RUNNING -> FINISHED, or
    PREFILLING -> CANCELLING (aborted mid-transfer; blocks wait for the cancel ack)."""

    WAITING = "waiting"  # queued for KV room
    PREFILLING = "prefilling"  # PrefillRequest sent, KV arriving
    CANCELLING = "cancelling"  # aborted during transfer, waiting for the cancel ack
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One request on the verifier. Output positions count from the first output token.

    ``num_speculative_tokens`` is this request's kappa; ``spec`` counts the drafts verified for
    it, only up to the end of the output; ``spec_steps`` keeps, per verify step that carried
    drafts, ``(first output position it committed, tokens committed, drafts, accepted)`` so the
    stats can be cut where a stop string found later by the gateway ended the output
    (:meth:`cut_output`). ``block_table`` holds its KV blocks in position order;
    ``num_reserved_blocks`` the blocks promised at admission (allocated lazily out of that
    promise). ``prediction_token_ids``: the client's prediction (OpenAI Predicted Outputs),
    sent on with every DraftSync; ``prediction`` counts its drafts accepted and rejected
    (decode/prediction_usage.py). ``grammar``: the matcher of a request with structured
    output, at its committed tokens (decode/grammar.py).
    """

    request_id: str
    gateway: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    num_speculative_tokens: int
    status: RequestStatus = RequestStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_reserved_blocks: int = 0
    transfer_id: int | None = None
    prefill_peer: str | None = None
    prefill_retries: int = 0  # transfers re-issued on another prefill worker
    prefill_paused: bool = False  # its PrefillRequest said the verifier computes nothing meanwhile
    prefill_alone: bool = False  # no other prompt of this verifier was on its prefill worker
    output_token_ids: list[int] = field(default_factory=list)  # committed output
    num_streamed: int = 0  # output tokens already sent to the gateway
    tail: TailBuffer = field(default_factory=TailBuffer)
    drafter: str | None = None
    lost_drafter: str | None = None  # a drafter we could not reach: re-synced when it is back
    num_draft_syncs: int = 0  # DraftSyncs sent for it (open, re-opens after a drafter change)
    spec_enabled: bool = True  # False once quarantined
    tail_in_flight: bool = False  # the drafter got news it has not answered yet
    #: the committed length its drafter last heard of while the speculation gate holds its
    #: commits back (None: none held; decode/draft_link.py, DraftLink.notify_commit)
    commits_held_from: int | None = None
    drafter_told_paused: bool = False  # the last VerifyCommit said drafting_paused
    seed_window: object | None = None  # decode.seed_state.SeedWindow (draft seed state)
    #: the prefill's DraftSeed (PrefillDone.draft_seed), until its first DraftSync sends it
    draft_seed: object | None = None
    finish_reason: FinishReason | None = None
    error: str = ""
    spec: SpecStats = field(default_factory=SpecStats)
    spec_steps: list[tuple[int, int, int, int]] = field(default_factory=list)
    accept_len_ema: float = INITIAL_ACCEPT_LEN_EMA
    acceptance: Acceptance = field(default_factory=Acceptance)  # decode/goodput.py
    #: DraftTailStream.draft_confidences / draft_token_probs by output position
    #: (decode/draft_confidence.py)
    head_confidences: TokenScores = field(default_factory=TokenScores)
    draft_token_probs: TokenScores = field(default_factory=TokenScores)
    #: most prediction drafts its next step verifies (0: not set yet, its kappa);
    #: Scheduler.prediction_drafts / observe_accept
    prediction_width: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    admitted_time: float | None = None  # its first PrefillRequest left
    first_token_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens its prefill took from the prefix cache
    prediction_token_ids: list[int] | None = None
    prediction: PredictionUsage = field(default_factory=PredictionUsage)
    #: logprobs (a request with SamplingParams.logprobs / prompt_logprobs): those of the
    #: committed output not streamed yet, one part per commit, and the prompt's (from the
    #: prefill role, sent with the first TokenStream)
    unstreamed_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: TokenLogprobs | None = None

    def add_logprobs(self, logprobs: TokenLogprobs | None, num_committed: int) -> None:
        """Keep the logprobs of the ``num_committed`` tokens just committed (the first ones of
        ``logprobs``, which may cover tokens cut at EOS / max_tokens); a request that did not
        ask keeps none."""
        if self.sampling.logprobs is not None and logprobs is not None and num_committed:
            self.unstreamed_logprobs.append(logprobs.slice(0, num_committed))

    def take_logprobs(self, num_tokens: int) -> TokenLogprobs | None:
        """The logprobs of the ``num_tokens`` committed tokens not streamed yet (None when the
        request did not ask, or when they do not cover exactly those tokens)."""
        if self.sampling.logprobs is None:
            return None
        parts, self.unstreamed_logprobs = self.unstreamed_logprobs, []
        out = TokenLogprobs.concat(parts)
        return out if len(out.token_logprobs) == num_tokens else None
    #: the ``n`` choices of one prompt (decode/siblings.py): its group, the group's size (a
    #: leader's), the leader it waits to be forked from, a leader's waiting siblings and those
    #: its current prefill samples first tokens for
    group: str = ""
    group_size: int = 1
    leader: Request | None = field(default=None, repr=False)
    followers: list[Request] = field(default_factory=list, repr=False)
    fork_targets: list[Request] = field(default_factory=list, repr=False)
    #: structured output: its matcher (engine.grammar.RequestGrammar), a Future of it while
    #: it compiles, None when unconstrained (decode/grammar.py)
    grammar: object | None = None
    #: the LoRA adapter it runs with (GenerateRequest.lora_name; "" the base model)
    lora_name: str = ""

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def committed_len(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_remaining(self) -> int:
        return self.sampling.max_tokens - self.committed_len

    @property
    def kv_len(self) -> int:
        """Positions whose KV is in the cache: prompt + all committed output but the last."""
        return self.prompt_len + self.committed_len - 1

    def commit(self, token_ids: list[int], eos_token_ids: frozenset[int]) -> list[int]:
        """Append ``token_ids`` up to and including the first EOS / stop token, and never past
        ``max_tokens``; sets ``finish_reason``. Returns the tokens actually committed."""
        stops = set(self.sampling.stop_token_ids)
        if not self.sampling.ignore_eos:
            stops |= eos_token_ids
        out: list[int] = []
        for tok in token_ids:
            if self.committed_len >= self.sampling.max_tokens:
                break
            self.output_token_ids.append(tok)
            out.append(tok)
            if tok in stops:
                self.finish_reason = FinishReason.STOP
                return out
        if self.committed_len >= self.sampling.max_tokens:
            self.finish_reason = FinishReason.LENGTH
        return out

    def observe_spec(self, start: int, num_committed: int, num_draft_tokens: int,
                     accept_len: int) -> tuple[int, int]:
        """Record a verify step that carried ``num_draft_tokens`` drafts, accepted
        ``accept_len`` and committed ``num_committed`` tokens from output position ``start``.
        When the output ended in this step (``finish_reason`` set by :meth:`commit`) drafts
        past the cut are not counted. Returns the ``(drafts, accepted)`` counted."""
        if self.finish_reason is not None:
            num_draft_tokens, accept_len = SpecStats.cut_step(num_draft_tokens, accept_len,
                                                              num_committed)
        if num_draft_tokens > 0:
            self.spec.observe(num_draft_tokens, accept_len)
            self.spec_steps.append((start, num_committed, num_draft_tokens, accept_len))
        return num_draft_tokens, accept_len

    def cut_output(self, num_output_tokens: int) -> None:
        """The output ended after its first ``num_output_tokens`` tokens (a stop string the
        gateway found): spec stats and prediction counts count only drafts up to there. No-op
        when nothing past that was committed."""
        if num_output_tokens >= self.committed_len:
            return
        self.prediction.cut(num_output_tokens)
        steps: list[tuple[int, int, int, int]] = []
        spec = SpecStats()
        for start, n, d, a in self.spec_steps:
            if start >= num_output_tokens:
                break
            if start + n > num_output_tokens:
                n = num_output_tokens - start
                d, a = SpecStats.cut_step(d, a, n)
            if d > 0:
                steps.append((start, n, d, a))
                spec.observe(d, a)
        self.spec_steps, self.spec = steps, spec
