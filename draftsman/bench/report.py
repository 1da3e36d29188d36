"""What `draftsman compare` leaves behind: a Markdown report (stdout), results.json, CSV tables and
PNG plots (matplotlib, Agg backend, so no display is needed)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

CELL_COLUMNS = ["drafter", "name", "category", "temperature", "prompts", "repeats", "tokens_per_s", "speedup",
                "tau", "acceptance", "rounds", "new_tokens", "draft_s", "verify_s", "other_s", "draft_frac",
                "verify_frac", "other_frac", "peak_memory_mb", "working_memory_mb", "extra_parameters", "mismatches",
                "lossy"]
PEER_COLUMNS = ["peer", "category", "temperature", "prompts", "tokens_per_s", "speedup", "speedup_vs_hf_generate",
                "counterpart", "counterpart_over_peer", "same_as_ours", "peak_memory_mb", "extra_parameters"]
SWEEP_COLUMNS = ["drafter", "batch_size", "tokens_per_s", "speedup", "speedup_low", "speedup_high", "tau", "new_tokens"]
# Every file write_all can make: one of these an earlier run left, that this run does not make (no
# peers, no sweep, no matplotlib), is removed, so the folder holds one run. Other files are left alone.
ARTIFACTS = ("results.json", "results.csv", "peers.csv", "batch_sweep.csv", "tau_speedup.png", "acceptance.png",
             "batch_sweep.png", "peers.png")


def write_all(results: dict, out: Path) -> list[Path]:
    """results.json, results.csv (drafter x category x temperature), peers.csv, batch_sweep.csv and
    the plots; removes those of ARTIFACTS an earlier run left and this one does not write; returns
    the files written."""
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "results.json", out / "results.csv", out / "peers.csv", out / "batch_sweep.csv"]
    _write_csv(files[1], CELL_COLUMNS, results["cells"])
    _write_csv(files[2], PEER_COLUMNS, results["peers"])
    _write_csv(files[3], SWEEP_COLUMNS, results["batch_sweep"]["points"])
    plots, note = write_plots(results, out)
    if note:
        results["notes"].append(note)
    stale = [out / name for name in ARTIFACTS if out / name not in files + plots and (out / name).is_file()]
    for f in stale:
        f.unlink()
    if stale:
        results["notes"].append(f"removed {', '.join(f.name for f in stale)}: an earlier run's, not made by this one")
    results["plots"] = [p.name for p in plots]
    files[0].write_text(json.dumps(results, indent=1, default=str) + "\n")
    return files + plots


def _write_csv(path: Path, columns: list[str], rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow([_csv_value(r.get(c)) for c in columns])


def _csv_value(v):
    if isinstance(v, list):
        return " ".join(f"{x:.4f}" if isinstance(x, float) else str(x) for x in v)
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


# --------------------------------------------------------------------------- Markdown

def _f(v, fmt: str = ".2f", none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def _length(cfg: dict) -> str:
    low, high = cfg.get("min_new_tokens", 0), cfg["max_new_tokens"]  # results.json from before the key
    if low == high:
        return f"{high} new tokens (fixed length: EOS masked until then)"
    return f"{low}-{high} new tokens" if low else f"{high} new tokens"


def markdown(results: dict) -> str:
    cfg, env = results["config"], results["environment"]
    counts = results["prompts"]["counts"]
    lines = [
        f"- command: `{results['command']}`",
        f"- target: `{cfg['target']['path']}`",
        f"- machine: {env['device']}, {env['gpu'] or env['cpu']}, {env['cpu_count']} CPU cores, "
        f"torch threads: {env['torch_threads']}",
        f"- versions: python {env['python']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"draftsman {env['draftsman']}" + (f" @ {env['git_commit']}" if env.get("git_commit") else ""),
        f"- prompts: {', '.join(f'{c} {n}' for c, n in counts.items())} from `{results['prompts']['file']}`; "
        f"{_length(cfg)}; repeats: {cfg['repeats']} (interleaved, medians reported)",
        *([f"- sampling in every cell (besides its temperature): "
           f"{', '.join(f'{k} {v}' for k, v in cfg['sampling'].items())}"] if cfg.get("sampling") else []),
        "",
        "### Drafters (batch 1)",
        "",
        "speedup = tokens/s over `none` in the same repeats; time split = drafting / target verification / "
        "everything else (the target's prompt prefill + engine overhead), as shares of engine time; "
        "T=0 mismatches = prompts whose output differs from `none`.",
        "",
        "| drafter | category | T | tokens/s | speedup | tau | acceptance by position | rounds | draft / verify / other "
        "| peak MB | extra params | T=0 mismatches |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in results["cells"]:
        acc = " ".join(f"{a:.2f}" for a in c["acceptance"]) or "-"
        split = f"{c['draft_frac']:.0%} / {c['verify_frac']:.0%} / {c['other_frac']:.0%}"
        mism = "n/a" if c["mismatches"] is None else f"{c['mismatches']}/{c['prompts']}"
        lines.append(f"| {c['drafter']} | {c['category']} | {c['temperature']:g} | {c['tokens_per_s']:.1f} | "
                     f"{c['speedup']:.2f}x | {_f(c['tau'])} | {acc} | {c['rounds']} | {split} | "
                     f"{_f(c['peak_memory_mb'], '.0f')} | {_human(c['extra_parameters'])} | {mism} |")
    if len({c["category"] for c in results["cells"]}) > 1 and results.get("overall"):
        lines += ["", "### All categories together (Spec-Bench's \"overall\")", "",
                  "tokens over seconds summed across the categories, per repeat; speedup = median over repeats.", "",
                  "| drafter | T | prompts | tokens/s | speedup | tau | acceptance by position |",
                  "|---|---|---|---|---|---|---|"]
        for r in results["overall"]:
            acc = " ".join(f"{a:.2f}" for a in r["acceptance"]) or "-"
            lines.append(f"| {r['drafter']} | {r['temperature']:g} | {r['prompts']} | {r['tokens_per_s']:.1f} | "
                         f"{r['speedup']:.2f}x | {_f(r['tau'])} | {acc} |")
    div = [(c["drafter"], c["category"], d) for c in results["cells"] for d in c["divergences"]]
    div += [(p["peer"], p["category"], d) for p in results["peers"] for d in p["divergences"]]
    if results["peers"]:
        lines += ["", "### Hugging Face peers (T=0, batch 1, same target weights, same prompts, same repeats)", "",
                  "| peer | category | tokens/s | vs our `none` | vs hf_generate | ours vs peer | output = ours |",
                  "|---|---|---|---|---|---|---|"]
        for p in results["peers"]:
            ours = ", ".join(f"{label} {ratio:.2f}x" for label, ratio in p["counterparts"].items()) or "-"
            vs_hf = p["speedup_vs_hf_generate"]  # None where hf_generate failed and was dropped
            vs_hf = "-" if vs_hf is None else f"{vs_hf:.2f}x"
            lines.append(f"| {p['peer']} | {p['category']} | {p['tokens_per_s']:.1f} | {p['speedup']:.2f}x | "
                         f"{vs_hf} | {ours} | {p['same_as_ours']}/{p['prompts']} |")
        settings = "; ".join(f"{k}: {v or 'defaults'}" for k, v in results["peer_settings"].items())
        lines += ["", f"peer settings: {settings}"]
    sweep = results["batch_sweep"]
    if sweep["points"]:
        sizes = sorted({p["batch_size"] for p in sweep["points"]})
        labels = list(dict.fromkeys(p["drafter"] for p in sweep["points"]))
        at = {(p["drafter"], p["batch_size"]): p for p in sweep["points"]}
        lines += ["", f"### Batch sweep (T={sweep['temperature']:g}, rows: {sweep['rows']}): total tokens/s "
                      "(speedup over `none`; 95% interval)", "",
                  "speedup = median of the pairs' ratios (each drafter beside its own `none` runs); interval = "
                  "the sign-test interval of that median, shown from 6 pairs on.", "",
                  "| drafter | " + " | ".join(f"batch {b}" for b in sizes) + " |",
                  "|---|" + "---|" * len(sizes)]
        for label in labels:
            lines.append(f"| {label} | " + " | ".join(_sweep_cell(at[label, b]) for b in sizes) + " |")
    if div:
        lines += ["", "### Outputs that differ from plain decoding at T=0", ""]
        for who, cat, d in div:
            lines.append(f"- {who} / {cat} / {d['prompt']}: first differs at new token {d['position']} "
                         f"(expected {d['expected_token']}, got {d['got_token']}); target's top-2 logit gap there "
                         f"{d['top2_logit_gap']:.4g}")
    lines += ["", f"peak memory: target weights + drafter weights + {results['memory_method']}"]
    lines += [f"note: {n}" for n in results["notes"]]
    return "\n".join(lines)


def _sweep_cell(point: dict) -> str:
    """'total tokens/s (speedup; low-high)', the interval where the sweep had enough pairs (and
    not for the baseline, whose pairs are itself)."""
    low, high = point.get("speedup_low"), point.get("speedup_high")
    interval = f"; {low:.2f}-{high:.2f}" if low is not None and high is not None and low != high else ""
    return f"{point['tokens_per_s']:.1f} ({point['speedup']:.2f}x{interval})"


def _human(n: int) -> str:
    if not n:
        return "0"
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


# --------------------------------------------------------------------------- plots

def write_plots(results: dict, out: Path) -> tuple[list[Path], str | None]:
    """(files, note): the note says why plots were skipped, if they were."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display on servers and CI
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "plots skipped: matplotlib is not installed (pip install 'draftsman[plots]')"
    files = [_plot_tau_speedup(plt, results, out / "tau_speedup.png"),
             _plot_acceptance(plt, results, out / "acceptance.png"),
             _plot_sweep(plt, results, out / "batch_sweep.png")]
    if results["peers"]:
        files.append(_plot_peers(plt, results, out / "peers.png"))
    return [f for f in files if f is not None], None


def _labels(results) -> list[str]:
    return list(dict.fromkeys(c["drafter"] for c in results["cells"]))


def _categories(results) -> list[str]:
    return list(dict.fromkeys(c["category"] for c in results["cells"]))


def _bars(ax, groups: list[str], series: dict[str, list[float]]) -> None:
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))], values, width, label=name)
    ax.set_xticks(range(len(groups)), groups)


def _plot_tau_speedup(plt, results, path: Path) -> Path:
    temps = list(dict.fromkeys(c["temperature"] for c in results["cells"]))
    cats, labels = _categories(results), _labels(results)
    at = {(c["drafter"], c["category"], c["temperature"]): c for c in results["cells"]}
    fig, axes = plt.subplots(2, len(temps), figsize=(5 * len(temps), 7), squeeze=False)
    for j, t in enumerate(temps):
        for i, (key, title) in enumerate((("tau", "tau (tokens per target pass)"), ("speedup", "speedup over none"))):
            ax = axes[i][j]
            _bars(ax, cats, {lb: [at[lb, c, t][key] or 0.0 for c in cats] for lb in labels})
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_title(f"{title}, T={t:g}")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_acceptance(plt, results, path: Path) -> Path:
    cats = _categories(results)
    fig, axes = plt.subplots(1, len(cats), figsize=(4.5 * len(cats), 3.6), squeeze=False)
    styles = ["-", "--", ":", "-."]
    temps = list(dict.fromkeys(c["temperature"] for c in results["cells"]))
    colors = {lb: f"C{i}" for i, lb in enumerate(_labels(results))}
    for ax, cat in zip(axes[0], cats):
        for c in results["cells"]:
            if c["category"] == cat and c["acceptance"]:
                ax.plot(range(1, len(c["acceptance"]) + 1), c["acceptance"], marker="o", color=colors[c["drafter"]],
                        ls=styles[temps.index(c["temperature"]) % len(styles)],
                        label=f"{c['drafter']} T={c['temperature']:g}")
        ax.set_ylim(0, 1.02)
        depth = max((len(c["acceptance"]) for c in results["cells"]), default=0)
        ax.set_xticks(range(1, depth + 1))
        ax.set_xlabel("draft position")
        ax.set_title(f"acceptance by position: {cat}")
        if ax.lines:
            ax.legend(fontsize=7)
    axes[0][0].set_ylabel("accepted / proposed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_sweep(plt, results, path: Path) -> Path | None:
    sweep = results["batch_sweep"]
    if not sweep["points"]:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for label in dict.fromkeys(p["drafter"] for p in sweep["points"]):
        pts = sorted((p for p in sweep["points"] if p["drafter"] == label), key=lambda p: p["batch_size"])
        xs = [p["batch_size"] for p in pts]
        a.plot(xs, [p["tokens_per_s"] for p in pts], marker="o", label=label)
        b.plot(xs, [p["speedup"] for p in pts], marker="o", label=label)
        spans = [(p["speedup"] - p["speedup_low"], p["speedup_high"] - p["speedup"]) if p.get("speedup_low")
                 is not None else (0.0, 0.0) for p in pts]
        if any(lo or hi for lo, hi in spans):  # the 95% intervals of the medians
            b.errorbar(xs, [p["speedup"] for p in pts], yerr=list(zip(*spans)), fmt="none", capsize=2,
                       ecolor=b.lines[-1].get_color(), alpha=0.6)
    sizes = sorted({p["batch_size"] for p in sweep["points"]})
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(x) for x in sizes])
        ax.minorticks_off()
        ax.set_xlabel("batch size")
    b.axhline(1.0, color="grey", lw=0.8, ls="--")
    a.set_title(f"total tokens/s (T={sweep['temperature']:g})")
    b.set_title("speedup over none")
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_peers(plt, results, path: Path) -> Path:
    cats = list(dict.fromkeys(p["category"] for p in results["peers"]))
    series = {}
    for c in results["cells"]:
        if c["temperature"] == 0:
            series.setdefault(c["drafter"], {})[c["category"]] = c["tokens_per_s"]
    for p in results["peers"]:
        series.setdefault(p["peer"], {})[p["category"]] = p["tokens_per_s"]
    fig, ax = plt.subplots(figsize=(max(6, 2.5 * len(cats)), 3.8))
    _bars(ax, cats, {name: [v.get(c, 0.0) for c in cats] for name, v in series.items()})
    ax.set_title("tokens/s at T=0, batch 1: ours and Hugging Face generate")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
