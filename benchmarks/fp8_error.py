#!/usr/bin/env python3
"""How far an FP8 target's logits are from its bf16 target's (docs/fp8.md): the checkpoint quantized with
``muse-spark quantize`` (per-channel absmax scales by default), both targets run over the same prompts, and
per position the largest |Δ logit|, KL(bf16 ‖ FP8) and whether the greedy tokens agree.

    python benchmarks/fp8_error.py --pair PAIR [--prompts 64 --prompt-len 64 --device cuda]
    python benchmarks/fp8_error.py --preset tiny                      # a tiny pair made here (CPU)

The prompts are drawn from the pair's draft vocabulary (``builder.pair.random_prompts``, seeded). The FP8
target runs the projections' kernels of its device (on the CPU the W8A16 reference; on CUDA the W8A16
kernel for few rows and W8A8 for more: a prompt's rows are many, so W8A8 here). The figures go to
``benchmarks/results/`` in the common schema. They describe these weights only: a pair made by
``make-pair`` has random weights, so this says the quantized path is sound, not how a trained model fares.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402  (benchmarks/results.py, beside this file)


def target_logits(target, prompts: list[list[int]], device, batch: int) -> torch.Tensor:
    """Every position's logits (float32, [prompts, length, vocab]) of ``target`` over ``prompts`` (one length)."""
    length = len(prompts[0])
    out = []
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            chunk = torch.tensor(prompts[i:i + batch], device=device)
            b = chunk.shape[0]
            cache = target.allocate_cache(b, length, device)
            pos = torch.arange(length, device=device).expand(b, length)
            h, _ = target(chunk, pos, torch.arange(b, device=device), cache, length)
            out.append(target.logits(h).float().cpu())
    return torch.cat(out)


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """The error figures of ``got``'s logits against ``ref``'s (both [..., vocab])."""
    ref, got = ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    diff = (ref - got).abs()
    return {"positions": ref.shape[0], "max_abs_logit_error": float(diff.max()),
            "mean_abs_logit_error": float(diff.mean()), "logit_scale": float(ref.abs().max()),
            "mean_kl_nats": float(kl.mean()), "max_kl_nats": float(kl.max()),
            "greedy_agreement": float((ref.argmax(-1) == got.argmax(-1)).float().mean())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--pair", type=Path, help="a bf16 pair (target/, draft/): make-pair's, or a real one")
    src.add_argument("--preset", help="make a pair of this preset here (tiny: seconds on a CPU)")
    p.add_argument("--acceptance", type=float, default=0.8, help="--preset: the pair's draft agreement")
    p.add_argument("--scheme", choices=["per-channel", "per-tensor"], default="per-channel")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="prompts per forward")
    p.add_argument("--device", default="auto", help="cuda, cpu, or auto (cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", type=Path, default=None, help="where the FP8 checkpoint is written (default: a "
                                                                 "temporary folder)")
    p.add_argument("--out-dir", type=Path, default=results.RESULTS, help="where the result goes (the common schema)")
    a = p.parse_args(argv)
    if a.prompts < 1 or a.prompt_len < 1 or a.batch < 1:
        p.error("--prompts, --prompt-len and --batch must be positive")

    from muse_spark.builder.pair import draft_token_ids, make_pair, random_prompts
    from muse_spark.builder.quantize import quantize_checkpoint
    from muse_spark.checkpoint import load_target

    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if a.device == "auto" else a.device))
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        work = a.work_dir or Path(tmp)
        pair = a.pair
        if pair is None:
            pair = work / "pair"
            print(f"[fp8-error] making a {a.preset} pair in {pair}", flush=True)
            make_pair(pair, a.preset, acceptance=a.acceptance, seed=a.seed)
        fp8_dir = work / "fp8-target"
        print(f"[fp8-error] quantizing {pair / 'target'} ({a.scheme}) into {fp8_dir}", flush=True)
        quantize_checkpoint(pair / "target", fp8_dir, scheme=a.scheme, overwrite=True, log=lambda s: None)
        prompts = random_prompts(draft_token_ids(pair), a.prompts, a.prompt_len, seed=a.seed)
        print(f"[fp8-error] {a.prompts} prompts of {a.prompt_len} tokens on {device}", flush=True)
        ref = target_logits(load_target(pair / "target", device=device), prompts, device, a.batch)
        got = target_logits(load_target(fp8_dir, device=device), prompts, device, a.batch)
    res = compare(ref, got)
    res["seconds"] = time.time() - t0
    doc = results.record("fp8-error", {"pair": str(a.pair) if a.pair else None, "preset": a.preset,
                                       "scheme": a.scheme, "prompts": a.prompts, "prompt_len": a.prompt_len,
                                       "seed": a.seed, "device": str(device)}, res,
                         device=None if device.type == "cuda" else results.cpu_name())
    print(f"[fp8-error] {res['positions']} positions: max |Δ logit| {res['max_abs_logit_error']:.4g} (logits up to "
          f"{res['logit_scale']:.3g}), mean KL(bf16‖fp8) {res['mean_kl_nats']:.3g} nats (max "
          f"{res['max_kl_nats']:.3g}), greedy tokens agree at {res['greedy_agreement']:.4f}")
    print(f"result: {results.write(doc, a.out_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
