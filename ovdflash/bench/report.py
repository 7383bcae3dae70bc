"""The bench's report: statistics over the timed runs, the rich tables and the plot.

Contract: `summarize(runs, names, prompt_sets, notes)` -> per prompt set and mode: median tok/s,
TTFT, TPOT, busy cores, pooled speculative counters (ours exact per position, genai's from its
raw durations), speedup and cost reduction over the best AR, `ratios`; and `agreement` with
`ar` per mode. Strict JSON: no NaN where no AR mode ran. `render_tables(result, console)`
prints one table per set and the drafter's kind (`settings.drafter_kind`); `plot(result, path)`
writes bench.png (per-position acceptance of dflash@B; speedup vs block size with one label and
line style per mode kind, `PLOT_STYLES`) and returns the figure.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ..decode.stats import GenerationStats
from .prompts import PROMPT_SETS


@dataclass
class Run:
    mode: str
    prompt_set: str
    prompt_index: int
    num_tokens: int
    wall_s: float
    ttft_s: float
    token_ids: list[int]
    stats: dict = field(default_factory=dict)  # ours: GenerationStats.as_dict(); genai: round counters
    foreign_cores: float = float("nan")        # CPU used by other processes during the run
    spec: GenerationStats | None = None        # ours only: the call's stats, pooled with merge()

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s if self.wall_s > 0 else 0.0

SPECULATIVE = ("dflash@", "dflash-nopl@", "oracle@")  # mode-name prefixes of our speculative modes (round counters)
# the speedup panel: mode-name prefix -> (legend text, line style, marker); one per mode kind
PLOT_STYLES = {
    "dflash@": ("dflash", "-", "o"),
    "dflash-nopl@": ("dflash-nopl (drafter alone)", "--", "s"),
    "oracle@": ("oracle (perfect drafter)", ":", "^"),
    "genai-dflash@": ("genai-dflash", "-.", "D"),
}


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def summarize(runs: list[Run], names: list[str], prompt_sets: list[str], notes: list[str]) -> dict:
    out = {"modes": names, "prompt_sets": {}, "notes": notes}
    for set_name in prompt_sets:
        per_mode = {}
        for name in names:
            rs = [r for r in runs if r.mode == name and r.prompt_set == set_name]
            if not rs:
                continue
            entry = {"tokens_per_s": _median([r.tokens_per_s for r in rs]),
                     "ttft_ms": 1e3 * _median([r.ttft_s for r in rs]),
                     "num_runs": len(rs), "num_tokens": sum(r.num_tokens for r in rs),
                     "foreign_cores": _median([r.foreign_cores for r in rs])}
            st = [r.stats for r in rs]
            if name == "ar" or name.startswith(SPECULATIVE):
                entry["tpot_ms"] = _median([s["tpot_ms"] for s in st])
            if name.startswith(SPECULATIVE):
                pooled = GenerationStats()  # counters pooled over runs, exact per position
                for r in rs:
                    pooled.merge(r.spec)
                drafts = pooled.num_drafts
                entry.update({
                    "num_drafts": drafts, "num_draft_tokens": pooled.num_draft_tokens,
                    "num_accepted_tokens": pooled.num_accepted_tokens, "num_ar_steps": pooled.num_ar_steps,
                    "num_lookup_drafts": pooled.num_lookup_drafts,
                    "num_lookup_accepted_tokens": pooled.num_lookup_accepted_tokens,
                    "acceptance_rate": pooled.acceptance_rate,
                    "mean_acceptance_length": pooled.mean_acceptance_length,
                    "draft_ms_per_round": 1e3 * pooled.draft_s / drafts if drafts else 0.0,
                    "verify_ms_per_round": 1e3 * pooled.verify_s / drafts if drafts else 0.0,
                    "per_position_acceptance_rate": pooled.per_position_acceptance_rate,
                })
            elif name.startswith("genai-dflash@") and st and "num_rounds" in st[0]:
                rounds = sum(s["num_rounds"] for s in st)
                entry.update({
                    "num_drafts": rounds, "num_accepted_tokens": sum(s["num_accepted_tokens"] for s in st),
                    "mean_acceptance_length": sum(r.num_tokens - 1 for r in rs) / rounds if rounds else 0.0,
                    "draft_ms_per_round": sum(s["draft_ms"] for s in st) / rounds if rounds else 0.0,
                    "verify_ms_per_round": sum(s["verify_ms"] for s in st) / rounds if rounds else 0.0,
                })
            per_mode[name] = entry
        baselines = [per_mode[m]["tokens_per_s"] for m in ("ar", "genai-ar") if m in per_mode]
        # no AR mode run (an acceptance-only bench): no speedups, rather than NaN in the JSON
        best_ar = max(baselines) if baselines else None
        for name, entry in per_mode.items():
            if best_ar and ("dflash" in name or name.startswith("oracle@") or name == "genai-pl"):
                entry["speedup"] = entry["tokens_per_s"] / best_ar
                entry["cost_reduction_per_token"] = 1 - 1 / entry["speedup"]
        out["prompt_sets"][set_name] = {"description": PROMPT_SETS.get(set_name, ""), "best_ar_tokens_per_s": best_ar,
                                        "modes": per_mode, "ratios": _ratios(per_mode, best_ar)}
    out["agreement"] = _agreement(runs, names)
    return out


def _ratios(per_mode: dict, best_ar: float | None) -> dict:
    """The issue's goals as ratios of median tok/s within one interleaved run."""
    tps = {name: e["tokens_per_s"] for name, e in per_mode.items()}
    out = {}
    for name, value in tps.items():
        if name.startswith(SPECULATIVE):
            if best_ar:
                out[f"{name} / best AR"] = value / best_ar
            if name.startswith("dflash"):  # with or without lookup: the same rival
                rival = "genai-dflash@" + name.split("@", 1)[1]
                if rival in tps:
                    out[f"{name} / {rival}"] = value / tps[rival]
    if "ar" in tps and "genai-ar" in tps:
        out["ar / genai-ar"] = tps["ar"] / tps["genai-ar"]
    return out


def _agreement(runs: list[Run], names: list[str]) -> dict:
    """Per mode: fraction of runs whose tokens equal the `ar` run of the same prompt and repetition."""
    ref = {}
    for r in runs:
        if r.mode == "ar":
            ref.setdefault((r.prompt_set, r.prompt_index), r.token_ids)
    out = {}
    for name in names:
        same = [r.token_ids == ref[(r.prompt_set, r.prompt_index)] for r in runs
                if r.mode == name and (r.prompt_set, r.prompt_index) in ref]
        if same:
            out[name] = sum(same) / len(same)
    return out


def render_tables(result: dict, console) -> None:
    from rich.table import Table

    for set_name, data in result["prompt_sets"].items():
        table = Table(title=f"{set_name}: {data['description']}")
        for col in ("mode", "tok/s", "speedup", "accept len", "accept rate", "cost red.", "draft ms/rd",
                    "verify ms/rd", "AR steps", "TTFT ms", "TPOT ms", "busy"):
            table.add_column(col, justify="right")
        for name, e in data["modes"].items():
            def f(key, fmt="{:.2f}"):
                return fmt.format(e[key]) if key in e else "-"
            table.add_row(name, f("tokens_per_s", "{:.1f}"), f("speedup"), f("mean_acceptance_length"),
                          f("acceptance_rate"), f("cost_reduction_per_token", "{:.0%}"),
                          f("draft_ms_per_round", "{:.1f}"), f("verify_ms_per_round", "{:.1f}"),
                          f("num_ar_steps", "{:d}"), f("ttft_ms", "{:.0f}"), f("tpot_ms", "{:.1f}"), f("foreign_cores", "{:.1f}"))
        console.print(table)
        console.print("  busy = median CPU cores used by other processes during a run")
        if data.get("ratios"):
            console.print("  " + ", ".join(f"{k} = {v:.2f}x" for k, v in data["ratios"].items()))
    kind = result.get("settings", {}).get("drafter_kind")
    if kind:
        console.print(f"drafter kind: {kind}")
    for note in result["notes"]:
        console.print(f"note: {note}")
    if result.get("agreement"):
        console.print("token agreement with `ar`: " + ", ".join(f"{k} {v:.0%}" for k, v in result["agreement"].items()))


def plot(result: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for set_index, (set_name, data) in enumerate(result["prompt_sets"].items()):
        curves = {kind: ([], []) for kind in PLOT_STYLES}
        for name, e in data["modes"].items():
            kind = name[: name.index("@") + 1] if "@" in name else ""
            if kind not in curves:
                continue
            b = name.split("@")[1]
            if b != "auto":  # no place on the block-size axis
                curves[kind][0].append(int(b))
                curves[kind][1].append(e.get("speedup", float("nan")))
            if kind == "dflash@":
                rates = e.get("per_position_acceptance_rate", [])
                ax1.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{set_name} B={b}")
        for kind, (sizes, speedups) in curves.items():
            if sizes:
                label, style, marker = PLOT_STYLES[kind]
                ax2.plot(sizes, speedups, marker=marker, linestyle=style, color=f"C{set_index}",
                         label=f"{set_name}, {label}")
    all_sizes = sorted({int(n.split("@")[1]) for d in result["prompt_sets"].values() for n in d["modes"]
                        if n.startswith(tuple(PLOT_STYLES)) and not n.endswith("@auto")})
    if all_sizes:
        ax2.set_xticks(all_sizes)
    ax1.set(xlabel="draft position", ylabel="acceptance rate", title="Per-position acceptance", ylim=(0, 1))
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set(xlabel="block size", ylabel="speedup over best AR", title="DFlash speedup vs block size")
    for ax, size in ((ax1, 7), (ax2, 8)):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig
