"""The step benchmark's reports: its Markdown table and page from a run's result (``benchmarks/step.py``'s
``results``), and the comparisons of two packed step outputs it reports.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from presets import TAUS  # noqa: E402  (benchmarks/presets.py, beside this file)


def emitted_tokens(packed) -> list:
    """The tokens a packed step output ([B, γ+2]: γ drafts, n accepted, bonus) emits per row:
    the accepted drafts, then the bonus. Drafts past the accepted ones are never emitted, so two
    steps whose drafts differ only there emit the same tokens."""
    gamma = packed.shape[-1] - 2
    return [row[:row[gamma]] + [row[gamma + 1]] for row in packed.tolist()]


def first_differing_columns(got, want) -> dict:
    """Per differing row of two packed step outputs ([B, γ+2]: γ draft tokens, n accepted, the
    bonus), the first column that differs, counted by name: a draft token means the draft
    already differed; ``accepted``/``bonus`` mean the same drafts got another verdict."""
    gamma = got.shape[-1] - 2
    names = [f"draft[{i}]" for i in range(gamma)] + ["accepted", "bonus"]
    out: dict[str, int] = {}
    for row in (got != want).tolist():
        if any(row):
            name = names[row.index(True)]
            out[name] = out.get(name, 0) + 1
    return out


def _ms(sec: dict, name: str, b) -> float | None:
    v = sec.get(name, {}).get(b) or sec.get(name, {}).get(str(b))
    return v["median_ms"] if isinstance(v, dict) and "median_ms" in v else None


def render_table(result: dict) -> str:
    sec = result["sections"]
    batches = result["config"]["batches"]
    roof = {int(k): v for k, v in sec.get("roofline_ms", {}).items()}
    lines = ["| batch | roofline ms | GEMM floor ms: cuBLAS | engine GEMMs | eager ms | torch.compile ms "
             "| aoti + CUDA graph ms | aoti / roofline | aoti / GEMM floor | eager / aoti | compile / aoti |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(x, fmt="{:.2f}"):
        return "—" if x is None else fmt.format(x)

    def ratio(x, y):
        return f(x / y if x and y else None, "{:.2f}×")

    for b in batches:
        e, c, o = _ms(sec, "eager", b), _ms(sec, "torch_compile", b), _ms(sec, "aoti", b)
        r, gf, ge = roof.get(b), _ms(sec, "gemm_floor", b), _ms(sec, "gemm_floor_engine", b)
        lines.append(f"| {b} | {f(r)} | {f(gf)} | {f(ge)} | {f(e)} | {f(c)} | {f(o)} | {ratio(o, r)} | {ratio(o, ge or gf)} "
                     f"| {ratio(e, o)} | {ratio(c, o)} |")
    return "\n".join(lines)


def _changed_options(options: dict) -> str:
    """A run's kernel options (``KernelOptions.to_dict()``) as the ones it changed from the defaults."""
    from muse_spark.options import KernelOptions

    default = KernelOptions().to_dict()
    changed = [f"`{k}={v}`" for k, v in options.items() if k not in default or default[k] != v]
    return "the defaults" if not changed else ", ".join(changed) + " (the others the defaults)"


def render_markdown(result: dict) -> str:
    sec, cfg, env = result["sections"], result["config"], result["env"]
    t, d = cfg["target"], cfg["draft"]
    tc = sec.get("torch_compile", {})
    bw = sec.get("copy_bandwidth", {})
    out = [
        "# Benchmarks",
        "",
        "Written by `muse-spark bench` (benchmarks/step.py); the numbers below are from one run.",
        "",
        "```",
        result["command"],
        "```",
        "",
        f"* Device: {env.get('gpu', env['device'])} (compute capability {env.get('compute_capability', '—')}), "
        f"torch {env['torch']}, Triton {env.get('triton')}.",
        *([f"* Host: kernel {h.get('kernel')}, {h.get('cpu_model')}, {h.get('cpus_allowed')} of {h.get('cpus')} "
           f"CPUs allowed, NUMA nodes {', '.join(f'{k} [{v}]' for k, v in h.get('numa_nodes', {}).items()) or '—'}"
           + (f", driver {h.get('driver')}" if "driver" in h else "") + "."]
          if (h := env.get("host")) else []),
        f"* Pair ({result['preset']}, random bf16 weights): target hidden {t['hidden_size']}, "
        f"{t['num_hidden_layers']} layers, {t['num_attention_heads']}/{t['num_key_value_heads']} heads, "
        f"head_dim {t['head_dim']}, FFN {t['intermediate_size']}, vocab {t['vocab_size']}; draft "
        f"{d['num_hidden_layers']} layers, draft vocab {d['draft_vocab_size']}, Markov rank {d['markov_rank']}, "
        f"γ = {cfg['gamma']}.",
        f"* Each request has {cfg['context']} tokens of context; a step verifies γ+1 = {cfg['gamma'] + 1} tokens. "
        f"The aoti graphs attend over a static window of {cfg['max_seq']} keys with the position mask. "
        f"aoti plugins: {sec.get('aoti_plugins', cfg.get('plugin_impl'))}"
        f"{' (the Triton kernels failed to compile: reference plugins)' if sec.get('aoti_plugin_fallback') else ''}.",
        f"* Device-to-device copy bandwidth measured in the run: {bw.get('GBps', 0):.0f} GB/s (bytes read + "
        f"written). Roofline = (weights + valid KV bytes a step must read) / that bandwidth.",
        f"* Attention kernel (bf16/fp16 on CUDA, `MUSE_SPARK_ATTENTION`): {cfg.get('attention', '—')}; "
        f"few-row linear layers (`MUSE_SPARK_LINEAR`): {cfg.get('linear', '—')}.",
        *([f"* Kernel options: {_changed_options(cfg['options'])}."] if "options" in cfg else []),
        (f"* torch.compile: mode `{tc['mode']}` over the eager step (caches marked static; "
         + ("one graph per batch size" if tc.get("static_per_batch")
            else "automatic dynamic shapes: batch 1 static, then a dynamic batch") + "). "
         if tc.get("mode") else "* torch.compile: not run (`--skip compile`). ")
        + f"Medians of {cfg['iters']} CUDA-event-timed steps after warm-up. The aoti buckets are "
        f"captured and timed {'smallest' if cfg.get('aoti_order') == 'ascending' else 'largest'} first. "
        "GEMM floor = the step's weight GEMMs alone, back to back: cuBLAS (`F.linear`), and, when the engine "
        "runs its own (the skinny Triton kernel with silu·mul fused, at most 16 rows: batch ≤ 2), those; "
        "`aoti / GEMM floor` is against the engine's GEMMs where measured, else cuBLAS's.",
        "",
        "## Speculative step latency",
        "",
        render_table(result),
        "",
        "## Bytes per step and achieved bandwidth fraction (roofline / measured)",
        "",
        "| batch | weights GB | KV GB | roofline ms | eager | torch.compile | aoti |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in cfg["batches"]:
        by = sec.get("bytes_per_step", {}).get(b) or sec.get("bytes_per_step", {}).get(str(b)) or {}
        r = (sec.get("roofline_ms", {}).get(b) or sec.get("roofline_ms", {}).get(str(b)))
        fr = []
        for name in ("eager", "torch_compile", "aoti"):
            m = _ms(sec, name, b)
            fr.append("—" if m is None or r is None else f"{r / m:.0%}")
        out.append(f"| {b} | {by.get('weights', 0) / 1e9:.2f} | {by.get('kv', 0) / 1e9:.3f} | "
                   f"{(r or 0):.2f} | " + " | ".join(fr) + " |")
    out += ["", "## Tokens per second at mean acceptance length τ (tokens per step)", "",
            "| engine | batch | " + " | ".join(f"τ = {tau}" for tau in TAUS) + " |",
            "|---|---:|" + "---:|" * len(TAUS)]
    for name, rows in sec.get("tokens_per_s", {}).items():
        for b, row in rows.items():
            out.append(f"| {name} | {b} | " + " | ".join(f"{row[str(tau)]:,.0f}" for tau in TAUS) + " |")
    if sec.get("markov"):
        cols = list(next(iter(sec["markov"].values())).keys())
        out += ["", "## The Markov loop alone (γ sequential steps)", "",
                "| batch | " + " | ".join(cols) + " |", "|---:|" + "---:|" * len(cols)]
        for b, row in sec["markov"].items():
            out.append(f"| {b} | " + " | ".join(f"{row[k]['median_ms'] * 1e3:.1f} µs" if "median_ms" in row.get(k, {})
                                                 else "failed" for k in cols) + " |")
    if "aoti_graph_replay" in sec and sec["aoti_graph_replay"]:
        out += ["", "aoti graph replay alone (without the runner's input copies): "
                + ", ".join(f"B={b}: {v['median_ms']:.2f} ms" for b, v in sec["aoti_graph_replay"].items()) + "."]
    if sec.get("aoti_chained"):
        out += ["", "aoti steps chained as the Generator runs them (each step's successor launched, its inputs "
                "advanced on the device, before the step's rows are read; timed together, per step): "
                + ", ".join(f"B={b}: {v['median_ms']:.2f} ms ({v['steps']} steps)" for b, v in sec["aoti_chained"].items())
                + "."]
    for b, r in sec.get("aoti_runner_profile", {}).items():
        out += ["", f"The runner's step, batch {b} (torch.profiler, {r['calls']} calls back to back): "
                f"{r['kernel_ms']:.3f} ms of device events and {r['idle_ms']:.3f} ms idle a call; events beyond the bare replay's: "
                + (", ".join(f"`{k[:60]}` ×{n:g} {ms * 1e3:.1f} µs" for k, (n, ms) in r["beyond_replay"].items())
                   or "none") + "."]
    if sec.get("aoti_host_issue_us"):
        out += ["", "Host time to issue (median, the device idle at the call): "
                + ", ".join(f"B={b}: the runner's step {v['step']:.0f} µs, the replay alone {v['replay']:.0f} µs"
                            + (f", the input copies then the replay {v['fill_replay']:.0f} µs (after waiting for the "
                               f"copies {v['fill_sync_replay']:.0f} µs" if "fill_replay" in v else "")
                            + (f"; the copies and that wait alone {v['fill_sync']:.0f} µs" if "fill_sync" in v else "")
                            + (")" if "fill_replay" in v else "")
                            for b, v in sec["aoti_host_issue_us"].items()) + "."]
    for b, v in sec.get("aoti_fill_replay", {}).items():
        out += ["", f"The input copies and the replay as the device sees them, batch {b} (CUDA events): launched right "
                f"after the copies {v['then']['median_ms']:.3f} ms, after the host waited for them "
                f"{v['after_sync']['median_ms']:.3f} ms."]
    for b, prof in sec.get("aoti_profile", {}).items():
        out += ["", f"### Where the aoti step's device time goes, batch {b} (torch.profiler, packages called "
                f"without the CUDA graph: {prof['kernel_ms']:.2f} ms of kernels per step)", "",
                "| kernel | launches / step | ms / step | share |", "|---|---:|---:|---:|"]
        out += [f"| `{r['name'][:80]}` | {r['launches']:g} | {r['ms']:.3f} | {r['share']:.0%} |" for r in prof["top"]]
    if sec.get("aoti_matches_eager"):
        out += ["", "Greedy aoti step bit-equal to the eager step on the same inputs (random weights give "
                "near-tied logits, where fused bf16 arithmetic may legitimately flip an argmax): "
                + ", ".join(f"B={b}: {v}" for b, v in sec["aoti_matches_eager"].items()) + "."]
        if sec.get("aoti_emits_as_eager"):
            out.append("Emitted tokens (accepted drafts + bonus) equal to the eager step's: "
                       + ", ".join(f"B={b}: {v}" for b, v in sec["aoti_emits_as_eager"].items()) + ".")
        for b, d in sec.get("aoti_eager_differences", {}).items():
            where = ", ".join(f"{n} ({c})" for n, c in d.get("first_columns", {}).items())
            out.append(f"At B={b}, {d['rows']} of {d['of_rows']} rows differ ({d['entries']} of {d['of_entries']} "
                       "step-output entries)" + (f"; first differing column per row: {where}." if where else "."))
    if sec.get("torch_compile", {}).get("skipped"):
        out += ["", f"torch.compile not measured for {sec['torch_compile']['skipped']}."]
    for name, sub in sec.get("variants", {}).items():  # timed in the same run, after the default
        # the kernel options it changes (a run before KernelOptions recorded its environment variables)
        switches = " ".join(f"{k}={v}" for k, v in (sub["options"] if "options" in sub else sub["env"]).items())
        out += ["", f"### Variant `{name}` ({switches}), beside the default aoti step", "",
                "| batch | aoti ms | default aoti ms | variant / default | graph replay ms | kernels ms / replay | "
                "launches / replay | greedy step = eager (same switches) |",
                "|---:|---:|---:|---:|---:|---:|---:|---|"]
        for b, t in sub.get("aoti", {}).items():
            base, ms = _ms(sec, "aoti", b), t["median_ms"]
            rep = sub.get("aoti_replay_profile", {}).get(b, {})
            replay = sub.get("aoti_graph_replay", {}).get(b, {}).get("median_ms")
            launches = sum(n for n, _ in rep["all"].values()) if rep.get("all") else None
            cells = [f"{ms:.3f}", "—" if base is None else f"{base:.3f}", "—" if base is None else f"{ms / base:.3f}",
                     "—" if replay is None else f"{replay:.3f}",
                     "—" if "kernel_ms" not in rep else f"{rep['kernel_ms']:.3f}",
                     "—" if launches is None else f"{launches:g}", str(sub.get("aoti_matches_eager", {}).get(b))]
            out.append(f"| {b} | " + " | ".join(cells) + " |")
        for b, r in sub.get("aoti_pdl", {}).items():  # the PDL variant's graphs: the edges' two ports, plain edges
            p_, lo, pe = r["programmatic"], r["launch_order"], r["plain_edges"]
            out.append(f"* B={b}: {p_['edges']} edges programmatic (graph of {p_['kernels']} kernels). Replay: "
                       f"programmatic port {p_['replay']['median_ms']:.3f} ms; launch-order port "
                       f"{lo['replay']['median_ms']:.3f} ms (step equal: {lo['equals']}); the same kernels with plain "
                       f"edges {pe['replay']['median_ms']:.3f} ms (step equal: {pe['equals']}).")
        for e in sub.get("aoti_errors", []) + ([sub["aoti_error"]] if "aoti_error" in sub else []):
            out.append(f"* failed: {str(e).splitlines()[0][:300]}")
    for b, r in sec.get("aoti_context_stream", {}).items():  # the same packages, the draft context in line
        out += ["", f"Draft context on a second stream (the default on CUDA), batch {b}: replay "
                f"{r['side_replay']['median_ms']:.3f} ms; in line on one stream {r['serial_replay']['median_ms']:.3f} ms "
                f"(greedy step equal: {r['equals']})"
                + (f"; the host's time to issue the input copies and the launch: {h['side_fill_replay']:.0f} µs, in line "
                   f"{h['serial_fill_replay']:.0f} µs" if (h := r.get("host_issue_us")) else "") + "."]
    for b, got in sec.get("aoti_interleaved_replay", {}).items():  # the graphs timed in turns
        base = got.get("aoti")
        turns = sec.get("in_turns", {}).get(b, {})
        out += ["", f"Step graphs replayed in turns, batch {b} (median of the rounds' medians): " + ", ".join(
            f"`{label}` {ms:.3f} ms" + (f" ({ms / base:.3f}×)" if base and label != "aoti" else "")
            for label, ms in got.items()) + "."
            + (f" The copy timed in the same rounds: {turns['copy_GBps']:.0f} GB/s, so a roofline of "
               f"{turns['roofline_ms']:.2f} ms and the default step graph at **{turns['aoti_replay_over_roofline']:.3f}×** "
               "it (the replay alone; the table's figure is the runner's step, timed right after the compile)."
               if "aoti_replay_over_roofline" in turns else "")]
    idle = [f"`{label}` B={b} {r['idle_ms']:.3f} ms"
            for label, sub in [("aoti", sec)] + [(f"aoti {n}", v) for n, v in sec.get("variants", {}).items()]
            for b, r in sub.get("aoti_replay_profile", {}).items() if "idle_ms" in r]
    if idle:
        out += ["", "Device idle between the events of a replay (torch.profiler): " + ", ".join(idle) + "."]
    # (the Markov kernel's error flag per batch is a failure only where it is set)
    errors = {k: v for k, v in sec.items() if "error" in k and not (k.endswith("error_flag") and not any(v.values()))}
    errors.update({f"{k}.error": v["error"] for k, v in sec.items() if isinstance(v, dict) and "error" in v})
    if errors:
        out += ["", "## Failures in this run", ""] + [f"* `{k}`: {str(v).splitlines()[0][:300]}"
                                                       for k, v in errors.items()]
    return "\n".join(out) + "\n"
