"""Benchmark plots from summary rows (the "overall" rows of each temperature).

- speedup_vs_n.png: theoretical speedup vs n for SPD and PPSD (a line per drafter: spd, spd+retrieval, ppsd), EAGLE-style (one line per k)
  and AR as horizontal lines, and the pipeline's limit n.
- acceptance_by_position.png: per-draft acceptance by position: the pipeline fill when the
  draft was made (SPD / PPSD; n = steady state) or the index in the chain (EAGLE-style).
"""

from __future__ import annotations

import re
from pathlib import Path

from . import OVERALL

STYLES = {0.0: "-", 1.0: "--"}
EAGLE_COLORS = ("tab:green", "tab:olive", "tab:cyan", "tab:purple", "tab:gray", "tab:pink", "black")
PIPELINE_COLORS = ("tab:blue", "tab:red", "tab:orange", "tab:brown", "tab:pink")


def _pyplot():
    import matplotlib  # benchmark plots (optional extra `spd[bench]`)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_speedup_vs_n(rows: list[dict], path: Path) -> Path:
    plt = _pyplot()
    overall = [r for r in rows if r["dataset"] == OVERALL and r["theoretical_speedup"] is not None]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ns = sorted({r["n"] for r in overall if r["kind"] in ("spd", "ppsd")})
    for t in sorted({r["temperature"] for r in overall}):
        style = STYLES.get(t, ":")
        # one line per pipeline drafter: the method's name without its n (spd, spd+retrieval, ppsd, spd-w4)
        lines: dict[str, list] = {}
        for r in overall:
            if r["kind"] in ("spd", "ppsd") and r["temperature"] == t:
                lines.setdefault(re.sub(r"-n\d+", "", r["method"]), []).append((r["n"], r["theoretical_speedup"]))
        for i, (family, pts) in enumerate(lines.items()):
            ax.plot(*zip(*sorted(pts)), style, marker="s" if family.startswith("ppsd") else "o",
                    color=PIPELINE_COLORS[i % len(PIPELINE_COLORS)], label=f"{family} T={t:g}")
        eagle = sorted((r for r in overall if r["kind"] == "eagle" and r["temperature"] == t),
                       key=lambda r: (r["k"] is None, r["k"] or 0, r["method"]))   # chains, then trees
        for i, r in enumerate(eagle):
            ax.axhline(r["theoretical_speedup"], linestyle=style, color=EAGLE_COLORS[i % len(EAGLE_COLORS)],
                       label=f"{r['method']} T={t:g}")
    ax.axhline(1.0, color="black", linewidth=1, label="AR")
    if ns:
        ax.plot(ns, ns, ":", color="gray", label="limit n")
        ax.set_xticks(ns)
    ax.set_xlabel("pipeline stages n")
    ax.set_ylabel("theoretical speedup (common cost model)")
    ax.set_title("Theoretical speedup vs n")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_acceptance_by_position(rows: list[dict], path: Path) -> Path:
    plt = _pyplot()
    overall = [r for r in rows if r["dataset"] == OVERALL and r["kind"] != "ar" and r["acceptance_by_position"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    colors = {m: f"C{i}" for i, m in enumerate(dict.fromkeys(r["method"] for r in overall))}
    for ax, kinds, xlabel in ((axes[0], ("spd", "ppsd"), "pipeline fill when drafted (n = steady state)"),
                              (axes[1], ("eagle",), "position in the draft chain (tree: depth)")):
        for r in overall:
            if r["kind"] not in kinds:
                continue
            xs = [i + 1 for i, a in enumerate(r["acceptance_by_position"]) if a is not None]
            ys = [a for a in r["acceptance_by_position"] if a is not None]
            ax.plot(xs, ys, STYLES.get(r["temperature"], ":"), marker="o", color=colors[r["method"]],
                    label=f"{r['method']} T={r['temperature']:g}")
        ax.set_xlabel(xlabel)
        width = max((len(r["acceptance_by_position"]) for r in overall if r["kind"] in kinds), default=1)
        ax.set_xticks(range(1, width + 1))
        ax.set_ylim(0, 1)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    axes[0].set_ylabel("per-draft acceptance")
    fig.suptitle("Acceptance by position in the pipeline window / draft chain")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(rows: list[dict], out) -> list[Path]:
    out = Path(out)
    return [plot_speedup_vs_n(rows, out / "speedup_vs_n.png"),
            plot_acceptance_by_position(rows, out / "acceptance_by_position.png")]
