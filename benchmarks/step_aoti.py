"""The step benchmark's aoti sections (``benchmarks/step.py``'s ``Bench`` takes them in): the compiled step
of each batch checked against the eager step and timed as the runtime runs it (the CUDA-graph runner,
the bare replay, the serving forms, chained steps), its PDL edges' ports, the draft context in line,
``step_host`` as one launch, and the step graphs replayed in turns with the roofline's copy.
"""

from __future__ import annotations

import copy
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emitted_tokens, first_differing_columns  # noqa: E402  (beside this file)
from timing import (copy_bandwidth, copy_buffers, host_issue_us, profile_kernels, slower_in_graph,  # noqa: E402
                    time_fn)

# Steps the bench's chained measurement runs from one set of host inputs (positions advance by ≤ γ+1 a
# step: the bench's context of 1024 keys leaves room in its window of 1152).
CHAINED = 8


class AotiSections:
    """The aoti measurements of a ``Bench`` (its ``a``, ``device``, ``options``, ``result``, ``replays``,
    ``markov_words``, ``log`` and ``save``)."""

    def aoti_section(self, eng, caches, batches, inputs, kv_len, scratch: int, sec: dict | None = None,
                     work_dir=None, options=None, label: str = "aoti") -> None:
        """The aoti step of each batch: checked against the eager step, timed (runner, replay, the
        serving forms), profiled. ``sec``/``work_dir``/``options``: a variant's results dict, its
        packages, and the kernel options it was compiled with (default: the run's, ``self.options``).
        The section runs under them, and so does the eager step it is checked against (the engine's
        own options, set for the section), so both take the same kernel path."""
        from muse_spark.options import use_options

        options = self.options if options is None else options
        saved = eng.options
        eng.options = options  # an eager engine runs its calls under its own options, not the caller's
        try:
            with use_options(options):
                self._aoti_section(eng, caches, batches, inputs, kv_len, scratch, sec, work_dir, options, label)
        finally:
            eng.options = saved

    def _aoti_section(self, eng, caches, batches, inputs, kv_len, scratch, sec, work_dir, options, label) -> None:
        import torch

        from muse_spark.runtime.aoti_engine import load_step
        from muse_spark.graphs.parts import MARKOV_ERROR_WORD, SpecPair, weight_names, weight_tensors
        from muse_spark.plugins.pdl import pdl_active, PDL_KERNELS
        from muse_spark.runtime.cuda_graph import CUDAGraphStep, GraphMemory, StaticStep

        a, dev = self.a, self.device
        # the step graphs' PDL edges as the engine makes them (from the options its manifest records)
        programmatic = PDL_KERNELS if pdl_active(options) and dev.type == "cuda" else ()
        sec = self.result["sections"] if sec is None else sec
        pair = SpecPair(eng.target, eng.draft)
        weights = weight_tensors(pair, weight_names(pair))
        cuda = dev.type == "cuda"
        memory = GraphMemory(dev) if cuda else None  # (the engine's: one pool and capture stream for its graphs)
        sec["aoti"], sec["aoti_graph_replay"], sec["aoti_matches_eager"], sec["aoti_emits_as_eager"] = {}, {}, {}, {}
        with torch.inference_mode():
            for b in sorted(batches, reverse=not a.aoti_ascending):
                fn = load_step(work_dir or a.work_dir, None, b, eng.target, eng.draft, dev, single_threaded=cuda,
                               side_stream=options.context_stream)
                words = self.markov_words[b]  # the Markov kernel's kept workspace, as the engine keeps it
                runner = (CUDAGraphStep(fn, b, weights, caches, scratch, dev, memory=memory, markov_words=words,
                                        programmatic=programmatic) if cuda
                          else StaticStep(fn, b, weights, caches, scratch, dev, markov_words=words))
                x = inputs(b)
                # Same inputs, greedy rows: the compiled step's drafts and verdicts equal the eager step's.
                xg = x[:4] + (torch.zeros_like(x[4]),)
                got, want = runner(*xg), eng.step(*xg, kv_len)
                same = torch.equal(got, want)
                sec["aoti_matches_eager"][b] = same
                sec["aoti_emits_as_eager"][b] = emitted_tokens(got) == emitted_tokens(want)
                if not same:  # how far apart: rows and step-output entries that differ, and where
                    sec.setdefault("aoti_eager_differences", {})[b] = {
                        "rows": int((got != want).any(-1).sum()), "entries": int((got != want).sum()),
                        "of_rows": got.shape[0], "of_entries": got.numel(),
                        "first_columns": first_differing_columns(got, want)}
                sec["aoti"][b] = time_fn(lambda: runner(*x), dev, a.iters)
                if cuda:

                    def fill_then_replay(sync: bool, replay: bool = True, r=runner) -> None:
                        """A runner's input copies, then its graph's launch (``sync``: once the copies are
                        done; ``replay=False``: no launch)."""
                        r._fill(*x)
                        if sync:
                            torch.cuda.current_stream(dev).synchronize()
                        if replay:
                            r.graph.replay()

                    sec["aoti_graph_replay"][b] = time_fn(runner.graph.replay, dev, a.iters)
                    self.replays.setdefault(b, {})[label] = runner  # kept for interleaved_replays
                    # What the host spends issuing a step (the runner's input copies, pointer check,
                    # graph launch, output clone) and the replay alone: the runner's step costs
                    # more than the replay by up to these, where the GPU waits for the host.
                    sec.setdefault("aoti_host_issue_us", {})[b] = {
                        "step": host_issue_us(lambda: runner(*x), dev, a.iters),
                        "replay": host_issue_us(runner.graph.replay, dev, a.iters),
                        # the step's parts: the input copies, and the pointer check (after the launch)
                        "fill": host_issue_us(lambda: runner._fill(*x), dev, a.iters),
                        "check": host_issue_us(lambda: runner._assert_unmoved(False), dev, a.iters),
                        # the launch right after the copies, and after waiting for them: on the H200 the
                        # step took 228-231 µs to issue against 60-70 for its parts alone (2026-12-04)
                        "fill_replay": host_issue_us(lambda: fill_then_replay(False), dev, a.iters),
                        "fill_sync_replay": host_issue_us(lambda: fill_then_replay(True), dev, a.iters),
                        # ... and the copies with that wait alone: fill_sync_replay less this is what the
                        # launch costs after the copies (2026-12-04: 261 µs against the launch's 50
                        # alone on one machine start, 40 against 6 on another)
                        "fill_sync": host_issue_us(lambda: fill_then_replay(True, replay=False), dev, a.iters)}
                    # ... and what the device sees of them (CUDA events: the idle before the graph counts)
                    sec.setdefault("aoti_fill_replay", {})[b] = {
                        "then": time_fn(lambda: fill_then_replay(False), dev, a.iters),
                        "after_sync": time_fn(lambda: fill_then_replay(True), dev, a.iters)}
                if programmatic:  # the same packages: the edges' other port, and plain edges (the waits' cost)
                    sec.setdefault("aoti_pdl", {})[b] = self.pdl_replays(runner, fn, b, weights, caches, scratch,
                                                                         words, memory, x, label)
                if cuda and fn.side is not None:  # the same packages, the draft context in line (one stream)
                    serial = copy.copy(fn)
                    serial.side = None
                    other = CUDAGraphStep(serial, b, weights, caches, scratch, dev, memory=memory, markov_words=words,
                                          programmatic=programmatic)
                    sec.setdefault("aoti_context_stream", {})[b] = {
                        "equals": bool(torch.equal(other(*xg), runner(*xg))),
                        "serial_replay": time_fn(other.graph.replay, dev, a.iters),
                        "side_replay": time_fn(runner.graph.replay, dev, a.iters),
                        # the host's time to launch each after the input copies (the forked graph's: its
                        # fill_replay above): whether the launch-after-copies cost (185 µs on a slow machine
                        # start) comes with the forked graph
                        "host_issue_us": {
                            "serial_fill_replay": host_issue_us(lambda: fill_then_replay(False, r=other), dev,
                                                                a.iters),
                            "side_fill_replay": sec["aoti_host_issue_us"][b]["fill_replay"]}}
                    self.replays[b][f"{label} serial_context"] = other
                    cs = sec["aoti_context_stream"][b]
                    self.log(f"{label} B={b}: draft context on a second stream {cs['side_replay']['median_ms']:.3f} ms, "
                             f"in line {cs['serial_replay']['median_ms']:.3f} ms (same step: {cs['equals']})")
                # The serving loop's form, host values in and rows out: as the generator did it before
                # (tensors built on the device from lists, the step, .cpu()) and through step_host.
                host = [t.tolist() for t in x]

                def from_lists():
                    ts = [torch.tensor(v, device=dev, dtype=t.dtype) for v, t in zip(host, x)]
                    return runner(*ts).cpu().tolist()

                sec.setdefault("aoti_serving_lists", {})[b] = time_fn(from_lists, dev, a.iters)
                # The Generator's form on an aoti engine: each step's successor launched (inputs advanced
                # on the device) before its rows are read, so the host's work between steps is off the
                # device's path: CHAINED steps from the same host inputs, timed together, per step.
                room = caches[0][0].shape[1] - 1 - eng.gamma - max(host[1])  # the positions left in the window
                steps = max(1, min(CHAINED, room // (eng.gamma + 1) + 1))

                def chained():
                    h = runner.launch_host(*host)
                    for _ in range(steps - 1):
                        nxt = runner.launch_next(h)
                        runner.rows(h)
                        h = nxt
                    return runner.rows(h)

                t = time_fn(chained, dev, max(3, a.iters // steps))
                sec.setdefault("aoti_chained", {})[b] = {"steps": steps, "median_ms": t["median_ms"] / steps,
                                                         "min_ms": t["min_ms"] / steps}
                sec.setdefault("aoti_step_host", {})[b] = time_fn(lambda: runner.step_host(*host), dev, a.iters)
                sec.setdefault("aoti_step_host_equals_step", {})[b] = runner.step_host(*host) == runner(*x).tolist()
                if runner.markov_ws.numel():  # after every timed step: no Markov program gave up waiting
                    sec.setdefault("aoti_markov_error_flag", {})[b] = int(runner.markov_ws[MARKOV_ERROR_WORD])
                issue = sec.get("aoti_host_issue_us", {}).get(b)
                self.log(f"{label} B={b}: {sec['aoti'][b]['median_ms']:.2f} ms (greedy step equals eager: {same}); "
                         f"serving form: lists → device tensors → step → .cpu() "
                         f"{sec['aoti_serving_lists'][b]['median_ms']:.2f} ms, step_host "
                         f"{sec['aoti_step_host'][b]['median_ms']:.2f} ms, chained steps (the Generator's form) "
                         f"{sec['aoti_chained'][b]['median_ms']:.2f} ms a step"
                         + (f"; host time to issue: step {issue['step']:.0f} µs, replay {issue['replay']:.0f} µs"
                            if issue else ""))
                if a.profile:  # the same packages, called without the graph: the kernels it replays
                    plain = StaticStep(fn, b, weights, caches, scratch, dev, markov_words=words)
                    prof = profile_kernels(lambda: plain(*x), dev, keep_all=cuda)
                    self.log(f"{label} B={b} profile: {prof['kernel_ms']:.2f} ms of kernels per step; top: "
                             + "; ".join(f"{r['name'][:60]} {r['ms']:.3f} ms" for r in prof["top"][:5]))
                    if cuda:  # the graph's replay too: which kernels run longer inside it
                        rep = profile_kernels(runner.graph.replay, dev, keep_all=True)
                        slower = slower_in_graph(prof, rep)
                        sec.setdefault("aoti_replay_profile", {})[b] = dict(
                            kernel_ms=rep["kernel_ms"], top=rep["top"], slower_in_graph=slower, all=rep["all"],
                            idle_ms=rep["idle_ms"], gaps=rep["gaps"])
                        self.log(f"{label} B={b} replay profile: {rep['kernel_ms']:.2f} ms of kernels per replay; "
                                 "most slower in the graph: " + "; ".join(
                                     f"{n[:50]} x{k:g} {p:.3f}->{r:.3f} ms" for n, k, p, r in slower[:6]))
                        self.log(f"{label} B={b} replay idle: {rep['idle_ms']:.3f} ms per replay between kernels; "
                                 "largest: " + "; ".join(f"{g['after'][:40]} -> {g['before'][:40]} x{g['count']:g} "
                                                         f"{g['ms']:.3f} ms" for g in rep["gaps"][:5]))
                        # the runner's whole step (input copies, replay, output clone): what it adds
                        call = profile_kernels(lambda: runner(*x), dev, keep_all=True)
                        in_replay = {k: rep["all"].get(k, [0, 0.0]) for k in call["all"]}
                        sec.setdefault("aoti_runner_profile", {})[b] = dict(
                            kernel_ms=call["kernel_ms"], idle_ms=call["idle_ms"], gaps=call["gaps"],
                            calls=call["calls"],
                            beyond_replay={k: [n - in_replay[k][0], ms - in_replay[k][1]]
                                           for k, (n, ms) in call["all"].items() if n > in_replay[k][0]})
                        self.log(f"{label} B={b} runner step: {call['kernel_ms']:.2f} ms of device events, "
                                 f"{call['idle_ms']:.3f} ms idle; events beyond the replay's: "
                                 + "; ".join(f"{k[:40]} x{n:g} {ms * 1e3:.1f} µs" for k, (n, ms) in
                                             sec["aoti_runner_profile"][b]["beyond_replay"].items()))
                    sec.setdefault("aoti_profile", {})[b] = prof  # with every kernel ("all") on CUDA: a
                    # kernel below the top's cutoff must not look absent when two runs are compared
                self.save()  # each batch as it is done: a run cut short keeps the batches it timed
        self.save()

    def interleaved_replays(self, sec: dict, rounds: int = 7, copy_gib: float = 2.0) -> None:
        """The default step graph and each variant's, timed in turns (``rounds`` rounds of
        ``--iters`` replays each), with the device-to-device copy the roofline divides by timed in
        the same rounds: a difference of a percent between two sections timed minutes apart can be
        the GPU's clocks (the first section after the compile ran up to 5 % faster than the same graph
        a few seconds later on the H200); one taken in turns cannot.
        -> ``aoti_interleaved_replay`` {batch: {label: median of the rounds' medians, ms}} and
        ``in_turns`` {batch: copy GB/s, its roofline and the default graph's ratio to it}; the graphs
        are released after."""
        replays, self.replays = self.replays, {}
        if not replays:
            return
        buffers = copy_buffers(self.device, copy_gib)  # the roofline's copy (copy_bandwidth), kept for the rounds
        for b, runners in sorted(replays.items()):
            rounds_ms: dict[str, list] = {label: [] for label in runners}
            copy_gbps: list = []
            for _ in range(rounds):
                for label, runner in runners.items():
                    rounds_ms[label].append(time_fn(runner.graph.replay, self.device, self.a.iters)["median_ms"])
                copy_gbps.append(copy_bandwidth(self.device, buffers=buffers)["GBps"])
            got = {label: statistics.median(v) for label, v in rounds_ms.items()}
            sec.setdefault("aoti_interleaved_replay", {})[b] = got
            gbps = statistics.median(copy_gbps)
            turns = {"copy_GBps": gbps}
            total = sec.get("bytes_per_step", {}).get(b, {}).get("total")
            if total:
                turns["roofline_ms"] = total / gbps / 1e6
                if "aoti" in got:
                    turns["aoti_replay_over_roofline"] = got["aoti"] / turns["roofline_ms"]
            sec.setdefault("in_turns", {})[b] = turns
            base = got.get("aoti")
            self.log(f"B={b} step graphs replayed in turns ({rounds} rounds): " + ", ".join(
                f"{label} {ms:.3f} ms" + (f" ({ms / base:.3f}×)" if base and label != "aoti" else "")
                for label, ms in got.items()) + f"; copy in the same rounds {gbps:.0f} GB/s"
                + (f", roofline {turns['roofline_ms']:.2f} ms: the default graph {turns['aoti_replay_over_roofline']:.3f}×"
                   if "aoti_replay_over_roofline" in turns else ""))

    def pdl_replays(self, runner, fn, b, weights, caches, scratch, words, memory, x, label) -> dict:
        """A PDL variant's step graph (``runner``, edges rewritten through the programmatic port)
        beside the same packages captured with the launch-order port and with plain edges: each
        graph's replay time, rewritten edges, and whether its step equals ``runner``'s."""
        import torch

        from muse_spark.plugins.pdl import PDL_KERNELS
        from muse_spark.runtime.cuda_graph import CUDAGraphStep

        a, dev = self.a, self.device
        want = runner(*x)
        res = {"programmatic": {"edges": runner.programmatic_edges, "kernels": runner.graph_kernels,
                                "replay": time_fn(runner.graph.replay, dev, a.iters)}}
        for name, kw in (("launch_order", dict(programmatic=PDL_KERNELS, pdl_port="launch_order")),
                         ("plain_edges", dict(programmatic=()))):
            other = CUDAGraphStep(fn, b, weights, caches, scratch, dev, memory=memory, markov_words=words, **kw)
            res[name] = {"edges": other.programmatic_edges, "equals": bool(torch.equal(other(*x), want)),
                         "replay": time_fn(other.graph.replay, dev, a.iters)}
        self.log(f"{label} B={b}: {res['programmatic']['edges']} of the graph's edges into its "
                 f"{res['programmatic']['kernels']} kernels programmatic; replay " + ", ".join(
                     f"{k} {v['replay']['median_ms']:.3f} ms" for k, v in res.items()))
        return res
