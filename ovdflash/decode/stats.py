"""Speculative-decoding statistics, named as vLLM names them.

Contract: one `GenerationStats` per generate/stream call (filled by the engine and pipeline),
and `GenerationStats.merge` folds calls into a cumulative total. Counters:
- num_drafts: verify rounds that carried drafts; num_draft_tokens: drafts proposed;
  num_accepted_tokens: drafts the verifier accepted (as decided by acceptance, even if a stop
  condition then cut the block short).
- acceptance_rate = accepted / draft tokens; mean_acceptance_length = (accepted + drafts) /
  drafts, i.e. tokens per verify round with the bonus token included (z-lab's tau).
- accepted_per_position[i]: rounds whose draft i was accepted; drafted_per_position[i]: rounds
  that proposed a draft at position i (blocks may shrink near limits).
- acceptance_length_histogram[n]: rounds that emitted n tokens (n = accepted + 1).
- num_lookup_drafts, num_lookup_draft_tokens, num_lookup_accepted_tokens: the part of the three
  counters above whose drafts came from n-gram lookup (ovdflash.decode.lookup) instead of the drafter.
- num_forced_draft_tokens: the part of num_draft_tokens that a grammar forced (structured outputs: the
  only tokens it allowed next, drafted in place of the drafter's guesses, and so always accepted).
- num_cached_prompt_tokens: prompt tokens whose KV the previous call left in the runners and
  this one reused (ovdflash.decode.prefix_cache); the prefill ran the other ones only.
- Times in seconds: prefill (part of TTFT), draft, verify, total. TTFT = call start to first
  token; TPOT = (total - TTFT) / (tokens - 1).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # of them, reused from the previous call's KV (not prefilled)
    num_output_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_ar_steps: int = 0  # plain target steps (AR mode, or too little room for a block)
    num_lookup_drafts: int = 0
    num_lookup_draft_tokens: int = 0
    num_lookup_accepted_tokens: int = 0
    num_forced_draft_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    acceptance_length_histogram: dict[int, int] = field(default_factory=dict)
    num_compactions: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0
    num_calls: int = 0

    def record_round(self, num_drafted: int, num_accepted: int, from_lookup: bool = False) -> None:
        if from_lookup:
            self.num_lookup_drafts += 1
            self.num_lookup_draft_tokens += num_drafted
            self.num_lookup_accepted_tokens += num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        while len(self.drafted_per_position) < num_drafted:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
        n = num_accepted + 1
        self.acceptance_length_histogram[n] = self.acceptance_length_histogram.get(n, 0) + 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts if self.num_drafts else 0.0

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def tpot_s(self) -> float:
        n = self.num_output_tokens - self.num_calls
        return (self.total_s - self.ttft_s) / n if n > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.total_s if self.total_s > 0 else 0.0

    def merge(self, other: "GenerationStats") -> None:
        """Add another call's stats into this cumulative total (TTFT adds up; see mean_ttft_s)."""
        for name in ("num_prompt_tokens", "num_cached_prompt_tokens", "num_output_tokens", "num_drafts", "num_draft_tokens",
                     "num_accepted_tokens", "num_ar_steps", "num_lookup_drafts",
                     "num_lookup_draft_tokens", "num_lookup_accepted_tokens", "num_forced_draft_tokens",
                     "num_compactions", "prefill_s",
                     "draft_s", "verify_s", "ttft_s", "total_s", "num_calls"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for i, (a, d) in enumerate(zip(other.accepted_per_position, other.drafted_per_position)):
            if i == len(self.drafted_per_position):
                self.drafted_per_position.append(0)
                self.accepted_per_position.append(0)
            self.accepted_per_position[i] += a
            self.drafted_per_position[i] += d
        for n, c in other.acceptance_length_histogram.items():
            self.acceptance_length_histogram[n] = self.acceptance_length_histogram.get(n, 0) + c

    @property
    def mean_ttft_s(self) -> float:
        return self.ttft_s / self.num_calls if self.num_calls else 0.0

    def as_dict(self) -> dict:
        return {
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_prompt_tokens": self.num_cached_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_ar_steps": self.num_ar_steps,
            "num_lookup_drafts": self.num_lookup_drafts,
            "num_lookup_draft_tokens": self.num_lookup_draft_tokens,
            "num_lookup_accepted_tokens": self.num_lookup_accepted_tokens,
            "num_forced_draft_tokens": self.num_forced_draft_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance_rate": self.per_position_acceptance_rate,
            "acceptance_length_histogram": dict(sorted(self.acceptance_length_histogram.items())),
            "num_compactions": self.num_compactions,
            "draft_ms": 1e3 * self.draft_s,
            "verify_ms": 1e3 * self.verify_s,
            "prefill_ms": 1e3 * self.prefill_s,
            "ttft_ms": 1e3 * self.mean_ttft_s,
            "tpot_ms": 1e3 * self.tpot_s,
            "tokens_per_s": self.tokens_per_s,
            "total_s": self.total_s,
            "num_calls": self.num_calls,
        }

    def summary_line(self) -> str:
        line = (f"{self.num_output_tokens} tok in {self.total_s:.2f}s, {self.tokens_per_s:.1f} tok/s, "
                f"TTFT {1e3 * self.mean_ttft_s:.0f} ms, TPOT {1e3 * self.tpot_s:.1f} ms")
        if self.num_drafts:
            line += (f", accept len {self.mean_acceptance_length:.2f}, "
                     f"accept rate {self.acceptance_rate:.2f}, "
                     f"draft {1e3 * self.draft_s:.0f} ms / verify {1e3 * self.verify_s:.0f} ms")
        if self.num_lookup_drafts:
            line += f", {self.num_lookup_drafts} of {self.num_drafts} rounds drafted by lookup"
        if self.num_cached_prompt_tokens:
            line += f", {self.num_cached_prompt_tokens} of {self.num_prompt_tokens} prompt tokens cached"
        return line

    def report(self) -> str:
        """Multi-line report for `/stats` and tools."""
        lines = [self.summary_line(),
                 f"drafts {self.num_drafts}, draft tokens {self.num_draft_tokens}, "
                 f"accepted {self.num_accepted_tokens}, AR steps {self.num_ar_steps}, "
                 f"compactions {self.num_compactions}"]
        if self.num_lookup_drafts:
            lines.append(f"n-gram lookup: {self.num_lookup_drafts} of the drafts, "
                         f"{self.num_lookup_accepted_tokens} of {self.num_lookup_draft_tokens} tokens accepted")
        if self.num_drafts:
            lines.append("per-position acceptance: "
                         + ", ".join(f"{r:.2f}" for r in self.per_position_acceptance_rate))
            hist = dict(sorted(self.acceptance_length_histogram.items()))
            lines.append("acceptance length histogram: "
                         + " ".join(f"{n}:{c}" for n, c in hist.items()))
        return "\n".join(lines)
