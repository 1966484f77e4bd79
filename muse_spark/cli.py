"""``muse-spark``: the command-line front end.

    muse-spark make-tiny OUT [--kind random|agreeing] [--seed N]
    muse-spark make-pair OUT [--preset tiny|muse-spark-8b] [--acceptance P] [--confidence informative|random]
    muse-spark build --target DIR --draft DIR --out DIR [--backend eager] [--device cpu|cuda]
    muse-spark export-onnx --target DIR --draft DIR --out DIR [--max-batch 8] [--max-seq 1024]
    muse-spark quantize --target DIR --out DIR [--draft DIR --draft-out DIR] [--scheme per-channel|per-tensor]
        [--calibrate N | --calibration-prompts FILE]
    muse-spark generate (--engine DIR | --target DIR --draft DIR) (--prompt TEXT | --prompt-ids 1,2,3)
    muse-spark triton-repo --engine DIR --out REPO [--model-name muse_spark] [--instances N]
    muse-spark serve --repo REPO [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002] [--host 127.0.0.1]
    muse-spark serve-openai --engine DIR [--port 8000] [--host 127.0.0.1] [--served-model-name NAME]
    muse-spark calibrate --engine DIR [--batches 1,8,32] [--schedule confidence] [--confidence-threshold X]
    muse-spark bench [--preset muse-spark-8b|tiny] [--batches 1,8,32] [--out-dir D] [--markdown F]
    muse-spark bench-serving (--engine DIR | --pair DIR) --mode inprocess|triton-http|triton-grpc --concurrency N
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from pathlib import Path

from muse_spark.serving.server import _positive, add_kv_pool_arguments, kv_pool  # (argparse types, said once)
from muse_spark.options import BUILD_CACHE_ENV


def _die(msg: str, code: int = 2) -> int:
    print(f"muse-spark: error: {msg}", file=sys.stderr)
    return code


# ---- make-tiny ------------------------------------------------------------------------------
def cmd_make_tiny(a) -> int:
    from muse_spark.builder.tiny import make_tiny

    info = make_tiny(a.out, kind=a.kind, seed=a.seed, gamma=a.gamma, head_type=a.head_type, dtype=a.dtype)
    print(f"wrote {a.kind} tiny pair: {info['out']}/target and {info['out']}/draft (γ={a.gamma})")
    acc = measure_greedy_acceptance(Path(a.out) / "target", Path(a.out) / "draft")
    print(
        f"built for acceptance: greedy drafts accept {acc['mean_accepted']:.2f} of γ={a.gamma} tokens per step "
        f"on average ({acc['mean_emitted']:.2f} emitted per step; {acc['steps']} steps over {acc['prompts']} "
        f"prompts, measured now with the eager runtime)"
    )
    return 0


def measure_greedy_acceptance(target_dir, draft_dir, prompts=((1, 2, 3), (40, 41), (100,), (7, 7, 7, 7))) -> dict:
    from muse_spark.runtime import EagerEngine, Generator, SamplingParams

    engine = EagerEngine.from_checkpoints(target_dir, draft_dir, max_batch=len(prompts), max_seq=128)
    reqs = Generator(engine).generate([list(p) for p in prompts], SamplingParams(max_tokens=48, ignore_eos=True))
    steps = [s for r in reqs for s in r.steps]
    return {
        "mean_accepted": sum(s.accepted for s in steps) / max(len(steps), 1),
        "mean_emitted": sum(len(s.emitted) for s in steps) / max(len(steps), 1),
        "steps": len(steps),
        "prompts": len(prompts),
    }


# ---- make-pair ------------------------------------------------------------------------------
def cmd_make_pair(a) -> int:
    from muse_spark.builder.pair import PairError, draft_token_ids, make_pair, random_prompts

    try:
        info = make_pair(a.out, a.preset, acceptance=a.acceptance, confidence=a.confidence, seed=a.seed,
                         device=a.device, overwrite=a.overwrite, log=lambda s: print(s, flush=True))
    except PairError as e:
        return _die(str(e))
    out = Path(a.out)
    print(f"wrote {out}/target and {out}/draft: {info['draft_tokens_disagreeing']} of {info['draft_vocab']} draft "
          f"tokens disagree with the target (agreement {info['agreement']:.3f}, expected "
          f"{info['expected_accepted_per_step']:.2f} accepted drafts per greedy step of γ={info['gamma']}); peak host "
          f"memory {info['peak_host_memory_gib']:.2f} GiB")
    measure = a.measure if a.measure is not None else (a.preset == "tiny" or info["device"].startswith("cuda"))
    if not measure:
        print("(acceptance not measured: --measure runs the eager engine over the pair)")
        return 0
    from muse_spark.runtime import EagerEngine
    from muse_spark.runtime.acceptance import measure_acceptance

    engine = EagerEngine.from_checkpoints(out / "target", out / "draft", device=info["device"],
                                          max_batch=a.prompts, max_seq=a.max_tokens + 64)
    prompts = random_prompts(draft_token_ids(out), a.prompts, 16, seed=a.seed)
    report = {}
    for name, temp in (("greedy", 0.0), ("temperature_1", 1.0)):
        m = report[name] = measure_acceptance(engine, prompts, a.max_tokens, temperature=temp, seed=a.seed)
        per_pos = " ".join("-" if x is None else f"{x:.2f}" for x in m["acceptance_per_position"])
        print(f"measured ({name.replace('_', ' ')}, {a.prompts} prompts × {a.max_tokens} tokens): "
              f"{m['mean_accepted_per_step']:.2f} accepted drafts per step; per position {per_pos}")
        c = m.get("confidence")
        if c:
            auroc = "n/a" if c["auroc"] is None else f"{c['auroc']:.3f}"
            fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
            print(f"  confidence: mean {fmt(c['mean_when_accepted'])} where accepted, {fmt(c['mean_when_rejected'])} "
                  f"where rejected; AUROC {auroc}")
    info["measured"] = report
    (out / "pair.json").write_text(json.dumps(info, indent=1) + "\n")
    return 0


# ---- build ----------------------------------------------------------------------------------
def cmd_build(a) -> int:
    from muse_spark.builder.build import build_engine

    aoti = {"plugins": a.plugins} if a.plugins is not None else {}
    if a.build_cache is not None and a.backend == "aoti":  # (the other backends compile no packages)
        aoti["build_cache"] = a.build_cache
    if a.verify_widths is not None:
        if a.backend != "aoti":
            print("error: --verify-widths applies to --backend aoti (the eager engine verifies any number of drafts)",
                  file=sys.stderr)
            return 2
        aoti["verify_widths"] = a.verify_widths
    elif a.backend == "aoti" and a.schedule == "confidence":
        aoti["verify_widths"] = "default"
    if a.prefill_batch is not None:
        if a.backend != "aoti":
            print("error: --prefill-batch applies to --backend aoti (the eager engine prefills any number of chunks "
                  "at once)", file=sys.stderr)
            return 2
        aoti["prefill_batch"] = a.prefill_batch  # (build_engine checks it against max_batch before loading)
    if a.kv_cache_tokens is not None:
        if a.backend != "aoti":
            print("error: --kv-cache-tokens at build applies to --backend aoti (an eager engine takes its pool when "
                  "it is loaded: generate/serve-openai --kv-cache-tokens)", file=sys.stderr)
            return 2
        from muse_spark.engine_format import EngineError, kv_pool_blocks

        try:
            aoti["kv_pool"] = [kv_pool_blocks(a.kv_cache_tokens, a.kv_block_size, a.max_seq), a.kv_block_size]
        except EngineError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    build_engine(a.target, a.draft, a.out, backend=a.backend, device=a.device, max_batch=a.max_batch,
                 max_seq=a.max_seq, dtype=a.dtype, tp=a.tp, kv_cache_dtype=a.kv_cache_dtype, **aoti)
    if a.schedule is not None:
        from muse_spark.runtime.calibrate import write_schedule
        from muse_spark.schedule import Schedule

        write_schedule(a.out, Schedule(a.schedule))
        print(f"schedule: {a.schedule} (`muse-spark calibrate --engine {a.out}` adds the measured cost table)")
    print(f"engine: {a.out}")
    return 0


# ---- quantize -------------------------------------------------------------------------------
def calibration_prompts(a) -> list[list[int]] | None:
    """``quantize``'s calibration prompts (token ids): the lines of ``--calibration-prompts`` through the target's
    tokenizer.json, or ``--calibrate N`` prompts of ``--calibration-len`` tokens drawn from the target's vocabulary;
    None: no calibration (dynamic activation scales)."""
    from muse_spark.builder.quantize import QuantizeError

    if a.calibrate < 0 or a.calibration_len < 1 or a.calibration_tokens < 1:
        raise QuantizeError("--calibrate takes a count ≥ 0, --calibration-len and --calibration-tokens counts ≥ 1")
    if a.calibration_prompts:
        from muse_spark.runtime import load_tokenizer

        tok = load_tokenizer(Path(a.target) / "tokenizer.json")
        if tok is None:
            raise QuantizeError(f"--calibration-prompts: {a.target} has no tokenizer.json to encode them with; use "
                                "--calibrate N (random prompts) instead")
        try:
            lines = [line for line in Path(a.calibration_prompts).read_text().splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise QuantizeError(f"--calibration-prompts {a.calibration_prompts}: cannot read it ({e})") from None
        if not lines:
            raise QuantizeError(f"--calibration-prompts {a.calibration_prompts} has no prompt (one a line)")
        return [tok.encode(line).ids for line in lines[: a.calibrate or None]]
    if not a.calibrate:
        return None
    from muse_spark.builder.pair import random_prompts
    from muse_spark.config import load_config

    return random_prompts(list(range(load_config(a.target).vocab_size)), a.calibrate, a.calibration_len, seed=0)


def cmd_quantize(a) -> int:
    from muse_spark.builder.quantize import quantize_pair

    def log(s):
        print(s, flush=True)

    prompts = calibration_prompts(a)
    measure = None
    if prompts is not None:
        def measure():
            from muse_spark.runtime.activation_scales import measure_input_amax

            return measure_input_amax(a.target, a.draft, prompts, a.calibration_tokens, a.device, log)

    quantize_pair(a.target, a.out, draft=a.draft, draft_out=a.draft_out, scheme=a.scheme, overwrite=a.overwrite,
                  log=log, measure_input_amax=measure)
    return 0


# ---- export-onnx ----------------------------------------------------------------------------
def cmd_export_onnx(a) -> int:
    from muse_spark.builder.onnx_export import export_onnx_dir, new_out_dir
    from muse_spark.checkpoint import load_pair

    out = new_out_dir(a.out, a.max_batch)
    target, draft = load_pair(a.target, a.draft, a.dtype, "cpu", a.kv_cache_dtype)
    section = export_onnx_dir(target, draft, out, max_batch=a.max_batch, max_seq=a.max_seq,
                              log=lambda m: print(f"[export-onnx] {m}", file=sys.stderr, flush=True))
    print(f"onnx graphs: {out} ({len(section['graphs'])} parts; their inputs and outputs: {out / 'onnx.json'})")
    return 0


# ---- generate -------------------------------------------------------------------------------
_ID_SPACE = " \t\r\n"


def _parse_ids(text: str) -> list[int]:
    """``--prompt-ids``: comma-separated ASCII decimal token ids, spaces allowed around them;
    a negative id, an empty entry or any other character is an error."""
    if text.strip(_ID_SPACE) == "":
        raise ValueError("--prompt-ids is empty: give comma-separated token ids such as 1,2,3")
    ids = []
    for i, entry in enumerate(text.split(",")):
        s = entry.strip(_ID_SPACE)
        if s == "":
            raise ValueError(f"--prompt-ids has an empty entry (entry {i + 1} of {text!r}): give comma-separated "
                             "token ids such as 1,2,3")
        if s[0] == "-" and s[1:].isascii() and s[1:].isdigit():
            raise ValueError(f"--prompt-ids: token ids are integers >= 0, got {s}")
        if not (s.isascii() and s.isdigit()):  # (int() would also take other scripts' digits, + and 1_000)
            raise ValueError(f"--prompt-ids must be comma-separated integers (ASCII digits 0-9), got {s!r} in {text!r}")
        if len(s.lstrip("0")) > 18:
            raise ValueError(f"--prompt-ids: token id {s[:19]}... ({len(s)} digits) is outside the vocabulary")
        ids.append(int(s))
    return ids


def _utf8_text(text: str, option: str) -> str:
    """Command-line text that was not valid UTF-8 reaches Python as lone surrogates: refuse it clearly."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = ord(text[e.start])
        what = f"byte 0x{ch - 0xDC00:02x}" if 0xDC80 <= ch <= 0xDCFF else f"code point U+{ch:04X}"
        raise ValueError(f"{option} is not valid UTF-8 text ({what} at character {e.start}); "
                         "pass token ids with --prompt-ids instead") from None
    return text


def cmd_generate(a) -> int:
    from muse_spark.runtime import EagerEngine, Generator, RequestError, SamplingParams, load_engine, load_tokenizer

    if bool(a.engine) == bool(a.target or a.draft):
        return _die("give either --engine DIR or both --target DIR and --draft DIR")
    if not a.engine and not (a.target and a.draft):
        return _die("--target and --draft must be given together")
    if (a.prompt is None) == (a.prompt_ids is None):
        return _die("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    # The prompt is checked before the (slower) engine load.
    text = _utf8_text(a.prompt, "--prompt") if a.prompt is not None else None
    ids = _parse_ids(a.prompt_ids) if a.prompt_ids is not None else None
    if a.kv_cache_dtype is not None and a.engine:
        return _die("--kv-cache-dtype is for --target/--draft: an engine's KV cache is chosen when it is built "
                    "(muse-spark build --kv-cache-dtype)")
    if a.tp is None:  # an engine built for ranks runs over them; anything else in this process
        from muse_spark.engine_format import built_world

        a.tp = built_world(a.engine) if a.engine else 1
    if a.tp != 1:
        if a.kv_cache_dtype is not None:
            return _die(f"--kv-cache-dtype with --tp {a.tp}: build the engine with both (muse-spark build "
                        f"--kv-cache-dtype {a.kv_cache_dtype} --tp {a.tp}) and run it with --engine")
        return _generate_tensor_parallel(a, text, ids)
    if a.engine:
        engine = load_engine(a.engine, device=a.device, dtype=a.dtype, **kv_pool(a))
    else:
        engine = EagerEngine.from_checkpoints(a.target, a.draft, device=a.device or "cpu", dtype=a.dtype, max_batch=1,
                                              kv_cache_dtype=a.kv_cache_dtype)
    tok = load_tokenizer(engine.tokenizer_path)
    if text is not None:
        if tok is None:
            return _die("this engine has no tokenizer: use --prompt-ids")
        prompt = tok.encode(text).ids
    else:
        prompt = ids
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed, ignore_eos=a.ignore_eos,
                            top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, repetition_penalty=a.repetition_penalty,
                            presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                            min_tokens=a.min_tokens, logprobs=a.logprobs)
    if a.schedule is not None or a.confidence_threshold is not None:
        engine.set_schedule(engine.schedule.replace(mode=a.schedule, threshold=a.confidence_threshold))
    gen = Generator(engine)
    if a.n != 1 or a.stop:
        if a.stop and tok is None:
            return _die("this engine has no tokenizer: --stop matches text")
        return _generate_samples(a, engine, gen, tok, prompt, params)
    try:
        if a.stream:
            req = gen.add(prompt, params)
            for chunk in gen.iter_request(req):
                if not a.json:
                    piece = tok.decode(chunk, skip_special_tokens=True) if tok else " ".join(map(str, chunk)) + " "
                    print(piece, end="", flush=True)
            if not a.json:
                print()
        else:
            req = gen.generate([prompt], params)[0]
    except RequestError as e:
        return _die(str(e))
    stats = req.stats(engine.gamma)
    text = tok.decode(req.output, skip_special_tokens=True) if tok else None
    if a.json:
        print(json.dumps({
            "output_ids": req.output,
            "text": text,
            "steps": [{"position": s.position, "draft_ids": s.draft_ids, "accepted": s.accepted, "emitted": s.emitted,
                       "verified": engine.gamma if s.verified is None else s.verified,
                       "confidence": s.confidence}
                      for s in req.steps],
            "stats": stats,
            **({"logprobs": [{"token": t, "logprob": lp, "top": [[i, v] for i, v in top]}
                             for t, (lp, top) in zip(req.output, req.logprobs)]} if a.logprobs is not None else {}),
        }))
    else:
        if not a.stream:
            print(text if text is not None else " ".join(map(str, req.output)))
        per_pos = " ".join(f"{x:.2f}" for x in stats["acceptance_per_position"])
        print(
            f"acceptance: {stats['accepted_draft_tokens']} draft tokens accepted over {stats['steps']} steps "
            f"(mean {stats['mean_accepted_per_step']:.2f} of γ={engine.gamma}, "
            f"{stats['mean_emitted_per_step']:.2f} tokens per step); per position: {per_pos}"
        )
        if engine.schedule.on:
            print(f"schedule {engine.schedule.mode}: {stats['mean_verified_per_step']:.2f} of γ={engine.gamma} drafts "
                  "verified per step on average")
        print(f"generated {stats['generated_tokens']} tokens in {stats['seconds']:.3f}s "
              f"({stats['tokens_per_second']:.1f} tokens/s), finish reason: {stats['finish_reason']}")
    return 0


def _generate_samples(a, engine, gen, tok, prompt: list[int], params) -> int:
    """``generate --n N`` and/or ``--stop STR``: N samples of the prompt (seeds seed, seed + 1, …) run
    together (sharing the prompt's prefill), each cut at the first stop string in its text (the text
    ends just before it; the ids at the token that completed it)."""
    import dataclasses

    from muse_spark.runtime import RequestError
    from muse_spark.serving.openai_protocol import TextStream

    if a.stream and a.n != 1:
        return _die("--stream shows one sample: leave out --n or --stream")
    samples = [dataclasses.replace(params, seed=(params.seed + i) % 2**64) for i in range(a.n)]
    texts = [TextStream(tok, tuple(a.stop)) if tok is not None else None for _ in samples]
    try:
        reqs = [gen.add(prompt, p) for p in samples]
    except RequestError as e:
        return _die(str(e))
    while not all(r.finished for r in reqs):
        gen.step()
        for r, t in zip(reqs, texts):
            if t is None:
                continue
            t.feed(r.output, final=r.finished)
            if t.stopped and not r.finished:
                gen.cancel(r, "stop")  # (a stop string: the request ends here)
            if a.stream and not a.json:
                piece = t.take(final=r.finished)
                print(piece, end="", flush=True)
    if a.stream and not a.json:
        print()
    out = []
    for r, t in zip(reqs, texts):
        n = t.tokens if t is not None and t.stopped else len(r.output)
        ids = r.output[:n]
        text = (t.text if t.stopped else tok.decode(ids, skip_special_tokens=True)) if t is not None else None
        out.append({"output_ids": ids, "text": text, "finish_reason": r.finish_reason, "stats": r.stats(engine.gamma),
                    **({"logprobs": [{"token": tk, "logprob": lp, "top": [[i, v] for i, v in top]}
                                     for tk, (lp, top) in zip(ids, r.logprobs)]} if a.logprobs is not None else {})})
    if a.json:
        print(json.dumps(out[0] if a.n == 1 else {"samples": out,
                                                   "shared_prefill_tokens": gen.shared_prefill_tokens}))
    elif not a.stream:
        for i, o in enumerate(out):
            body = o["text"] if o["text"] is not None else " ".join(map(str, o["output_ids"]))
            print(body if a.n == 1 else f"[{i}] {body}  ({o['finish_reason']})")
    return 0


def _generate_tensor_parallel(a, text, ids) -> int:
    """``generate --tp N``: the pair split across N ranks (processes; runtime/tensor_parallel.py)."""
    import functools

    from muse_spark.config import MuseSpark1xConfig
    from muse_spark.engine_format import read_manifest
    from muse_spark.runtime import SamplingParams, load_tokenizer
    from muse_spark.runtime import tensor_parallel as tp
    from muse_spark.sharding import check_engine_split

    try:
        if a.engine:  # (an eager engine directory: split at load; or one built for exactly this many ranks)
            m = read_manifest(a.engine)
            check_engine_split(m, a.tp, a.engine)
            tok_path = Path(a.engine) / (m.get("tokenizer") or "tokenizer.json")
        else:
            tp.check_split(MuseSpark1xConfig.from_dict(json.loads((Path(a.target) / "config.json").read_text()),
                                                       f"{a.target}/config.json"), a.tp)
            tok_path = Path(a.target) / "tokenizer.json"
    except tp.TensorParallelError as e:
        return _die(str(e))
    tok = load_tokenizer(tok_path if tok_path.is_file() else None)
    if text is not None and tok is None:
        return _die("this pair has no tokenizer: use --prompt-ids")
    prompt = tok.encode(text).ids if text is not None else ids
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed, ignore_eos=a.ignore_eos)
    if a.engine:
        (r,) = tp.launch(a.tp, tp.lead_or_follow, a.engine, None,
                         functools.partial(tp.generate_lead, prompts=[prompt], params=[params]), a.device,
                         device=a.device or "cpu")
    else:
        (r,) = tp.generate(a.target, a.draft, [prompt], [params], a.tp, device=a.device or "cpu", max_batch=1)
    out_text = tok.decode(r["output"], skip_special_tokens=True) if tok else None
    if a.json:
        print(json.dumps({"output_ids": r["output"], "text": out_text, "stats": r["stats"], "tp": a.tp}))
    else:
        print(out_text if out_text is not None else " ".join(map(str, r["output"])))
        st = r["stats"]
        print(f"tensor parallel over {a.tp} ranks: {st['mean_accepted_per_step']:.2f} accepted drafts per step, "
              f"{st['generated_tokens']} tokens in {st['seconds']:.3f}s")
    return 0


# ---- calibrate --------------------------------------------------------------------------------
def cmd_calibrate(a) -> int:
    from muse_spark.runtime import load_engine
    from muse_spark.runtime.calibrate import cost_table, write_schedule

    engine = load_engine(a.engine, device=a.device)
    batches = a.batches or sorted({1, *[b for b in (2, 4, 8, 16, 32, 64) if b < engine.max_batch], engine.max_batch})
    print(f"timing the step of {a.engine} ({engine.backend}, {engine.device}) at batch {batches}, "
          f"verifying 0 … {engine.gamma} drafts per request", flush=True)
    table = cost_table(engine, batches, iters=a.iters, log=lambda s: print(s, flush=True))
    schedule = engine.schedule.replace(mode=a.schedule, threshold=a.confidence_threshold, cost_ms=table)
    write_schedule(a.engine, schedule)
    print(f"wrote the cost table and schedule {schedule.mode!r} (threshold {schedule.threshold}) into "
          f"{a.engine}/manifest.json")
    return 0


# ---- bench ----------------------------------------------------------------------------------
def cmd_bench(a) -> int:
    """The repository's ``benchmarks/<a.script>`` (not part of the installed package), run in this process:
    ``bench`` runs step.py, ``bench-serving`` bench_serving.py."""
    import runpy

    script = Path(__file__).resolve().parents[1] / "benchmarks" / a.script
    if not script.is_file():
        return _die(f"muse-spark {a.cmd} runs the repository's benchmarks/{a.script}, and there is none at {script}: "
                    "the package is installed without its repository. Run it from a checkout "
                    f"(`pip install -e .`, or `python benchmarks/{a.script}` there)")
    return runpy.run_path(str(script), run_name=f"benchmarks_{script.stem}")["main"](a.bench_args,
                                                                                   prog=f"muse-spark {a.cmd}")


# ---- main -----------------------------------------------------------------------------------
def _positive_list(text: str) -> list[int]:
    """``1,8,32`` → [1, 8, 32]: comma-separated positive integers (argparse's type)."""
    return [_positive(part) for part in text.split(",")]


def add_kv_cache_dtype_argument(p, when: str = "") -> None:
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default=None,
                   help=f"{when}the target's KV cache: auto (the compute dtype) or fp8 (E4M3 with each layer's "
                        "k_scale/v_scale from the checkpoint, else 1: half the cache memory). Default: as the "
                        "target checkpoint's quantization_config says (kv_cache_scheme), else auto")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="muse-spark", description="Muse Spark DSpark deployment backend")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("make-tiny", help="write a tiny target + draft checkpoint pair")
    t.add_argument("out")
    t.add_argument("--kind", choices=["random", "agreeing"], default="agreeing")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--gamma", type=int, default=5)
    t.add_argument("--head-type", choices=["vanilla", "gated", "rnn"], default="vanilla")
    t.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    t.set_defaults(fn=cmd_make_tiny)

    m = sub.add_parser("make-pair", help="write a target + draft pair at a preset's shapes whose drafts agree with "
                                         "the target at a chosen rate")
    m.add_argument("out")
    m.add_argument("--preset", choices=["muse-spark-8b", "tiny"], default="tiny")
    m.add_argument("--acceptance", type=float, default=0.8,
                   help="the rate P at which a drafted token agrees with the target (greedy: about sum_k P^k "
                        "accepted drafts per step)")
    m.add_argument("--confidence", choices=["informative", "random"], default="informative",
                   help="informative: the confidence head predicts acceptance; random: it carries no information")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the weights are generated (auto: the GPU when there is one)")
    m.add_argument("--overwrite", action="store_true", help="replace OUT/target and OUT/draft if they exist")
    m.add_argument("--measure", action=argparse.BooleanOptionalAction, default=None,
                   help="measure the acceptance with the eager engine afterwards (default: for the tiny preset "
                        "and on a GPU)")
    m.add_argument("--prompts", type=_positive, default=64, help="prompts of the measurement")
    m.add_argument("--max-tokens", type=_positive, default=64, help="tokens generated per prompt in the measurement")
    m.set_defaults(fn=cmd_make_pair)

    b = sub.add_parser("build", help="build an engine directory from a checkpoint pair")
    b.add_argument("--target", required=True)
    b.add_argument("--draft", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--backend", default="eager", choices=["eager", "aoti", "tensorrt", "migraphx"])
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    b.add_argument("--max-batch", type=int, default=8)
    b.add_argument("--max-seq", type=int, default=1024)
    b.add_argument("--dtype", default=None, help="override the checkpoint's torch_dtype")
    b.add_argument("--tp", type=int, default=1, metavar="N",
                   help="write the target as N tensor-parallel ranks' weight files (eager; run with --tp N)")
    b.add_argument("--plugins", choices=["auto", "inline", "triton"], default=None,
                   help="aoti: the plugin kernels compiled in. auto (default): the Triton kernels on CUDA, falling "
                        "back to the reference functions if they fail to compile; inline: the reference functions")
    b.add_argument("--schedule", choices=["off", "confidence"], default=None,
                   help="the engine's default verification policy (confidence: each step verifies the drafts the "
                        "confidence head expects accepted; an aoti engine gets verification widths for it)")
    add_kv_pool_arguments(b, fraction=False)
    add_kv_cache_dtype_argument(b)
    b.add_argument("--verify-widths", type=_positive_list, default=None, metavar="K,K",
                   help="aoti: also compile steps verifying only the first K drafts of each request, for "
                        "confidence scheduling (default with --schedule confidence: 1 and about γ/2)")
    b.add_argument("--prefill-batch", type=_positive, default=None, metavar="P",
                   help="aoti: also compile a prefill for up to P prompt chunks at once (one pass over the weights "
                        "for a round of P requests' chunks; default 1: one chunk a call; 8 prefilled 32 short "
                        "prompts 2.7x faster on an H100, docs/performance.md)")
    b.add_argument("--build-cache", default=None, metavar="DIR|off",
                   help="aoti: the folder of compiled packages a build takes graphs compiled before from (same "
                        "shapes, options, sources and device; the weights are not in them) and stores new ones "
                        f"in; off: compile every graph. Default: ${BUILD_CACHE_ENV}, else "
                        "~/.cache/muse-spark/packages")
    b.set_defaults(fn=cmd_build)

    q = sub.add_parser("quantize", help="write the FP8 (E4M3) checkpoint of a bf16/fp16/fp32 target (and draft): "
                                        "decoder-layer projections in float8 with absmax scales (docs/fp8.md)")
    q.add_argument("--target", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--draft", default=None)
    q.add_argument("--draft-out", default=None)
    q.add_argument("--scheme", choices=["per-channel", "per-tensor"], default="per-channel",
                   help="one scale per output channel (default) or per weight tensor")
    q.add_argument("--overwrite", action="store_true", help="write into --out/--draft-out even if they exist")
    q.add_argument("--calibrate", type=int, default=0, metavar="N",
                   help="static activation scales (input_scale) measured on N prompts run through the bf16 pair "
                        "(needs --draft): random token prompts, or the first N lines of --calibration-prompts; "
                        "default 0: dynamic per-token scales at run time")
    q.add_argument("--calibration-prompts", default=None, metavar="FILE",
                   help="calibration prompts, one a line, encoded with the target's tokenizer.json (all lines "
                        "without --calibrate)")
    q.add_argument("--calibration-len", type=int, default=64, help="tokens in a random calibration prompt")
    q.add_argument("--calibration-tokens", type=int, default=32, help="tokens generated from each calibration prompt")
    q.add_argument("--device", default="cpu", help="where the calibration runs (cpu, cuda)")
    q.set_defaults(fn=cmd_quantize)

    x = sub.add_parser("export-onnx", help="the engine's parts as ONNX graphs with muse_spark plugin nodes "
                                          "(the tensorrt backend's input)")
    x.add_argument("--target", required=True)
    x.add_argument("--draft", required=True)
    x.add_argument("--out", required=True)
    x.add_argument("--max-batch", type=int, default=8)
    x.add_argument("--max-seq", type=int, default=1024)
    x.add_argument("--dtype", default=None, help="override the checkpoint's torch_dtype")
    x.add_argument("--kv-cache-dtype", choices=["auto"], default=None,
                   help="auto: export a target whose checkpoint declares an FP8 KV cache with a cache of the "
                        "compute dtype (the graphs take no FP8 cache)")
    x.set_defaults(fn=cmd_export_onnx)

    g = sub.add_parser("generate", help="speculative generation")
    g.add_argument("--engine")
    g.add_argument("--target")
    g.add_argument("--draft")
    g.add_argument("--prompt")
    g.add_argument("--prompt-ids")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stream", action="store_true")
    g.add_argument("--json", action="store_true")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None)
    g.add_argument("--dtype", default=None)
    g.add_argument("--tp", type=int, default=None, metavar="N",
                   help="split the target across N ranks (processes: gloo on CPU, NCCL on CUDA). Default: the ranks "
                        "an engine was built for (build --tp N), else 1")
    add_kv_pool_arguments(g)
    add_kv_cache_dtype_argument(g, "with --target/--draft: ")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="keep the most likely tokens up to this mass")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this × the top probability")
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--min-tokens", type=int, default=0, help="hold stop tokens back until this many are out")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="--json: each output token's log-probability and the top N")
    g.add_argument("--n", type=_positive, default=1, metavar="N",
                   help="N samples of the prompt (seeds seed, seed+1, …; --json: one entry each under samples)")
    g.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="end the output just before this text (repeatable; matched across steps)")
    g.add_argument("--schedule", choices=["off", "confidence"], default=None,
                   help="verification policy for this run (default: the engine's): confidence verifies each "
                        "request's drafts while their cumulative confidence stays above the threshold")
    g.add_argument("--confidence-threshold", type=float, default=None)
    g.set_defaults(fn=cmd_generate)

    c = sub.add_parser("calibrate", help="time an engine's step against the drafts it verifies and record the "
                                         "cost table (and a schedule) in its manifest")
    c.add_argument("--engine", required=True)
    c.add_argument("--batches", type=_positive_list, default=None,
                   help="comma-separated batch sizes (default: powers of two up to the engine's max batch)")
    c.add_argument("--iters", type=_positive, default=5)
    c.add_argument("--schedule", choices=["off", "confidence"], default="confidence",
                   help="the engine's default schedule from now on (default: confidence)")
    c.add_argument("--confidence-threshold", type=float, default=None)
    c.add_argument("--device", choices=["cpu", "cuda"], default=None)
    c.set_defaults(fn=cmd_calibrate)

    from muse_spark.serving.repo import add_triton_repo_command  # light: no torch at parser time
    from muse_spark.serving.openai_server import add_serve_openai_command
    from muse_spark.serving.server import add_serve_command

    add_triton_repo_command(sub)
    add_serve_command(sub)
    add_serve_openai_command(sub)

    # Their options are benchmarks/step.py's and benchmarks/bench_serving.py's (`muse-spark bench --help`,
    # `muse-spark bench-serving --help`), passed to them as they are (no option prefix here, so that none
    # of them is taken for this parser's).
    k = sub.add_parser("bench", help="speculative-step latency: eager vs torch.compile vs aoti (GPU)",
                       add_help=False, prefix_chars="\0")
    k.add_argument("bench_args", nargs=argparse.REMAINDER)
    k.set_defaults(fn=cmd_bench, script="step.py")
    k = sub.add_parser("bench-serving", help="serving under load: throughput, TTFT, inter-token latency (in process "
                       "or through the Triton server)", add_help=False, prefix_chars="\0")
    k.add_argument("bench_args", nargs=argparse.REMAINDER)
    k.set_defaults(fn=cmd_bench, script="bench_serving.py")
    return p


def _os_error_message(e: OSError) -> str:
    """``<path>: permission denied`` for an OSError about a path; the error's own text otherwise."""
    if e.filename is None or not e.strerror:
        return str(e)
    reason = e.strerror[:1].lower() + e.strerror[1:]
    if e.errno == errno.ENOTDIR:
        reason += " (a part of the path is a file)"
    if e.filename2 is not None:
        return f"{e.filename} -> {e.filename2}: {reason}"
    return f"{e.filename}: {reason}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from safetensors import SafetensorError

    from muse_spark.checkpoint import CheckpointError
    from muse_spark.engine_format import EngineError

    try:
        return args.fn(args)
    except BrokenPipeError:  # the reader of stdout went away (`| head`): stop quietly
        try:  # (so the flush at exit does not fail again)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
    except OSError as e:  # permission denied, a missing path, a file where a folder should be, ...
        return _die(_os_error_message(e))
    except (CheckpointError, EngineError, ValueError) as e:  # (RequestError and the builders' errors are ValueErrors)
        return _die(str(e))
    except SafetensorError as e:  # (a weights file that could not be written or read)
        return _die(f"safetensors: {e}")
    except KeyboardInterrupt:
        return _die("interrupted", 130)


if __name__ == "__main__":
    sys.exit(main())
