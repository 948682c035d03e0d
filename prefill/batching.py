"""Which waiting prompts the prefill worker runs together in one forward.

A forward over several whole prompts computes each exactly as it would alone (engine/runner.py,
``ModelRunner.prefill_batch``), so batching is a question of time only. Its cost model is
linear: a forward over ``N`` prompt tokens takes ``T(N) = overhead_s + N * token_s``. Running
the next waiting prompt (``n`` tokens) in the batch already holding ``m`` prompts delays those
``m`` by ``n * token_s``; it spares that prompt and every prompt queued after it one forward's
fixed cost. So, over the ``k`` prompts waiting, it joins the batch when::

    m * n * token_s < (k - m) * overhead_s

which batches short prompts and deep queues and leaves a few long prompts one forward each,
where batching would only make the first ones wait for the others (a CPU's forward cost grows
linearly with tokens from a few tokens on, docs/benchmarks.md, 'Time to first token'; a GPU's
barely grows, so there it batches until the token budget). The objective is the sum of the
waiting prompts' times to first token, the quantity shortest-job-first scheduling minimises
for single jobs.

``T(N)`` is fit by least squares over exponentially decayed sums of the forwards measured;
until :data:`MIN_OBSERVATIONS` forwards of at least two sizes have been seen the fit is unknown and a batch takes at most two
prompts (:data:`EXPLORE_PROMPTS`): a second size to fit, at the cost of one prompt waiting for
one other once. Prompts of one size each then run one per forward unless batching pays;
without the fit they would run in batches up to the token budget, which on a CPU makes a wave
of simultaneous prompts wait for the whole wave (measured: docs/benchmarks.md).
"""

from __future__ import annotations

#: Weight of the past per observation in the decayed least-squares sums of :class:`PrefillCost`.
COST_DECAY = 0.9
#: Relative spread of the sizes measured below which the fit is unknown (one size only).
MIN_RELATIVE_SPREAD = 1e-6
#: Forwards measured before the fit is used (two points of a noisy host decide little).
MIN_OBSERVATIONS = 4
#: Most prompts in a batch while the cost fit is unknown (one more forward size to measure).
EXPLORE_PROMPTS = 2


class PrefillCost:
    """A prefill forward's seconds as ``overhead_s + num_tokens * token_s``, fit by weighted least
    squares (weights ``COST_DECAY ** age``) over the forwards measured."""

    def __init__(self, decay: float = COST_DECAY) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.num_observations = 0
        self._w = self._n = self._t = self._nn = self._nt = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One forward over ``num_tokens`` prompt tokens took ``seconds``."""
        d = self.decay
        self.num_observations += 1
        n, t = float(num_tokens), float(seconds)
        self._w = d * self._w + 1.0
        self._n = d * self._n + n
        self._t = d * self._t + t
        self._nn = d * self._nn + n * n
        self._nt = d * self._nt + n * t

    def fit(self) -> tuple[float, float] | None:
        """``(overhead_s, token_s)``, both >= 0, or None while fewer than
        :data:`MIN_OBSERVATIONS` forwards were measured or their sizes are all one."""
        if self.num_observations < MIN_OBSERVATIONS:
            return None
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var = self._nn / self._w - mean_n * mean_n
        if var <= MIN_RELATIVE_SPREAD * max(mean_n * mean_n, 1.0):
            return None
        token_s = max((self._nt / self._w - mean_n * mean_t) / var, 0.0)
        return max(mean_t - token_s * mean_n, 0.0), token_s


def batch_length(sizes: list[int], max_tokens: int,
                 cost: tuple[float, float] | None) -> int:
    """How many of the waiting prompts (``sizes``: their token counts, in queue order) the next
    forward runs: the first always; each next one while the batch stays within ``max_tokens``
    and, with a known ``cost`` ``(overhead_s, token_s)``, while the rule of the module docstring
    says that taking it lowers the waiting prompts' total time to first token (with ``cost``
    None: up to :data:`EXPLORE_PROMPTS`). The batch is a prefix of the queue (prompts keep
    their order).

    Raises:
        ValueError: ``max_tokens`` < 1.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not sizes:
        return 0
    total, k = sizes[0], len(sizes)
    m = 1
    while m < k:
        n = sizes[m]
        if total + n > max_tokens:
            break
        if cost is None:
            if m >= EXPLORE_PROMPTS:
                break
        else:
            overhead_s, token_s = cost
            if not m * n * token_s < (k - m) * overhead_s:
                break
        total += n
        m += 1
    return m
