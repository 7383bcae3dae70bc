"""Automatic block size: per round, how many drafts to verify (0 = a plain autoregressive step).

Contract:
- `BlockPolicy(step_cost_s, draft_cost_s, switch_cost_s=0)`: `step_cost_s[k]` is the measured
  seconds of a target verify of k+1 tokens (k drafts plus the last token; k = 0 is one AR step)
  in steady state (the same k as the round before), `draft_cost_s[k]` the seconds of a drafter
  call proposing k drafts (`draft_cost_s[0]` is 0: an AR step does not call the drafter); both
  have length `max_drafts + 1`. `switch_cost_s` is what a round costs on top of that when its k
  differs from the previous round's: the target's next call has a new input shape [1, k+1],
  which costs the CPU plugin ~8 ms (SmolLM2, 2 cores: an AR step 27 ms when repeated, 35 ms
  right after a 2-token verify), and a round after AR steps also has the drafter catch up on
  their context.
- `begin_sequence()`: a new generation starts (after its prefill every k is a new shape).
- `choose(max_drafts)` returns k in 0..min(max_drafts, self.max_drafts) that maximizes the
  expected tokens per second E[accepted + 1](k) / cost(k), with cost(k) = draft_cost_s[k] +
  step_cost_s[k], plus switch_cost_s / `switch_horizon` when k is not the previous round's
  (a switch pays once for the rounds the new choice is expected to last), and
  E[accepted + 1](k) = 1 + sum_{j<=k} prod_{i<=j} p_i, p_i the estimated conditional acceptance
  of draft i given drafts 1..i-1 were accepted. Without the switch term "auto" flips between
  k values whose steady rates are close, and pays the switch on every flip.
- `cut(confidence)`: after the drafter proposed n drafts and reported each slot's predicted
  acceptance c_1..c_n (conditional: c_i = P(draft i accepted | drafts 1..i-1 accepted), as DSpark's
  confidence head is trained, so P(drafts 1..i all accepted) = prod_{j<=i} c_j), the k in 1..n
  drafts to verify that maximizes E[accepted + 1](k) / cost(k), the c_i in place of the learned
  p_i for this round, cost(k) the verify part of round_cost_s[k] plus the drafter call already
  paid (`draft_cost_s[n]`) plus the whole `switch_cost_s` when k is not the previous round's (one
  round's choice: nothing amortizes it). At least one draft: whether to draft at all is `choose`'s.
- `ConfidenceCut(threshold)`: the same question for a fixed block size, with no cost curve: verify
  the drafts before the first slot i whose reach prod_{j<=i} c_j is below `threshold` (at least
  one; `DEFAULT_CONFIDENCE_THRESHOLD`; 0 never cuts).
- `observe_round(num_drafted, num_accepted, seconds=None)` (num_drafted = 0: an AR step)
  learns costs in use when timed, at `cost_update_rate`: a round that repeats the previous k
  (each sample clipped to 0.5-2x the estimate so one descheduled call cannot swing it) moves
  that k's steady cost towards the sample, and first scales every k's cost (and the switch
  cost) by (sample / estimate) ** `drift_rate`. The second part is for the machine: a shared
  VM runs the same call 30 % slower for minutes at a time, and without it the cost of the k
  not in use stays at its old level, so a slow phase while drafting looks like "AR is
  cheaper" (and the reverse). A round that switched moves `switch_cost_s` towards its
  excess over the steady cost (clipped to 0..1x that cost). The first round of a sequence
  teaches neither. A round with drafts also updates the p_i: positions 1..a
  accepted, position a+1 rejected (if a < drafted), later positions unseen. Counts decay by
  `decay` per round (the default keeps about the last 20), on top of a Beta prior of
  `prior_strength` pseudo-rounds whose mean is `prior_acceptance` for p_1 and the estimate of
  p_{i-1} for p_i (unseen positions look like the one before them).
- Exploration: after `explore_every` consecutive AR choices, `choose` drafts for
  `probe_rounds` rounds (the best k >= 1), so a policy that fell back to AR keeps its acceptance
  estimates fresh. A probe lasts more than one round because its first round is a switch (a
  new input shape, a drafter catching up on the skipped context): only the rounds after it
  measure the steady cost of drafting, which a one-round probe never corrects (SmolLM2, 2
  cores: a calibration that put a 1-draft round at 47 ms against a real 42 kept "auto" in AR
  for 80 % of its rounds, slower than either fixed choice). Each probe that leaves AR still
  preferred doubles the wait (up to `max_explore_every`), so a drafter that stays bad is
  probed ever more rarely; choosing to draft resets the wait.
- `measure_costs(target, drafter, prompt_ids, max_drafts, measured_drafts=None)` measures the two
  cost curves and the switch cost with real rounds of the engine (so the costs include accept,
  commit and the Python around them) for k = 0..measured_drafts and extends the curves linearly
  to max_drafts, the verify curve's slope at least its mean over k = 0..measured: every input
  shape a compiled model has run keeps CPU-plugin memory (SmolLM2 int8: calibrating k = 0..7 cost
  ~60 MB more than 0..2), and a verify costs about the same per extra token; a longer block is
  then first run only when the policy picks it, and `observe_round` corrects its estimate.
- `BatchDraftPolicy` is the same choice for a batch of sequences sharing one target call (the
  scheduler's block_size "auto"): from the batch's cost curve by total tokens and each sequence's
  acceptance (`DraftAcceptance`, the estimator BlockPolicy uses); `measure_batch_costs` measures
  that curve on the batched runner, each call's tokens spread over the sequences a round has.
Any policy or cut only changes how many tokens are verified, never which are kept: output stays
identical to autoregressive decoding (greedy) or distributed as it (sampling).
Pure python/numpy: no OpenVINO here.
"""
from __future__ import annotations

import bisect
import itertools
import statistics
import time
from typing import Sequence

import numpy as np


class BlockPolicy:
    def __init__(self, step_cost_s: Sequence[float], draft_cost_s: Sequence[float], switch_cost_s: float = 0.0,
                 prior_acceptance: float = 0.5, prior_strength: float = 2.0, decay: float = 0.95,
                 explore_every: int = 16, max_explore_every: int = 128, cost_update_rate: float = 0.1,
                 switch_horizon: float = 8.0, probe_rounds: int = 2, drift_rate: float = 0.3):
        if len(step_cost_s) != len(draft_cost_s) or len(step_cost_s) < 1:
            raise ValueError("step_cost_s and draft_cost_s need one entry per draft count 0..max_drafts")
        if min(step_cost_s) <= 0:
            raise ValueError(f"step costs must be > 0, got {list(step_cost_s)}")
        self.round_cost_s = [float(s) + (float(d) if k else 0.0)
                             for k, (s, d) in enumerate(zip(step_cost_s, draft_cost_s))]
        self.draft_cost_s = [0.0] + [float(d) for d in draft_cost_s[1:]]  # the drafter's part of round_cost_s
        self.max_drafts = len(step_cost_s) - 1
        if switch_cost_s < 0 or switch_horizon <= 0:
            raise ValueError(f"switch_cost_s must be >= 0 and switch_horizon > 0, got {switch_cost_s}, {switch_horizon}")
        self.switch_cost_s = float(switch_cost_s)
        self.switch_horizon = switch_horizon
        self.previous_k: int | None = None  # k of the last round of this sequence (None: none yet)
        self.cost_update_rate = cost_update_rate
        self.explore_every = explore_every
        self.max_explore_every = max_explore_every
        self.explore_wait = explore_every  # AR choices before the next probe
        if probe_rounds < 1 or not 0.0 <= drift_rate <= 1.0:
            raise ValueError(f"probe_rounds must be >= 1 and drift_rate in [0, 1], got {probe_rounds}, {drift_rate}")
        self.probe_rounds = probe_rounds
        self.drift_rate = drift_rate
        self.probe_left = 0  # rounds of the current probe still to run
        self.probe_k = 0
        self.estimate = DraftAcceptance(self.max_drafts, prior_acceptance, prior_strength, decay)
        self.ar_streak = 0

    @property
    def accepted(self) -> list[float]:
        return self.estimate.accepted

    @accepted.setter
    def accepted(self, counts) -> None:
        self.estimate.accepted = list(counts)

    @property
    def seen(self) -> list[float]:
        return self.estimate.seen

    @seen.setter
    def seen(self, counts) -> None:
        self.estimate.seen = list(counts)

    def acceptance(self) -> list[float]:
        return self.estimate.acceptance()

    def begin_sequence(self) -> None:
        self.previous_k = None

    def round_cost(self, k: int) -> float:
        """Expected seconds of a round with k drafts, coming from the previous round's k."""
        switching = self.previous_k is not None and k != self.previous_k
        return self.round_cost_s[k] + (self.switch_cost_s / self.switch_horizon if switching else 0.0)

    def expected_tokens_per_s(self, max_drafts: int | None = None) -> list[float]:
        """E[accepted + 1](k) / round_cost(k) for k = 0..max_drafts."""
        limit = self.max_drafts if max_drafts is None else min(max_drafts, self.max_drafts)
        rates, expected, reach = [], 1.0, 1.0
        p = self.acceptance()
        for k in range(limit + 1):
            if k:
                reach *= p[k - 1]      # P(drafts 1..k all accepted)
                expected += reach
            rates.append(expected / self.round_cost(k))
        return rates

    def choose(self, max_drafts: int) -> int:
        rates = self.expected_tokens_per_s(max_drafts)
        best = int(np.argmax(rates))
        if best:  # drafting pays; once it stops paying, probe soon
            self.ar_streak, self.explore_wait, self.probe_left = 0, self.explore_every, 0
            return best
        if len(rates) == 1:
            return 0
        if self.probe_left:  # finish the probe: its later rounds measure the steady cost
            self.probe_left -= 1
            return min(self.probe_k, len(rates) - 1)
        self.ar_streak += 1
        if self.ar_streak <= self.explore_wait:
            return 0
        # probe: without drafting the p_i never change; back off while probes keep failing
        self.ar_streak, self.explore_wait = 0, min(2 * self.explore_wait, self.max_explore_every)
        self.probe_k, self.probe_left = 1 + int(np.argmax(rates[1:])), self.probe_rounds - 1
        return self.probe_k

    def cut(self, confidence: Sequence[float]) -> int:
        """Drafts to verify of a proposal with these per-slot predicted acceptances (module contract)."""
        reach = np.cumprod(np.clip(np.asarray(confidence, dtype=np.float64)[: self.max_drafts], 0.0, 1.0))
        n = len(reach)
        if n <= 1:
            return n
        paid = self.draft_cost_s[n]  # the drafter ran for n drafts whatever is verified
        costs = np.array([self.round_cost_s[k] - self.draft_cost_s[k] + paid
                          + (self.switch_cost_s if self.previous_k is not None and k != self.previous_k else 0.0)
                          for k in range(1, n + 1)])
        return 1 + int(np.argmax((1.0 + np.cumsum(reach)) / costs))

    def observe_round(self, num_drafted: int, num_accepted: int, seconds: float | None = None) -> None:
        if seconds is not None and self.previous_k is not None:
            estimate = self.round_cost_s[num_drafted]
            if num_drafted == self.previous_k:
                sample = min(max(seconds, 0.5 * estimate), 2.0 * estimate)
                drift = (sample / estimate) ** self.drift_rate   # the whole machine got slower or faster
                self.round_cost_s = [c * drift for c in self.round_cost_s]
                self.draft_cost_s = [c * drift for c in self.draft_cost_s]
                self.switch_cost_s *= drift
                estimate = self.round_cost_s[num_drafted]
                self.round_cost_s[num_drafted] = estimate + self.cost_update_rate * (sample - estimate)
            else:
                excess = min(max(seconds - estimate, 0.0), estimate)
                self.switch_cost_s += self.cost_update_rate * (excess - self.switch_cost_s)
        self.previous_k = num_drafted
        self.estimate.observe(num_drafted, num_accepted)


# a slot pays when its reach exceeds about E(k) * (one more verified row) / cost(k): 0.15-0.3 on SmolLM2's curve
DEFAULT_CONFIDENCE_THRESHOLD = 0.2


class ConfidenceCut:
    """A fixed block's cut: the drafts before the first slot whose predicted reach is below `threshold`."""

    def __init__(self, threshold: float = DEFAULT_CONFIDENCE_THRESHOLD):
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"confidence_threshold must be a number in [0, 1], got {threshold!r}")
        self.threshold = float(threshold)

    def cut(self, confidence: Sequence[float]) -> int:
        reach = np.cumprod(np.clip(np.asarray(confidence, dtype=np.float64), 0.0, 1.0))
        below = np.flatnonzero(reach < self.threshold)
        return len(reach) if not len(below) else max(1, int(below[0]))


class DraftAcceptance:
    """Per-position acceptance of one drafter on one stream of rounds (decayed counts + Beta prior)."""

    def __init__(self, max_drafts: int, prior_acceptance: float = 0.5, prior_strength: float = 2.0,
                 decay: float = 0.95):
        self.max_drafts = max_drafts
        self.prior_acceptance = prior_acceptance
        self.prior_strength = prior_strength
        self.decay = decay
        self.accepted = [0.0] * max_drafts  # decayed counts per draft position (1-based i -> [i-1])
        self.seen = [0.0] * max_drafts

    def acceptance(self) -> list[float]:
        """Estimated conditional acceptance p_i of draft i, i = 1..max_drafts. The prior mean of
        p_i is p_{i-1} (of p_1: `prior_acceptance`), so rarely verified late positions look like
        the last well-observed one: a good drafter gets its longer blocks tried, and verified."""
        estimates, prior = [], self.prior_acceptance
        for a, n in zip(self.accepted, self.seen):
            prior = (a + self.prior_strength * prior) / (n + self.prior_strength)
            estimates.append(prior)
        return estimates

    def expected_tokens(self) -> list[float]:
        """E[accepted + 1](k) for k = 0..max_drafts (plain floats: the batch policy asks every round)."""
        expected, reach = [1.0], 1.0
        for p in self.acceptance():
            reach *= p
            expected.append(expected[-1] + reach)
        return expected

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Positions 1..a accepted, a+1 rejected (if a < drafted), later ones unseen; 0 drafts: nothing."""
        if num_drafted == 0:
            return
        self.accepted = [a * self.decay for a in self.accepted]
        self.seen = [n * self.decay for n in self.seen]
        for i in range(min(num_accepted + 1, num_drafted, self.max_drafts)):
            self.seen[i] += 1.0
            self.accepted[i] += 1.0 if i < num_accepted else 0.0


def nondecreasing(values: Sequence[float]) -> list[float]:
    """The least-squares nondecreasing fit of `values` (pool adjacent violators): verifying more
    tokens never costs less, so a dip in a noisy measured curve is noise."""
    pools: list[list[float]] = []  # [mean, count]
    for value in values:
        pools.append([float(value), 1])
        while len(pools) > 1 and pools[-2][0] > pools[-1][0]:
            (mean2, n2), (mean1, n1) = pools.pop(), pools.pop()
            pools.append([(mean1 * n1 + mean2 * n2) / (n1 + n2), n1 + n2])
    return [mean for mean, n in pools for _ in range(int(n))]


def measure_costs(target, drafter, prompt_ids: Sequence[int], max_drafts: int,
                  repetitions: int = 3, measured_drafts: int | None = None) -> tuple[list[float], list[float], float]:
    """(step_cost_s, draft_cost_s, switch_cost_s): the first two for k = 0..max_drafts, medians
    over `repetitions` of greedy engine rounds with k drafts (k = 0: an AR step), each curve made
    nondecreasing in k; only k <= measured_drafts (None: all) are run, the rest continue the
    measured slope (extend_linearly). The k are interleaved in a rotating order, so machine noise
    hits every k alike, and each k runs twice in a row: the second pass is the steady cost, and
    the first pass, which follows another k (a new input shape), gives the switch cost as the
    median excess of first over second passes. Resets both runners."""
    from . import sequence
    from .sampling import SamplingParams, sample_token
    from .stats import GenerationStats

    params = SamplingParams()  # greedy: no randomness is drawn
    randomness = params.make_randomness()
    target.reset()
    drafter.reset()
    prompt = np.asarray(prompt_ids, dtype=np.int64)
    logits, feats = target.forward(prompt, all_logits=False)
    target.commit(len(prompt))
    last, ctx_feats = sample_token(logits[-1], params, None), np.array(feats)
    measured = max_drafts if measured_drafts is None else max(1, min(measured_drafts, max_drafts))
    steps, drafts = [[] for _ in range(measured + 1)], [[] for _ in range(measured + 1)]
    switch_excess = []
    ks = list(range(measured + 1))
    for rep in range(repetitions):
        for k in ks[rep % len(ks):] + ks[: rep % len(ks)]:
            if target.committed + 2 * (k + 1) >= target.max_length:
                break  # out of context: keep what was measured
            passes = []
            for _ in range(2):  # after another k, then steady (see above)
                stats = GenerationStats()
                if k == 0:
                    t0 = time.perf_counter()
                    last, ctx_feats = sequence.autoregressive_step(target, True, last, ctx_feats, params, randomness)
                    stats.verify_s = time.perf_counter() - t0
                else:
                    _, last, ctx_feats = sequence.speculative_round(target, drafter, last, ctx_feats, k + 1,
                                                                  params, randomness, stats)
                passes.append(stats.verify_s + stats.draft_s)
            if rep or k != ks[0]:  # the very first pass follows the prefill, not another k
                switch_excess.append(passes[0] - passes[1])
            steps[k].append(stats.verify_s)
            drafts[k].append(stats.draft_s)
    target.reset()
    drafter.reset()
    if not all(steps):
        raise ValueError("the calibration prompt leaves no room in the context for one pass")
    step = nondecreasing([statistics.median(s) for s in steps])
    draft = [0.0] + nondecreasing([statistics.median(d) for d in drafts[1:]])
    switch = max(statistics.median(switch_excess), 0.0) if switch_excess else 0.0
    # Verifying one more token never costs nothing, but with paged attention 2-4 tokens can cost
    # the same, and a flat extension made k = 7 look as cheap as k = 1 ("auto" then opened every
    # sequence with 8-token blocks). The slope is at least the measured mean cost of a verified token.
    verify_slope = (step[-1] - step[0]) / (len(step) - 1)  # measured >= 1: two points at least
    return extend_linearly(step, max_drafts, verify_slope), extend_linearly(draft, max_drafts), switch


def extend_linearly(curve: list[float], max_drafts: int, min_slope: float = 0.0) -> list[float]:
    """`curve` (k = 0..m) continued to k = max_drafts with its mean slope over k = 1..m (0 if
    m < 2: k = 0 is no draft at all, so from one drafted point there is no slope to trust), and
    at least `min_slope`."""
    m = len(curve) - 1
    step = max((curve[m] - curve[1]) / (m - 1) if m >= 2 else 0.0, min_slope)
    return curve + [curve[-1] + step * j for j in range(1, max_drafts + 2 - len(curve))]


# -- several sequences per target call ------------------------------------------------------------
class BatchDraftPolicy:
    """Load-aware drafting: each batched round, the drafts of every sequence (0 = an AR step).

    `call_tokens` / `call_cost_s`: measured seconds of one batched target call by the tokens it
    carries (all sequences together; interpolated between points, continued past the last one with
    its final slope); `draft_cost_s[k]`: one sequence's drafter call for k drafts (`[0]` is 0).
    `shared_draft_call`: the round's drafter calls are one inference for every sequence (drafter
    rows), so a round that drafts pays draft_cost(max k) once, however many sequences draft; else
    each drafting sequence pays its own call. `choose(states, caps, fixed_tokens, lookup)` picks
    k_i in 0..caps[i] that maximize the batch's expected tokens per second, sum_i E_i[accepted +
    1](k_i) / (call_cost(fixed_tokens + sum_i (k_i + 1)) + drafting(k)), drafting(k) that cost of
    the drafter calls; `lookup[i]` > 0 says sequence i's n-gram lookup offers that many drafts this
    round, so its options are 0..min(caps[i], lookup[i]) lookup drafts, judged by its lookup
    acceptance, with no drafter call (lookup drafts first, as a fixed block takes them). It starts
    from all-AR, the best uniform k (each sequence min(k, cap_i): the curve can step up where the
    runner changes kernels, so no single sequence's draft pays on its own while all of them do) and
    drafts spread to the last call's size (no switch there), and the best uniform k on the curve
    without switches; from each it repeatedly takes the one change that raises that rate most
    (one k_i -> k', or one draft moved from one sequence to another: the same call size, across a
    cliff of the curve), and stops when none does; all-AR stays a choice. A round where not even
    every sequence's best gain in the cheapest round that drafts beats all-AR (`drafting_rate_bound`)
    skips the search: the same choice, for a fraction of the time (most rounds of a full batch). Each
    sequence's acceptance is its own `DraftAcceptance` (`new_sequence()`, `observe(state, drafted,
    accepted, from_lookup)`: the lookup's rounds teach its own estimate), whose prior is the
    first-draft acceptance of every sequence observed so far (`population`, `lookup_population`).
    A sequence held at AR for `explore_every` rounds probes with `probe_drafts` drafts (the wait
    doubles up to `max_explore_every`, reset when drafting is chosen), so its estimate does not
    freeze, but only where drafts accepted at
    `probe_acceptance` each would raise the batch's rate: where the call curve and the drafter's
    cost rule drafting out (a full batch on a compute-bound host), a probe only costs.
    A call whose size differs from the last call's costs `switch_cost_s` more (the plugin's first
    call in a new input shape; docs/BENCHMARKS.md, "Load-aware drafts priced by what a round
    runs"), and a draft that changes the size pays it; a size other than the round's AR size pays
    one more, the way back (a lookup match's round takes it at once), so a batch steady at AR
    drafts only where that pays too; `observe_call` learns it from the calls that switched
    (their excess over the curve, the first one all the way), `saw_call(tokens)` notes a call it
    does not learn from (a prefill). `observe_call(tokens, seconds)` learns the cost
    curve in use, as BlockPolicy.observe_round does (a drift of every cost, draft costs too, then
    the point). `observe_draft(k, seconds)` learns what drafter calls cost in use: the calibration
    times calls with no context to catch up and shapes already met, but a sequence that drafts
    after AR steps first feeds the drafter their context, in an input shape often new to the
    plugin, so real calls cost more (SmolLM2's drafter, 2 cores: 1.4 ms calibrated, 3.8 ms in use
    at c=4); every draft cost moves by one factor towards the sample's ratio to its estimate, at
    first by the running mean of the ratios, then at `cost_update_rate` (with `shared_draft_call`,
    one sample a round: the whole call, for its largest k). `free_tokens(T)`: how many more tokens
    a call of T can carry at (nearly) no cost; the scheduler fills it with n-gram lookup drafts of
    sequences held at AR.
    Output is unchanged by any choice: only how many tokens are verified."""

    def __init__(self, call_tokens: Sequence[int], call_cost_s: Sequence[float], draft_cost_s: Sequence[float],
                 explore_every: int = 16, max_explore_every: int = 128, probe_drafts: int = 2, probe_acceptance: float = 0.9,
                 cost_update_rate: float = 0.1, drift_rate: float = 0.3, prior_acceptance: float = 0.5,
                 prior_strength: float = 2.0, decay: float = 0.95, shared_draft_call: bool = False,
                 switch_cost_s: float = 0.0):
        if len(call_tokens) != len(call_cost_s) or not call_tokens or list(call_tokens) != sorted(set(call_tokens)):
            raise ValueError("call_tokens must be increasing, with one cost each")
        if call_tokens[0] < 1 or min(call_cost_s) <= 0 or len(draft_cost_s) < 1:
            raise ValueError(f"call costs must be > 0 for >= 1 tokens, got {list(call_cost_s)}")
        self.call_tokens = [int(t) for t in call_tokens]
        self.call_cost_s = nondecreasing(call_cost_s)
        self.draft_cost_s = np.array([0.0] + [float(d) for d in draft_cost_s[1:]])
        self.max_drafts = len(draft_cost_s) - 1
        self.explore_every, self.max_explore_every, self.probe_drafts = explore_every, max_explore_every, probe_drafts
        self.probe_acceptance = probe_acceptance
        self.cost_update_rate, self.drift_rate = cost_update_rate, drift_rate
        self.prior = (prior_acceptance, prior_strength, decay)
        self.shared_draft_call = shared_draft_call
        self.switch_cost_s, self.last_tokens, self.num_switch_samples = float(switch_cost_s), None, 0
        self.population = DraftAcceptance(self.max_drafts, prior_acceptance, prior_strength, 0.999)
        self.lookup_population = DraftAcceptance(self.max_drafts, prior_acceptance, prior_strength, 0.999)
        self.num_draft_samples = 0  # drafter calls observed: the first ones move the estimate most
        self.num_searches = 0  # choices that ran the search (the others: all-AR by `drafting_rate_bound`)

    def call_cost(self, num_tokens):
        """Seconds of a steady call of num_tokens (a float for one size, an array for an array)."""
        tokens, costs = self.call_tokens, self.call_cost_s
        slope = (costs[-1] - costs[-2]) / (tokens[-1] - tokens[-2]) if len(tokens) > 1 else costs[0] / tokens[0]
        if np.ndim(num_tokens) == 0:  # one size, every round: plain floats, no arrays
            t = float(num_tokens)
            if t >= tokens[-1]:
                return costs[-1] + slope * (t - tokens[-1])
            j = bisect.bisect_right(tokens, t)
            if j == 0:
                return costs[0]
            return costs[j - 1] + (costs[j] - costs[j - 1]) * (t - tokens[j - 1]) / (tokens[j] - tokens[j - 1])
        num_tokens = np.asarray(num_tokens, dtype=np.float64)
        inside = np.interp(num_tokens, tokens, costs)
        return np.where(num_tokens > tokens[-1], costs[-1] + slope * (num_tokens - tokens[-1]), inside)

    def free_tokens(self, num_tokens: int, home: int | None = None, tolerance: float = 0.03) -> int:
        """How many tokens a call of num_tokens can take on for at most `tolerance` more time (the
        flat, memory-bound stretch of the curve, shape switches counted as in costs_with_switch;
        `home` defaults to num_tokens)."""
        home = num_tokens if home is None else home
        costs = self.costs_with_switch(num_tokens + np.arange(self.max_drafts * 8 + 1), home)
        fits = np.flatnonzero(costs[1:] <= costs[0] * (1 + tolerance))
        return int(fits[-1]) + 1 if len(fits) and fits[0] == 0 else 0

    def costs_with_switch(self, num_tokens: np.ndarray, home: int | None = None) -> np.ndarray:
        """call_cost of each size, plus `switch_cost_s` where it is not the last call's size, and
        once more where it is not `home` (the round's size without drafts, which the batch returns
        to: a lookup match's round switches out and back)."""
        costs = self.call_cost(num_tokens)
        if self.last_tokens is None:
            return costs
        sizes = np.asarray(num_tokens)
        switches = (sizes != self.last_tokens).astype(np.float64) + (0.0 if home is None else sizes != home)
        return costs + switches * self.switch_cost_s

    def new_sequence(self) -> dict:
        _, strength, decay = self.prior  # its priors: the first-draft acceptance of every sequence so far
        estimate = DraftAcceptance(self.max_drafts, self.population.acceptance()[0], strength, decay)
        lookup = DraftAcceptance(self.max_drafts, self.lookup_population.acceptance()[0], strength, decay)
        return {"estimate": estimate, "lookup": lookup, "ar_streak": 0, "explore_wait": self.explore_every}

    def drafting_cost(self, ks: Sequence[int], by_drafter: Sequence[bool], draft_cost_s=None) -> float:
        """Seconds of the round's drafter calls when sequence i verifies ks[i] drafts (`draft_cost_s`:
        `self.draft_cost_s` as a list, for a caller that asks many times)."""
        draft = self.draft_cost_s.tolist() if draft_cost_s is None else draft_cost_s
        costs = [draft[k] for k, d in zip(ks, by_drafter) if d and k]
        return (max(costs) if self.shared_draft_call else sum(costs)) if costs else 0.0

    def choose(self, states: list[dict], caps: Sequence[int], fixed_tokens: int = 0,
               lookup: Sequence[int] | None = None) -> list[int]:
        offers = [0] * len(states) if lookup is None else [max(0, int(n)) for n in lookup]
        caps = [max(0, min(int(c), self.max_drafts, n or self.max_drafts)) for c, n in zip(caps, offers)]
        by_drafter = [not n for n in offers]
        gains = [s["estimate" if d else "lookup"].expected_tokens()[: c + 1]
                 for s, c, d in zip(states, caps, by_drafter)]
        # plain floats and tables: this runs every round, beside a target call of a few ms
        home = fixed_tokens + len(caps)
        sizes = np.arange(home + sum(caps) + 1)
        call = self.costs_with_switch(sizes, home).tolist()
        draft = self.draft_cost_s.tolist()
        shared = self.shared_draft_call

        def drafting(ks):
            return self.drafting_cost(ks, by_drafter, draft)

        def totals(ks):
            return fixed_tokens + len(ks) + sum(ks), sum(g[k] for g, k in zip(gains, ks)), drafting(ks)

        def climb(ks):
            """(rate, ks) after taking the best single change until none raises the rate."""
            tokens, expected, paid = totals(ks)
            while True:
                best_rate, best = expected / (call[tokens] + paid), None
                for i, (k, cap) in enumerate(zip(ks, caps)):
                    # drafting_cost with k_i -> o, from the others' part once per i: this loop is the hot one
                    if not by_drafter[i]:
                        others = None
                    elif shared:
                        others = max([draft[kj] for j, (kj, d) in enumerate(zip(ks, by_drafter)) if d and j != i],
                                     default=0.0)
                    else:
                        others = paid - draft[k]
                    for o in range(cap + 1):
                        if o == k:
                            continue
                        cost = paid if others is None else (max(others, draft[o]) if shared else others + draft[o])
                        rate = (expected + gains[i][o] - gains[i][k]) / (call[tokens + o - k] + cost)
                        if rate > best_rate * (1 + 1e-9):
                            best_rate, best = rate, ((i, o),)
                for i, j in itertools.permutations(range(len(ks)), 2):  # one draft moved: the same call size
                    if ks[i] and ks[j] < caps[j]:
                        moved = list(ks)
                        moved[i], moved[j] = ks[i] - 1, ks[j] + 1
                        gain = gains[i][ks[i] - 1] - gains[i][ks[i]] + gains[j][ks[j] + 1] - gains[j][ks[j]]
                        rate = (expected + gain) / (call[tokens] + drafting(moved))
                        if rate > best_rate * (1 + 1e-9):
                            best_rate, best = rate, ((i, ks[i] - 1), (j, ks[j] + 1))
                if best is None:
                    return best_rate, ks
                for i, k in best:
                    tokens += k - ks[i]
                    expected += gains[i][k] - gains[i][ks[i]]
                    ks[i] = k
                paid = drafting(ks)

        def search():
            """(rate, ks): the best climb from each start (the class contract's starts)."""
            uniform = [[min(k, cap) for cap in caps] for k in range(max(caps, default=0) + 1)]
            uniform_totals = list(map(totals, uniform))
            rates = [expected / (call[tokens] + paid) for tokens, expected, paid in uniform_totals]
            starts = [[0] * len(caps), list(uniform[int(np.argmax(rates))])]
            extra = -1 if self.last_tokens is None else self.last_tokens - home
            if 0 < extra <= sum(caps):  # the last call's size, switch-free: single changes alone rarely land on it
                at_last = [0] * len(caps)
                while extra:
                    for i, cap in enumerate(caps):
                        if extra and at_last[i] < cap:
                            at_last[i], extra = at_last[i] + 1, extra - 1
                starts.append(at_last)
            # switches make every size but one or two dear: the best uniform k on the steady curve starts too
            steady = self.call_cost(sizes).tolist()
            steady_rates = [expected / (steady[tokens] + paid) for tokens, expected, paid in uniform_totals]
            starts.append(uniform[int(np.argmax(steady_rates))])
            unique = {tuple(start): None for start in starts}
            return max((climb(list(start)) for start in unique), key=lambda found: found[0])

        rate, ks = sum(g[0] for g in gains) / call[home], [0] * len(caps)
        if self.drafting_rate_bound(gains, call[home + 1:], draft, caps, by_drafter) > rate:  # else no search
            rate, ks = search()
            self.num_searches += 1
        tokens, expected, _ = totals(ks)
        for i, state in enumerate(states):
            if ks[i]:
                state["ar_streak"], state["explore_wait"] = 0, self.explore_every
            elif caps[i]:
                state["ar_streak"] += 1
                if state["ar_streak"] > state["explore_wait"]:  # probe: an AR-only estimate never changes
                    state["ar_streak"] = 0
                    k = min(caps[i], self.probe_drafts)
                    hopeful = 1 + sum(self.probe_acceptance ** j for j in range(1, k + 1))
                    probe = list(ks)
                    probe[i] = k
                    if (expected - gains[i][0] + hopeful) / (call[tokens + k] + drafting(probe)) <= rate:
                        continue  # not even a drafter this good would pay in this batch: no probe
                    ks[i] = k
                    tokens, expected = tokens + k, expected - gains[i][0] + gains[i][k]
                    state["explore_wait"] = min(2 * state["explore_wait"], self.max_explore_every)
        return ks

    @staticmethod
    def drafting_rate_bound(gains, drafting_calls, draft, caps, by_drafter) -> float:
        """At least the rate of any choice that drafts (`drafting_calls`: the call costs of the sizes
        above the AR size): one that calls the drafter gains at most every sequence's best, in the
        cheapest such round; one that drafts from lookups alone calls no drafter but gains only theirs."""
        cheapest = min(drafting_calls, default=float("inf"))
        bound = sum(g[-1] for g in gains) / (cheapest + min(draft[1:], default=0.0))
        if any(c and not d for c, d in zip(caps, by_drafter)):
            bound = max(bound, sum(g[0] if d else g[-1] for g, d in zip(gains, by_drafter)) / cheapest)
        return bound

    def observe(self, state: dict, num_drafted: int, num_accepted: int, from_lookup: bool = False) -> None:
        state["lookup" if from_lookup else "estimate"].observe(num_drafted, num_accepted)
        (self.lookup_population if from_lookup else self.population).observe(num_drafted, num_accepted)

    def observe_draft(self, num_drafts: int, seconds: float) -> None:
        if not 1 <= num_drafts <= self.max_drafts or seconds <= 0 or self.draft_cost_s[num_drafts] <= 0:
            return
        ratio = min(max(seconds / float(self.draft_cost_s[num_drafts]), 0.25), 8.0)
        rate = max(self.cost_update_rate, 1 / (1 + self.num_draft_samples)) if self.cost_update_rate else 0.0
        self.num_draft_samples += 1
        self.draft_cost_s = self.draft_cost_s * (1 + rate * (ratio - 1))

    def saw_call(self, num_tokens: int) -> None:
        """A target call the policy does not learn from (a prefill's): the next call's shape follows it."""
        self.last_tokens = int(num_tokens)

    def observe_call(self, num_tokens: int, seconds: float) -> None:
        estimate = float(self.call_cost(num_tokens))
        if self.last_tokens is not None and num_tokens != self.last_tokens:  # a switched call: its excess
            self.last_tokens = int(num_tokens)
            excess = min(max(seconds - estimate, 0.0), estimate)
            rate = max(self.cost_update_rate, 1 / (1 + self.num_switch_samples)) if self.cost_update_rate else 0.0
            self.num_switch_samples += 1
            self.switch_cost_s += rate * (excess - self.switch_cost_s)
            return
        self.last_tokens = int(num_tokens)
        sample = min(max(seconds, 0.5 * estimate), 2.0 * estimate)
        drift = (sample / estimate) ** self.drift_rate  # the whole machine got slower or faster
        self.call_cost_s = [c * drift for c in self.call_cost_s]
        self.draft_cost_s = self.draft_cost_s * drift
        estimate *= drift
        if num_tokens > self.call_tokens[-1]:  # a size never run: it becomes a point of the curve
            self.call_tokens.append(int(num_tokens))
            self.call_cost_s.append(estimate)
        j = min(range(len(self.call_tokens)), key=lambda i: abs(self.call_tokens[i] - num_tokens))
        self.call_cost_s[j] += self.cost_update_rate * (sample - estimate)
        self.call_cost_s = nondecreasing(self.call_cost_s)


BATCH_CALL_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 96, 128)


def measure_batch_costs(target, drafter, max_tokens: int, max_drafts: int, repetitions: int = 3,
                        context_tokens: int = 32, max_sequences: int = 1) -> tuple[list[int], list[float], list[float]]:
    """(call_tokens, call_cost_s, draft_cost_s) for BatchDraftPolicy: medians of `repetitions`
    batched target calls of each size in BATCH_CALL_SIZES up to max_tokens, and of drafter calls
    for 1 and max_drafts drafts (interpolated between). A call of t tokens is spread as a batch
    round spreads them: over min(t, max_sequences) sequences after a `context_tokens` prompt each
    (fewer where the pool has no room), since one call of several sequences costs more than one
    sequence's call of as many tokens (SmolLM2, 2 cores: 4 x 2 tokens 38.8 ms, 1 x 8 33.8).
    Sizes are interleaved so machine noise hits all alike, and each timed call follows an untimed
    one of the same size: the plugin's first call after a shape change costs more, and a batch's
    rounds mostly repeat their size. Leaves both runners as it found them (the calibration
    sequences are released; the drafter is reset)."""
    # a hybrid target keeps a state per token only for calls up to its limit: larger ones are learnt online
    limit = getattr(getattr(target, "linear", None), "max_checkpoints", max_tokens)
    sizes = [t for t in BATCH_CALL_SIZES if t <= min(max_tokens, limit)] or [1]
    ids = (np.arange(context_tokens + max(sizes), dtype=np.int64) % 97) + 1
    keys = []
    try:
        for n in range(max(1, max_sequences)):
            per_call = -(-max(sizes) // (n + 1))
            budget = context_tokens + 2 * repetitions * len(sizes) + per_call
            key = ("calibration", id(target), n)
            if budget >= target.max_length or not target.reserve(key, budget):
                break
            keys.append(key)
        if not keys:
            raise RuntimeError(f"no room to measure the batch costs ({budget} tokens of KV cache needed)")
        for key in keys:
            ((_, feats),) = target.forward([(key, ids[:context_tokens], [context_tokens - 1])])
            feats = np.array(feats)
            target.commit(key, context_tokens)
        costs = {t: [] for t in sizes}
        for rep in range(repetitions):
            for t in sizes[rep % len(sizes):] + sizes[: rep % len(sizes)]:
                n = min(t, len(keys))
                lengths = [t // n + (i < t % n) for i in range(n)]
                for timed in (False, True):
                    t0 = time.perf_counter()
                    target.forward([(key, ids[:m], np.arange(m)) for key, m in zip(keys, lengths)])
                    if timed:
                        costs[t].append(time.perf_counter() - t0)
                    for key in keys[:n]:
                        target.commit(key, 1)
        drafter.reset()
        drafter.propose(int(ids[0]), feats, context_tokens, 1)
        draft = {1: [], max_drafts: []}
        for _ in range(repetitions):
            for k in draft:
                for timed in (False, True):
                    t0 = time.perf_counter()
                    drafter.propose(int(ids[0]), feats[:0], context_tokens, k)
                    if timed:
                        draft[k].append(time.perf_counter() - t0)
        drafter.reset()
    finally:
        for key in keys:
            target.release(key)
    d1, dmax = statistics.median(draft[1]), statistics.median(draft[max_drafts])
    per_draft = (dmax - d1) / (max_drafts - 1) if max_drafts > 1 else 0.0
    draft_cost = [0.0] + [d1 + per_draft * (k - 1) for k in range(1, max_drafts + 1)]
    return sizes, nondecreasing([statistics.median(costs[t]) for t in sizes]), draft_cost
