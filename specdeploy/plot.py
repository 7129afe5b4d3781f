"""`specdeploy plot BENCH.json --out DIR`: PNG charts of a bench run (matplotlib, the optional
`plot` extra; drawn with the Agg backend, no display needed).

Reads `specdeploy bench --json` output (one object, a list of them, or JSON lines: one point
per run at its concurrency) and `bench/serve.py` output (`{"runs": [{"config", "levels"}]}`).
Draws `throughput_vs_concurrency.png` and, where the runs speculated,
`acceptance_per_position.png` (the fraction of drafting steps whose draft at that position was
accepted).
"""
from __future__ import annotations

import json
from pathlib import Path


def load_runs(path: str | Path) -> list[dict]:
    """Normalized runs: {"label", "points": [(concurrency, tokens/s)], "acceptance": [...]}."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:  # JSON lines
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(data, dict) and "runs" in data:  # bench/serve.py
        return [{"label": r.get("config", f"run {i}"),
                 "points": [(lv["concurrency"], lv["output_tokens_per_s"])
                            for lv in r.get("levels", [])],
                 "acceptance": _acceptance(r["levels"][-1].get("spec", {}))
                 if r.get("levels") else []}
                for i, r in enumerate(data["runs"])]
    records = data if isinstance(data, list) else [data]
    runs: dict[str, dict] = {}
    for rec in records:  # specdeploy bench: one point per record, grouped by method
        stats = rec.get("stats", {})
        label = rec.get("label") or stats.get("method") or _label(rec)
        run = runs.setdefault(label, {"label": label, "points": [], "acceptance": []})
        if "concurrency" in rec and "output_tokens_per_s" in rec:
            run["points"].append((rec["concurrency"], rec["output_tokens_per_s"]))
        run["acceptance"] = _acceptance(stats) or run["acceptance"]
    return list(runs.values())


def _label(rec: dict) -> str:
    return "speculative" if "draft_steps" in rec.get("stats", {}) else "no speculation"


def _acceptance(stats: dict) -> list[float]:
    if stats.get("acceptance_per_position"):
        return [float(x) for x in stats["acceptance_per_position"]]
    steps = stats.get("draft_steps") or stats.get("draft_steps_total")
    per_pos = stats.get("accepted_per_position") or []
    return [n / steps for n in per_pos] if steps else []


def plot_bench(path: str | Path, out: str | Path) -> list[Path]:
    """Write the charts into `out`; returns their paths."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plot: needs matplotlib (pip install 'specdeploy[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = load_runs(path)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with_points = [r for r in runs if r["points"]]
    if with_points:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in with_points:
            xs, ys = zip(*sorted(r["points"]))
            ax.plot(xs, ys, marker="o", label=r["label"])
        ax.set(xlabel="concurrent requests", ylabel="output tokens / s",
               title="Throughput vs concurrency")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend()
        written.append(_save(fig, out / "throughput_vs_concurrency.png"))
    with_acc = [r for r in runs if r["acceptance"]]
    if with_acc:
        fig, ax = plt.subplots(figsize=(6, 4))
        width = 0.8 / len(with_acc)
        for i, r in enumerate(with_acc):
            xs = [p + i * width for p in range(len(r["acceptance"]))]
            ax.bar(xs, r["acceptance"], width=width, label=r["label"])
        ax.set(xlabel="draft position (0 = first)", ylabel="acceptance rate", ylim=(0, 1),
               title="Acceptance per draft position")
        ax.legend()
        written.append(_save(fig, out / "acceptance_per_position.png"))
    if not written:
        raise ValueError(f"plot: {path} has no throughput or acceptance data to draw")
    return written


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
