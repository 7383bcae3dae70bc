"""Token selection and speculative acceptance, in pure numpy.

Contract:
- `SamplingParams` validates temperature / top_p / top_k / seed. temperature == 0 means greedy.
  A value that cannot be honoured exactly raises ValueError; nothing is silently ignored.
- `warp_probs(logits, params)` is THE target distribution: temperature, then top-k, then top-p
  (the order HF and vLLM use). Plain autoregressive sampling and speculative acceptance both go
  through it, so the two modes sample from the same distribution by construction.
- `accept_greedy(drafts, target_argmax)`: longest prefix where draft == target argmax, then the
  target's own token. Returns (num_accepted, next_token).
- `accept_sampled(drafts, target_logits, params, rng)`: exact speculative sampling with the
  drafter's argmax as a one-hot proposal q. Leviathan et al. with q = onehot(d): accept d with
  probability min(1, p(d)/q(d)) = p(d); on rejection sample from norm(max(p - q, 0)), which is p
  with d removed and renormalised; all accepted -> a bonus sample from the last row. Every
  emitted token is therefore distributed exactly as a plain autoregressive sample.
- `PositionRandomness(seed)` and `accept_at_positions(drafts, target_logits, params, randomness,
  first_position)`: what the engine uses. The randomness of the token at absolute position t is
  drawn from (seed, t) alone; every verified row samples the target's own token at its position
  from it, and a draft is accepted iff it equals that sample. With a one-token (argmax or lookup)
  proposal d this accepts with probability p(d) and, on a miss, leaves the sample conditioned on
  != d, which is norm(max(p - onehot(d), 0)): the same exact rejection sampler as accept_sampled.
  Since AR samples position t from the same randomness, a seeded reply is the same token for
  token with AR and with DFlash at any block size, lookup or "auto" (docs/DESIGN.md, Seeds).
- Penalties and logit bias (`presence_penalty`, `frequency_penalty`, `repetition_penalty`,
  `logit_bias`, checked by `logits_processors.check_processing`) change the rows before any of the
  above: the executors hand `accept_at_positions` a `logits_processors.ProcessedRows` instead of
  the raw rows when `processes_logits` is set, so greedy compares drafts to the argmax of the
  processed row and sampling warps the processed row, position by position.
- `logprobs` (None = off; 0..20 = how many alternatives) asks for `token_logprob(row, token, params)`
  of every emitted token: `TokenLogprob(token, logprob, top)`, the log-probability of the token in
  the distribution it was drawn from (greedy: the log-softmax of the processed row; sampled:
  the log of `warp_probs` of it, -inf outside top-k / top-p) and the `logprobs` most likely tokens
  of that distribution (highest first, ties by lower id).
Rows of `target_logits`: row i is the target's prediction for the token after the i-th verified
token, so row i scores draft i (0-based) and row len(drafts) scores the bonus. Anything that gives
row i as `target_logits[i]` will do (a `ProcessedRows`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .logits_processors import check_processing, processes_logits

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0        # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0            # keep the k most likely tokens; 0 = off
    seed: int | None = None   # numpy Generator seed; None = fresh entropy
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple = ()    # a {token id: bias} mapping becomes sorted (id, bias) pairs
    logprobs: int | None = None  # None = off; else how many top alternatives each token carries

    def __post_init__(self):
        t, p, k = self.temperature, self.top_p, self.top_k
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        if self.seed is not None and (not isinstance(self.seed, (int, np.integer)) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        # frozen: the normalised bias goes in through object.__setattr__
        object.__setattr__(self, "logit_bias", check_processing(
            self.presence_penalty, self.frequency_penalty, self.repetition_penalty, self.logit_bias))
        n = self.logprobs
        if n is not None and (isinstance(n, bool) or not isinstance(n, (int, np.integer))
                              or not 0 <= n <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in 0..{MAX_TOP_LOGPROBS}, got {n!r}")

    @property
    def processes_logits(self) -> bool:
        return processes_logits(self)

    @property
    def greedy(self) -> bool:
        # top-k and top-p always keep the argmax, so greedy honours them exactly.
        return self.temperature == 0

    def make_rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)

    def make_randomness(self) -> "PositionRandomness":
        return PositionRandomness(self.seed)


class PositionRandomness:
    """A random stream per absolute token position, from (seed, position) alone."""

    def __init__(self, seed: int | None = None):
        self.seed = int(np.random.SeedSequence().entropy) if seed is None else int(seed)

    def at(self, position: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, int(position)])


def warp_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Target distribution of one logits row [V] after temperature, top-k, top-p (float64)."""
    if params.greedy:
        raise ValueError("warp_probs needs temperature > 0 (greedy uses argmax)")
    x = np.asarray(logits, dtype=np.float64) / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth_largest = np.partition(x, vocab - params.top_k)[vocab - params.top_k]
        x = np.where(x < kth_largest, -np.inf, x)  # ties with the k-th are kept (as HF does)
    x = x - x.max()
    probs = np.exp(x)
    probs /= probs.sum()
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    return probs


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Top-p: keep the smallest most-likely prefix whose mass reaches top_p, renormalised.

    Same result as a full stable sort (ties by lower id first), but sorts only a candidate set:
    the m most likely tokens plus ties, grown until the cut falls inside it (real vocabularies are
    ~50k-150k; a full argsort per row would cost more than a verify pass).
    """
    vocab, m = len(probs), 64
    while True:
        mth_largest = np.partition(probs, vocab - m)[vocab - m] if m < vocab else 0.0
        complete = mth_largest == 0.0  # the candidates are the whole support (zeros never matter)
        # ties with the m-th largest are included, so the set is a prefix of the sorted order
        candidates = np.flatnonzero(probs > 0.0) if complete else np.flatnonzero(probs >= mth_largest)
        order = candidates[np.lexsort((candidates, -probs[candidates]))]
        sorted_probs = probs[order]
        mass_before = np.cumsum(sorted_probs) - sorted_probs
        kept = order[mass_before < top_p]  # a token is kept if the mass before it is < top_p
        if len(kept) < len(order) or complete:
            break
        m *= 4
    out = np.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


def sample_from(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a probability vector: the exponential race argmax_i p_i / E_i, E_i ~ Exp(1)
    drawn per token id (the Gumbel-max trick). Tiny differences in `probs` between kernel paths
    move the winner only at a near-tie of the top scores, not at every boundary of a CDF."""
    race = rng.standard_exponential(len(probs), dtype=np.float32)
    np.maximum(race, np.float32(1e-30), out=race)  # an exact 0 would turn a dead token's 0/0 into NaN
    return int(np.argmax(probs / race))


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Plain autoregressive choice from one logits row."""
    if params.greedy:
        return int(np.argmax(logits))
    return sample_from(warp_probs(logits, params), rng)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


def token_logprob(row: np.ndarray, token: int, params: SamplingParams) -> TokenLogprob:
    """`token`'s log-probability in the distribution it was drawn from, with the top alternatives."""
    if params.greedy:
        x = np.asarray(row, dtype=np.float64)
        shifted = x - x.max()
        logp = shifted - np.log(np.exp(shifted).sum())
    else:
        with np.errstate(divide="ignore"):  # tokens cut by top-k / top-p have log 0 = -inf
            logp = np.log(warp_probs(row, params))
    top = ()
    if params.logprobs:
        k = min(params.logprobs, len(logp))
        candidates = np.argpartition(-logp, k - 1)[:k]
        # ties at the k-th value: take the lower ids, as a stable full sort would
        kth = logp[candidates].min()
        pool = np.flatnonzero(logp >= kth)
        order = pool[np.lexsort((pool, -logp[pool]))][:k]
        top = tuple((int(t), float(logp[t])) for t in order)
    return TokenLogprob(int(token), float(logp[token]), top)


def accept_greedy(drafts: np.ndarray, target_argmax: np.ndarray) -> tuple[int, int]:
    """(a, next_token): drafts[:a] match the target's argmax, next_token = target_argmax[a]."""
    mismatch = np.flatnonzero(np.asarray(drafts) != np.asarray(target_argmax[: len(drafts)]))
    a = int(mismatch[0]) if len(mismatch) else len(drafts)
    return a, int(target_argmax[a])


def accept_sampled(drafts: np.ndarray, target_logits: np.ndarray, params: SamplingParams,
                   rng: np.random.Generator) -> tuple[int, int]:
    """(a, next_token) by exact speculative sampling with a one-hot proposal (see module doc)."""
    for i, d in enumerate(drafts):
        p = warp_probs(target_logits[i], params)  # rows are warped lazily: stop at the first rejection
        if rng.random() < p[d]:
            continue
        p[d] = 0.0  # residual norm(max(p - onehot(d), 0)) = p without d
        return i, sample_from(p / p.sum(), rng)
    return len(drafts), sample_from(warp_probs(target_logits[len(drafts)], params), rng)


def accept(drafts: np.ndarray, target_logits: np.ndarray, params: SamplingParams,
           rng: np.random.Generator) -> tuple[int, int]:
    """Dispatch: greedy prefix match or exact speculative sampling."""
    if params.greedy:
        return accept_greedy(drafts, np.argmax(target_logits[: len(drafts) + 1], axis=-1))
    return accept_sampled(drafts, target_logits, params, rng)


def accept_at_positions(drafts: np.ndarray, target_logits: np.ndarray, params: SamplingParams,
                        randomness: PositionRandomness, first_position: int) -> tuple[int, int]:
    """(a, next_token): row i samples position first_position + i from its own randomness; drafts
    are kept while they equal those samples (greedy: the argmax prefix). See the module doc."""
    if params.greedy and isinstance(target_logits, np.ndarray):
        return accept(drafts, target_logits, params, None)
    for i in range(len(drafts) + 1):  # rows are warped (and processed) lazily: stop at the first miss
        rng = None if params.greedy else randomness.at(first_position + i)
        token = sample_token(target_logits[i], params, rng)
        if i == len(drafts) or token != int(drafts[i]):
            return i, token
    raise AssertionError("unreachable")
