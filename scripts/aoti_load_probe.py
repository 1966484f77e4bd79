#!/usr/bin/env python3
"""Probe loading an aoti engine's packages (the DESIGN.md §4 segfault; docs/aoti.md has the findings).

    python scripts/aoti_load_probe.py ENGINE_DIR [--gdb] [--constants-package PATH.pt2]

Runs each way of loading (and running) the engine's step package in its own
fresh Python process, with faulthandler on, and prints each exit code and the
tail of its output. A crash is located by the Python stack faulthandler prints
(load, run, or interpreter exit); with ``--gdb`` the first crashing case is
re-run under ``cuda-gdb`` (which also debugs host code) for a native backtrace.

``--constants-package`` also compiles (in this process) a package shaped like
the one the original probe used: weights baked in as constants, a Triton
``triton_op`` kernel, an input mutated in place; and runs the bare-load cases
on it too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import textwrap

CASES = {
    # The probe of DESIGN.md §4: nothing but torch imported, CUDA untouched, then load.
    "bare_load": """
        import torch, torch._inductor
        m = torch._inductor.aoti_load_package(STEP)
        print("loaded", flush=True)
    """,
    # The control that worked on the H200: libtorch (with libstdc++) loaded into the global scope.
    "rtld_global_env": """
        import os
        os.environ["TORCH_USE_RTLD_GLOBAL"] = "1"  # read by torch/__init__.py
        import torch, torch._inductor
        m = torch._inductor.aoti_load_package(STEP)
        print("loaded", flush=True)
    """,
    "bare_load_single_threaded": """
        import torch, torch._inductor
        m = torch._inductor.aoti_load_package(STEP, run_single_threaded=True)
        print("loaded", flush=True)
    """,
    "bare_load_then_del": """
        import gc, torch, torch._inductor
        m = torch._inductor.aoti_load_package(STEP)
        print("loaded", flush=True)
        del m; gc.collect(); torch.cuda.synchronize()
        print("released", flush=True)
    """,
    "cuda_init_then_load": """
        import torch, torch._inductor
        torch.cuda.init(); torch.empty(1, device="cuda"); torch.cuda.synchronize()
        m = torch._inductor.aoti_load_package(STEP, device_index=0)
        print("loaded", flush=True)
    """,
    # Which call crashes: reading the metadata alone.
    "metadata_only": """
        import torch
        md = torch._C._aoti.AOTIModelPackageLoader.load_metadata_from_package(STEP, "model")
        print("metadata", md, flush=True)
    """,
    # What the package's shared objects link against, next to the CUDA libraries torch maps.
    "inspect_so": """
        import glob, os, subprocess, tempfile, zipfile, torch
        d = tempfile.mkdtemp(); zipfile.ZipFile(STEP).extractall(d)
        for f in sorted(glob.glob(d + "/**", recursive=True)):
            print("  file", os.path.relpath(f, d), os.path.getsize(f) if os.path.isfile(f) else "")
        for so in glob.glob(d + "/**/*.so", recursive=True):
            print(subprocess.run(["ldd", so], capture_output=True, text=True).stdout)
            print(subprocess.run(["readelf", "-d", so], capture_output=True, text=True).stdout[:3000])
        torch.cuda.init(); torch.empty(1, device="cuda")
        libs = sorted({l.split()[-1] for l in open("/proc/self/maps") if ".so" in l and
                       any(k in l for k in ("cuda", "nvrtc", "torch", "c10", "stdc++", "nvJit"))})
        print("torch maps:", *libs, sep="\\n  ", flush=True)
    """,
    # The model .so loaded straight into its runner, without the package loader.
    "direct_runner": """
        import glob, os, tempfile, zipfile, torch
        d = tempfile.mkdtemp(); zipfile.ZipFile(STEP).extractall(d)
        so = [f for f in glob.glob(d + "/**/*.so", recursive=True)][0]
        r = torch._C._aoti.AOTIModelContainerRunnerCuda(so, 1, "cuda", os.path.dirname(so))
        print("loaded", so, flush=True)
    """,
    "import_triton_first": """
        import triton, torch, torch._inductor
        torch.cuda.init(); torch.empty(1, device="cuda")
        m = torch._inductor.aoti_load_package(STEP, device_index=0)
        print("loaded", flush=True)
    """,
    # The runtime's loader: libstdc++ promoted to the global scope first (docs/aoti.md).
    "runtime_loader": """
        import torch
        from muse_spark.runtime.aoti_engine import load_package
        m = load_package(STEP, torch.device("cuda"), single_threaded=True)
        print("loaded", flush=True)
    """,
    "engine_runtime": """
        from muse_spark.runtime import Generator, SamplingParams, load_engine
        e = load_engine(ENGINE)
        r = Generator(e).generate([[1, 2, 3]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
        print("generated", r.output, flush=True)
    """,
}


def make_constants_package(path: str) -> str:
    """A small CUDA package with constants, a triton_op kernel (when the plugin imports) and index_copy_."""
    import torch
    from torch import nn

    from muse_spark.plugins import dispatch
    from muse_spark.plugins.dispatch import plugin_impl

    try:
        import muse_spark.plugins.triton_ops  # noqa: F401
        impl = "triton"
    except Exception:
        impl = "inline"

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64, bias=False).to(torch.bfloat16)
            self.gate = nn.Parameter(torch.rand(64))
            self.norm_w = nn.Parameter(torch.ones(64, dtype=torch.bfloat16))

        def forward(self, x, cache, pos):
            branch = self.lin(x.to(torch.bfloat16))
            s, n = dispatch.gated_residual_add(x, branch, self.gate, self.norm_w, 1e-6, False, True, torch.bfloat16)
            cache.index_copy_(0, pos, n)
            return s

    m = M().cuda().eval().requires_grad_(False)
    args = (torch.randn(4, 64, device="cuda"), torch.zeros(16, 64, dtype=torch.bfloat16, device="cuda"),
            torch.tensor([1, 3, 5, 7], device="cuda"))
    try:
        with plugin_impl(impl):
            ep = torch.export.export(m, args, strict=False)
        torch._inductor.aoti_compile_and_package(ep, package_path=path)
    except Exception as e:
        if impl == "inline":
            raise
        print(f"triton plugin did not compile into a package ({type(e).__name__}); using the reference", flush=True)
        impl = "inline"
        with plugin_impl(impl):
            ep = torch.export.export(m, args, strict=False)
        torch._inductor.aoti_compile_and_package(ep, package_path=path)
    print(f"constants package ({impl} plugin) compiled: {path}", flush=True)
    return path


def run_case(name: str, engine: str, step: str, gdb: bool = False, extra_env: dict | None = None,
             label: str = "") -> int:
    code = f"ENGINE = {engine!r}\nSTEP = {step!r}\n" + textwrap.dedent(CASES[name])
    cmd = [sys.executable, "-X", "faulthandler", "-c", code]
    if gdb:
        cmd = ["cuda-gdb", "-q", "-batch", "-ex", "set pagination off", "-ex", "run", "-ex", "bt 40",
               "-ex", "x/6i $pc", "-ex", "info sharedlibrary", "--args", *cmd]
    try:
        env = dict(os.environ, **(extra_env or {}))
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
        rc, out = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = -999, f"timed out\n{e.stdout}\n{e.stderr}"
    tail = "\n".join(out.strip().splitlines()[-(150 if gdb or name == "inspect_so" else 40):])
    print(f"==== {name}{label}{' (cuda-gdb)' if gdb else ''}: exit code {rc}\n{textwrap.indent(tail, '    ')}", flush=True)
    return rc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("engine")
    p.add_argument("--gdb", action="store_true", help="re-run the first crashing case under cuda-gdb")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--constants-package", default=None)
    a = p.parse_args()
    import json

    crashed = None
    cases = a.cases.split(",") if os.path.isfile(os.path.join(a.engine, "manifest.json")) else []
    if cases:
        m = json.loads(open(os.path.join(a.engine, "manifest.json")).read())
        smallest = min(m["aoti"]["batch_buckets"])
        step = os.path.join(a.engine, m["aoti"]["graphs"][f"step_layer_b{smallest}"]["file"])
    else:
        print(f"no engine at {a.engine}: engine cases skipped", flush=True)
    for name in cases:
        rc = run_case(name, a.engine, step)
        if rc < 0 and rc != -999 and crashed is None:
            crashed = name
    if crashed:
        # The last libraries the dynamic loader opened before the crash.
        run_case(crashed, a.engine, step, extra_env={"LD_DEBUG": "files"}, label=" (LD_DEBUG=files)")
    if a.gdb and crashed and shutil.which("cuda-gdb"):
        run_case(crashed, a.engine, step, gdb=True)
    if a.constants_package:
        pkg = make_constants_package(a.constants_package)
        crashed = None
        for name in ("bare_load", "cuda_init_then_load"):
            rc = run_case(name, a.engine, pkg)
            if rc < 0 and rc != -999 and crashed is None:
                crashed = name
        if a.gdb and crashed and shutil.which("cuda-gdb"):
            run_case(crashed, a.engine, pkg, gdb=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
