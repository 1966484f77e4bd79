"""The current figures from ``benchmarks/results/``: a Markdown table on stdout and a plot of the step
time against the roofline by batch size.

    python benchmarks/render.py [--results benchmarks/results] [--png docs/performance.png]

One device's figures (``--device``; by default the GPU whose results cover the most batch sizes) of one
precision (``--precision``: bf16 pairs, the default, or FP8 ones): for
each batch size the latest step result (``benchmarks/step.py``) on it that timed the aoti step at that
batch gives its row: the roofline of that run (its bytes a step must read over the copy bandwidth it
measured), the GEMM floor, the aoti step as the runtime runs it (the CUDA-graph runner), the step
graph replayed in turns with the copy (and that copy's roofline), eager and torch.compile where the
run timed them, and the Markov loop as the engines call it. Needs matplotlib for the plot
(``pip install -e .[bench]``); ``--png ''`` skips it.

The plot's second panel, where there are generation results (``benchmarks/generation.py``) on the
compiled engine: generated tokens per second by batch size for each pair acceptance and verification
schedule, beside the same engine's target-only decoding (the latest run of each acceptance on the device).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402  (benchmarks/results.py, beside this file)

ROOT = Path(__file__).resolve().parents[1]
PNG = ROOT / "docs" / "performance.png"
MARKOV_KEPT = "triton, kept workspace (in a CUDA graph; as the engines call it)"


def _get(d: dict, b: int):
    return d.get(str(b), d.get(b)) if isinstance(d, dict) else None


def _ms(sec: dict, name: str, b: int) -> float | None:
    v = _get(sec.get(name, {}), b)
    return v["median_ms"] if isinstance(v, dict) and "median_ms" in v else None


def precision(doc: dict) -> str:
    """A step result's precision: "fp8" where its target had FP8 projections or an FP8 KV cache, else "bf16"
    (the checkpoints' compute dtype)."""
    target = doc["results"].get("config", {}).get("target", {})
    return "fp8" if target.get("quantization_config") or target.get("kv_cache_dtype") == "fp8" else "bf16"


def step_rows(docs: list[dict]) -> list[dict]:
    """One row per batch size: the figures of the latest step result that timed the aoti step there."""
    latest: dict[int, dict] = {}
    for doc in docs:  # oldest first: a later run replaces an earlier one's batch
        for key in doc["results"].get("sections", {}).get("aoti", {}):
            latest[int(key)] = doc
    rows = []
    for b, doc in sorted(latest.items()):
        sec = doc["results"]["sections"]
        turns = _get(sec.get("in_turns", {}), b) or {}
        replay = _get(sec.get("aoti_interleaved_replay", {}), b) or {}
        markov = _get(sec.get("markov", {}), b) or {}
        rows.append({
            "batch": b, "date": doc["date"][:10], "device": doc["device"], "commit": doc["commit"],
            "file": doc.get("_file"), "command": doc["command"],
            "copy_GBps": sec.get("copy_bandwidth", {}).get("GBps"),
            "roofline_ms": _get(sec.get("roofline_ms", {}), b),
            "gemm_floor_ms": _ms(sec, "gemm_floor_engine", b) or _ms(sec, "gemm_floor", b),
            "aoti_ms": _ms(sec, "aoti", b), "eager_ms": _ms(sec, "eager", b),
            "torch_compile_ms": _ms(sec, "torch_compile", b),
            "in_turns_ms": replay.get("aoti"), "in_turns_roofline_ms": turns.get("roofline_ms"),
            "markov_us": markov[MARKOV_KEPT]["median_ms"] * 1e3 if "median_ms" in markov.get(MARKOV_KEPT, {}) else None,
        })
    return rows


def _f(x, fmt: str = "{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def _ratio(x, y) -> str:
    return _f(x / y if x and y else None, "{:.2f}×")


def _log_axes(ax, ticks: list[int]) -> None:
    """Log-log axes over batch sizes ``ticks`` (base 2, each labelled, room beside the last points for their
    labels) with plain numbers on the y axis."""
    import matplotlib.ticker

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ticks, [str(t) for t in ticks])
    if ticks:
        ax.set_xlim(ticks[0] / 1.4, ticks[-1] * 1.6)
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.tick_params(axis="y", which="minor", labelsize=7)


def table(rows: list[dict]) -> str:
    out = ["| batch | roofline ms | GEMM floor ms | aoti step ms | aoti / roofline | in turns ms (/ its roofline) "
           "| eager ms | torch.compile ms | eager / aoti | compile / aoti | Markov loop µs | run |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        turns = "—" if r["in_turns_ms"] is None else (
            f"{r['in_turns_ms']:.3f} ({_ratio(r['in_turns_ms'], r['in_turns_roofline_ms'])})")
        out.append(f"| {r['batch']} | {_f(r['roofline_ms'])} | {_f(r['gemm_floor_ms'])} | **{_f(r['aoti_ms'])}** "
                   f"| {_ratio(r['aoti_ms'], r['roofline_ms'])} | {turns} | {_f(r['eager_ms'])} "
                   f"| {_f(r['torch_compile_ms'])} | {_ratio(r['eager_ms'], r['aoti_ms'])} "
                   f"| {_ratio(r['torch_compile_ms'], r['aoti_ms'])} | {_f(r['markov_us'], '{:.1f}')} "
                   f"| {r['date']} {r['device']} {r['commit']} |")
    return "\n".join(out)


def plot(rows: list[dict], png: Path, generation: tuple[dict, str] | None = None) -> Path:
    """Step time by batch size against the roofline (log-log), with eager and torch.compile where timed;
    with ``generation`` ((``generation_series``, its device)) a second panel of generated tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if generation else 1, figsize=(14 if generation else 7, 4.5), dpi=120,
                             squeeze=False)
    ax = axes[0][0]
    series = [("aoti step (CUDA-graph runner)", "aoti_ms", "o-", "C0"),
              ("roofline (bytes / measured copy bandwidth)", "roofline_ms", "s--", "k"),
              ("GEMM floor (the step's weight GEMMs alone)", "gemm_floor_ms", "^:", "C2"),
              ("torch.compile (reduce-overhead)", "torch_compile_ms", "D", "C1"),
              ("eager", "eager_ms", "x", "C3")]
    for label, key, style, color in series:
        pts = [(r["batch"], r[key]) for r in rows if r[key] is not None]
        if pts:
            ax.plot(*zip(*pts), style, color=color, label=label)
    for r in rows:
        if r["aoti_ms"] and r["roofline_ms"]:
            ax.annotate(f"{r['aoti_ms'] / r['roofline_ms']:.2f}× roofline", (r["batch"], r["aoti_ms"]),
                        textcoords="offset points", xytext=(6, 6), fontsize=8, color="C0")
    _log_axes(ax, sorted(r["batch"] for r in rows))
    ax.set_xlabel("batch size (requests a step)")
    ax.set_ylabel("speculative step, ms")
    devices = sorted({r["device"] for r in rows})
    ax.set_title(f"Muse-Spark-shaped pair (random bf16 weights), γ = 7, 1024 tokens of context; {', '.join(devices)}",
                 fontsize=8)
    if generation:
        generation_panel(axes[0][1], *generation)
    for ax in axes[0]:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)
    return png


def generation_series(docs: list[dict], device: str) -> dict[str, list[tuple[int, float]]]:
    """``label → [(batch, tok/s)]`` from the aoti generation results on ``device``: for each pair acceptance and
    schedule (and prefill batch) the latest run's tok/s at each batch size (a later run of some batch sizes
    replaces those points only), and target-only decoding from the latest of the runs with the most batch sizes (a
    shorter run, such as an FP8 comparison's, does not cut the line short)."""
    points: dict[tuple[float, str], dict[int, float]] = {}
    runs: list[dict] = []
    for d in docs:  # (oldest first: a later run's point replaces an earlier one's)
        engine, pair = d["config"].get("engine", {}), d["config"].get("pair") or {}
        if not (d["device"] == device and engine.get("backend") == "aoti" and "acceptance" in pair
                and d["results"].get("batches")):
            continue
        runs.append(d)
        for r in d["results"]["batches"]:
            name = "fixed γ" if r.get("schedule", "off") == "off" else f"{r['schedule']} scheduling"
            if r.get("prefill_batch", 1) > 1:  # (benchmarks/generation.py --prefill-batch: its batched rows)
                name += f", prefill {r['prefill_batch']} chunks a call"
            points.setdefault((pair["acceptance"], name), {})[r["batch"]] = r["speculative"]["tokens_per_s"]
    series = {f"acceptance {p:g}, {name}": sorted(pts.items())
              for (p, name), pts in sorted(points.items(), key=lambda kv: (-kv[0][0], kv[0][1]))}
    if runs:
        last = max(runs, key=lambda d: (len({r["batch"] for r in d["results"]["batches"]}), d["date"]))
        seen = {}
        for r in last["results"]["batches"]:
            seen.setdefault(r["batch"], r["target_only"]["tokens_per_s"])
        series["target-only decoding (the same engine)"] = sorted(seen.items())
    return series


def generation_panel(ax, series: dict[str, list[tuple[int, float]]], device: str) -> None:
    """Generated tokens/s by batch size (log-log), one line per acceptance and schedule."""
    for i, (label, pts) in enumerate(series.items()):
        style = "s--" if label.startswith("target-only") else ("o-" if "fixed" in label else "D:")
        ax.plot(*zip(*pts), style, color="k" if label.startswith("target-only") else f"C{i}", label=label)
    batches = sorted({b for pts in series.values() for b, _ in pts})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size (concurrent requests)")
    ax.set_ylabel("generated tokens / s (256-token greedy generations)")
    ax.set_title(f"8B-shaped pairs with a chosen acceptance, aoti engine, γ = 7; {device}", fontsize=8)


def fp8_series(step_docs: list[dict], gen_docs: list[dict], device: str) -> dict[str, dict[str, list[tuple]]]:
    """FP8 beside bf16 on ``device``: ``{"step": {precision: [(batch, aoti ms, roofline ms)]}, "tokens":
    {precision: [(batch, tok/s)]}}``. The steps: each precision's rows (``step_rows``). The tokens: the latest
    aoti generation run of an FP8 engine (FP8 projections or an FP8 KV cache) and the bf16 run of the same commit
    and date (``scripts/gpu_check.sh fp8-gen`` runs both in one call); none without such a pair of runs."""
    out: dict[str, dict[str, list[tuple]]] = {"step": {}, "tokens": {}}
    for prec in ("bf16", "fp8"):
        rows = step_rows([d for d in step_docs if d["device"] == device and precision(d) == prec])
        out["step"][prec] = [(r["batch"], r["aoti_ms"], r["roofline_ms"]) for r in rows if r["aoti_ms"]]

    def fp8_engine(d: dict) -> bool:
        engine = d["config"].get("engine", {})
        return bool(engine.get("fp8_projections")) or engine.get("kv_cache_dtype") == "fp8"

    runs = [d for d in gen_docs if d["device"] == device and d["config"].get("engine", {}).get("backend") == "aoti"
            and d["results"].get("batches")]
    fp8_runs = [d for d in runs if fp8_engine(d)]
    if fp8_runs:
        fp8 = fp8_runs[-1]
        bf16 = [d for d in runs if not fp8_engine(d) and d["commit"] == fp8["commit"]
                and d["date"][:10] == fp8["date"][:10]]
        if bf16:
            for prec, d in (("bf16", bf16[-1]), ("fp8", fp8)):
                out["tokens"][prec] = sorted((r["batch"], r["speculative"]["tokens_per_s"])
                                             for r in d["results"]["batches"] if r.get("schedule", "off") == "off")
    return out


def fp8_plot(series: dict[str, dict[str, list[tuple]]], device: str, png: Path) -> Path:
    """FP8 beside bf16: the step against each one's roofline by batch size (left), generated tokens/s (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), dpi=120)
    for prec, color in (("bf16", "C0"), ("fp8", "C3")):
        pts = series["step"].get(prec, [])
        if pts:
            b, step, roof = zip(*pts)
            left.plot(b, step, "o-", color=color, label=f"{prec} aoti step")
            left.plot(b, roof, "s--", color=color, alpha=0.6, label=f"{prec} roofline (its bytes)")
        tok = series["tokens"].get(prec, [])
        if tok:
            right.plot(*zip(*tok), "o-", color=color, label=f"{prec}, fixed γ")
    bf16_tok = dict(series["tokens"].get("bf16", []))
    for b, t in series["tokens"].get("fp8", []):
        if bf16_tok.get(b):
            right.annotate(f"{t / bf16_tok[b]:.2f}× bf16", (b, t), textcoords="offset points", xytext=(6, 6),
                           fontsize=8, color="C3")
    for ax, part in ((left, "step"), (right, "tokens")):
        _log_axes(ax, sorted({p[0] for pts in series[part].values() for p in pts}))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_xlabel("batch size")
    left.set_ylabel("speculative step, ms")
    left.set_title(f"The step, bf16 and FP8 (FP8 projections, FP8 KV cache); {device}", fontsize=8)
    right.set_ylabel("generated tokens / s (256-token greedy generations)")
    right.set_title(f"End to end, the same pair in bf16 and FP8 (acceptance 0.8), aoti engines; {device}", fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=results.RESULTS, help="the result files' folder")
    p.add_argument("--png", default=None,
                   help=f"where the plot goes ('' for none; default {PNG.name} in docs/ for bf16, none for fp8: "
                        "the page's plot is of the bf16 steps; with fp8, FP8 beside bf16 on the same device)")
    p.add_argument("--precision", choices=["bf16", "fp8"], default="bf16",
                   help="the steps of bf16 pairs (default) or of FP8 ones (FP8 projections or KV cache)")
    p.add_argument("--device", default=None,
                   help="the GPU whose figures to show (a part of its name, e.g. H100); default: the one whose "
                        "results cover the most batch sizes")
    a = p.parse_args(argv)
    if a.png is None:
        a.png = str(PNG) if a.precision == "bf16" else ""
    # (bf16: the preset's random weights, the page's table; a step timed on a made pair is the FP8 comparison's
    # bf16 side, another workload, shown beside its FP8 quantization by --precision fp8)
    docs = [d for d in results.load(a.results, "step") if precision(d) == a.precision
            and (a.precision == "fp8" or not (d.get("config") or {}).get("pair"))]
    by_device = {dev: step_rows([d for d in docs if d["device"] == dev]) for dev in sorted({d["device"] for d in docs})}
    by_device = {dev: rows for dev, rows in by_device.items() if rows}
    if a.device:
        by_device = {dev: rows for dev, rows in by_device.items() if a.device.lower() in dev.lower()}
    if not by_device:
        print(f"no step results under {a.results}" + (f" for a device named {a.device!r}" if a.device else ""),
              file=sys.stderr)
        return 1
    # (one device's figures: steps timed on different GPUs are not one table)
    device = max(by_device, key=lambda dev: (len(by_device[dev]), max(r["date"] for r in by_device[dev])))
    rows = by_device[device]
    print(table(rows))
    print()
    for r in {r["file"]: r for r in rows}.values():
        print(f"* batch {', '.join(str(x['batch']) for x in rows if x['file'] == r['file'])}: `{r['command']}` "
              f"({r['file']})")
    others = [f"{dev} (batch {', '.join(str(r['batch']) for r in rws)})" for dev, rws in by_device.items()
              if dev != device]
    if others:
        print(f"\nother devices: {'; '.join(others)} (`--device NAME`)")
    if a.png and a.precision == "fp8":  # (FP8 beside bf16 on the FP8 figures' device)
        both = fp8_series(results.load(a.results, "step"), results.load(a.results, "generation"), device)
        print(f"\nplot: {fp8_plot(both, device, Path(a.png))}", file=sys.stderr)
    elif a.png:
        gen = results.load(a.results, "generation")
        gen_devices = sorted({d["device"] for d in gen if a.device is None or a.device.lower() in d["device"].lower()})
        series = {dev: s for dev in gen_devices if (s := generation_series(gen, dev))}
        dev = max(series, key=lambda k: len(series[k])) if series else None
        print(f"\nplot: {plot(rows, Path(a.png), (series[dev], dev) if dev else None)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
