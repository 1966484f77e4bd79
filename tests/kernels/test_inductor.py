"""Inductor's view of the plugin kernels: the launchers pass every kernel argument, the
re-emitted source defines each kernel again, and the mutation analysis finds exactly the buffers
the kernels write."""

from __future__ import annotations

import pytest
import torch

from kernels.kernel_utils import DEV, HAS_TRITON, INTERPRETED, cache_write_operands, launches, triton


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the kernels' modules import it)")
@pytest.mark.parametrize("form", ["linear", "linear_silu_mul", "linear_rope_table", "linear_w8a8",
                                  "linear_fp8_rope_table", "linear_w8a8_rope_table", "linear_w8a8_split",
                                  "linear_w8a8_rows", "norm_cache", "norm_cache_table", "norm", "rope_table",
                                  "gated_residual", "gated_residual_rows"])
def test_the_other_launchers_pass_every_kernel_argument(form):
    """``test_the_attention_launcher_passes_every_kernel_argument`` for the launchers the engines'
    ops call: each passes every parameter of its kernel, the arguments a form does not use included
    (the RoPE table's, PDL's), so Inductor's mutation analysis sees what the kernel writes."""
    from muse_spark.plugins.gated_residual import triton_kernel as gk
    from muse_spark.plugins.head_norm_rope import triton_kernel as hk
    from muse_spark.plugins.linear import triton_kernel as lk

    x4, v, positions, slots, (kc, vc) = cache_write_operands(B=2, S=3)
    x = torch.zeros(1, 6, 64, dtype=torch.bfloat16, device=DEV)
    w = torch.zeros(128, 64, dtype=torch.bfloat16, device=DEV)
    table = (torch.zeros(6, x4.shape[3] // 2, device=DEV), torch.zeros(6, x4.shape[3] // 2, device=DEV))
    w8, ones = w.to(torch.float8_e4m3fn), torch.ones(128, device=DEV)
    run = {
        "linear": lambda wrap: lk.launch_linear(x, w, wrap=wrap),
        "linear_silu_mul": lambda wrap: lk.launch_linear(x, w, True, wrap=wrap),
        "linear_rope_table": lambda wrap: lk.launch_linear_rope_table(x, w, positions, 5e5, 32, wrap=wrap),
        "linear_w8a8": lambda wrap: lk.launch_linear(x, w8, wrap=wrap, scale=ones, w8a8=True),
        "linear_fp8_rope_table": lambda wrap: lk.launch_linear_rope_table(x, w8, positions, 5e5, 32, wrap=wrap,
                                                                          scale=ones),
        "linear_w8a8_rope_table": lambda wrap: lk.launch_linear_rope_table(x, w8, positions, 5e5, 32, wrap=wrap,
                                                                           scale=ones, w8a8=True),
        "linear_w8a8_split": lambda wrap: lk.launch_linear(x, w8, wrap=wrap, scale=ones, w8a8=True, config=dict(
            BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2, SPLIT_K=2)),
        "linear_w8a8_rows": lambda wrap: lk.launch_linear(x, w8, wrap=wrap, scale=ones, w8a8=True, rows=(
            torch.zeros(6, 64, dtype=torch.float8_e4m3fn, device=DEV), torch.ones(6, device=DEV))),
        "norm_cache": lambda wrap: hk.launch_head_norm_rope_cache(x4, v, positions, 1e-6, 5e5, True, kc, vc,
                                                                  slots, wrap=wrap),
        "norm_cache_table": lambda wrap: hk.launch_head_norm_rope_cache(x4, v, positions, 1e-6, 5e5, True, kc, vc,
                                                                        slots, wrap=wrap, table=table),
        "norm": lambda wrap: hk.launch_head_norm_rope(x4, positions, 1e-6, 5e5, True, wrap=wrap),
        "rope_table": lambda wrap: hk.launch_rope_table(positions, 5e5, 32, wrap=wrap),
        "gated_residual": lambda wrap: gk.launch_gated_residual_add(
            torch.zeros(6, 64, device=DEV), torch.zeros(6, 64, dtype=torch.bfloat16, device=DEV),
            torch.zeros(64, device=DEV), torch.ones(64, dtype=torch.bfloat16, device=DEV), 1e-6, False, True,
            torch.bfloat16, wrap=wrap),
        "gated_residual_rows": lambda wrap: gk.launch_gated_residual_add(
            torch.zeros(6, 64, device=DEV), torch.zeros(6, 64, dtype=torch.bfloat16, device=DEV),
            torch.zeros(64, device=DEV), torch.ones(64, dtype=torch.bfloat16, device=DEV), 1e-6, False, True,
            torch.bfloat16, wrap=wrap, quantize=True),
    }
    calls = launches(run[form])
    # (W8A8: the rows' quantization, then the GEMM, unless the rows come quantized; split-K: the GEMM, then the sum)
    assert len(calls) == {"linear_w8a8_rows": 1, "linear_w8a8_split": 3}.get(form, 2 if "w8a8" in form else 1)
    for fn, passed in calls:
        assert passed == set(fn.arg_names), (fn.__name__, set(fn.arg_names) - passed)


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED,
                    reason="needs Triton's JIT functions (the interpreter's have no source to re-emit)")
def test_plugin_kernels_survive_inductors_source_re_emission(tmp_path):
    """AOTInductor compiles a user-defined Triton kernel from source it re-emits: the kernel's own
    source, the @triton.jit functions it calls and the module constants its body names, nothing
    else. A module constant used as a parameter's default is not among them: it once made every
    CUDA engine build fail (NameError in Inductor's autotuning block). Each plugin kernel's
    re-emitted source must define the kernel again in a fresh namespace (no GPU needed)."""
    import triton.language as tl
    from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code

    from muse_spark.plugins.attention import triton_kernel as attention
    from muse_spark.plugins.gated_residual import triton_kernel as gated_residual
    from muse_spark.plugins.head_norm_rope import triton_kernel as head_norm_rope
    from muse_spark.plugins.linear import triton_kernel as linear
    from muse_spark.plugins.markov import triton_kernel as markov

    kernels = [attention._partial_kernel, attention._combine_kernel, gated_residual._gated_residual_norm_kernel,
               head_norm_rope._head_norm_rope_kernel, head_norm_rope._head_norm_rope_cache_kernel,
               linear._linear_kernel, linear._quantize_rows_kernel, linear._split_sum_kernel, markov._markov_kernel]
    import importlib.util

    for kernel in kernels:
        src = user_defined_triton_kernel_transitive_closure_source_code(kernel)
        path = tmp_path / f"re_emitted{kernel.__name__}.py"  # (a file, as Inductor's: @triton.jit reads it back)
        path.write_text("import triton\nimport triton.language as tl\n\n@triton.jit\n" + src + "\n")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # a name the source needs and lacks: NameError here
        again = getattr(module, kernel.__name__)
        assert isinstance(again, triton.JITFunction) and again.arg_names == kernel.arg_names
        assert module.tl is tl


class _LaunchRecorder:
    """A launcher's ``wrap``: records (kernel, every argument by name) instead of launching."""

    def __init__(self):
        self.calls = []

    def __call__(self, kernel):
        recorder = self

        class _Grid:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    named = {k: v for k, v in kwargs.items()
                             if k not in ("num_warps", "num_stages", "launch_pdl", "maxnreg")}
                    named.update(zip(kernel.arg_names, args))
                    recorder.calls.append((kernel, named))
                return launch

        return _Grid()


@pytest.fixture
def hopper_target():
    """Triton's active driver answering sm_90 where there is no GPU (Inductor's kernel analysis asks
    it for the compile target); the real driver on a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    if torch.cuda.is_available():
        yield
        return

    class _Hopper:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def is_active(self):
            return True

    before = driver._active  # (None until a kernel first asks: the CUDA driver, absent here)
    driver.set_active(_Hopper())
    try:
        yield
    finally:
        driver._active = before


def inductor_writes(kernel, kwargs) -> set[str]:
    """The arguments Inductor's analysis of a user-defined Triton kernel finds written (what it
    treats as mutated: an input it wrongly names is copied before every launch, and written back
    where it is a graph input)."""
    from torch._higher_order_ops import triton_kernel_wrap as tkw

    if hasattr(tkw, "identify_accessed_tensors"):  # torch 2.13
        return {d.name for d in tkw.identify_accessed_tensors(kernel, kwargs, {}).read_writes.writes}
    return set(tkw.identify_mutated_tensors(kernel, kwargs, {}))  # torch 2.11


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs Triton's compiler (not its CPU interpreter)")
@pytest.mark.parametrize("form", ["fused_table", "fused_angles", "bounds", "accept", "paged_bounds", "paged_fused"])
def test_inductor_finds_exactly_the_outputs_the_kernels_write(form, hopper_target):
    """As the launchers call them at the Muse-Spark step's shape (batch 1), Inductor's mutation
    analysis of each kernel names exactly the buffers it writes. A false positive is not harmless:
    a variant of the fused attention (``HOIST``, reverted) once made the analysis name q, v, the
    positions and the RoPE table too, and the engines then copied them before every layer's
    attention and failed to load (docs/aoti.md, "Known problems"). ``paged_*``: through block tables (pools of
    16-position blocks), whose ids the kernel carries a tile ahead through its loop: the tables are only read."""
    from muse_spark.plugins.acceptance.triton_kernel import launch_accept
    from muse_spark.plugins.attention.triton_kernel import launch_attention

    rec = _LaunchRecorder()
    bf, i64, f32 = torch.bfloat16, torch.int64, torch.float32
    B, S, H, KV, DH, T = 1, 8, 32, 8, 128, 1152
    if form == "accept":
        V, Vd = 131072, 32768
        launch_accept(torch.empty(B, S, V, dtype=bf), 1.0, torch.zeros(B, S - 1, dtype=i64),
                      torch.empty(B, S - 1, Vd, dtype=f32), torch.zeros(Vd, dtype=i64), torch.ones(B),
                      torch.zeros(B, dtype=i64), torch.zeros(B, dtype=i64), wrap=rec)
        want = {"_stats_kernel": {"t2d_ptr", "mx_ptr", "sm_ptr", "am_ptr", "ni_ptr", "fi_ptr"},
                "_accept_kernel": {"rv_ptr", "ri_ptr", "pv_ptr", "pi_ptr", "ar_ptr", "nb_ptr"},
                "_finish_kernel": {"n_ptr", "bonus_ptr"}}
    else:
        kc, vc = torch.empty(2, T, KV, DH, dtype=bf), torch.empty(2, T, KV, DH, dtype=bf)
        last, slots = torch.zeros(B, S, dtype=i64), torch.zeros(B, dtype=i64)
        if form.startswith("paged"):
            kc, vc = torch.empty(2 * T // 16, 16, KV, DH, dtype=bf), torch.empty(2 * T // 16, 16, KV, DH, dtype=bf)
            slots = torch.zeros(B, T // 16, dtype=i64)  # (the block tables)
            form = form.removeprefix("paged_")
        if form == "bounds":
            launch_attention(torch.empty(B, S, H, DH, dtype=bf), kc, vc, last, slots, wrap=rec, window=T, pdl=1)
            partial = {"po_ptr", "pm_ptr", "pl_ptr"}
        else:
            table = (torch.empty(B * S, DH // 2, dtype=f32), torch.empty(B * S, DH // 2, dtype=f32))
            launch_attention(torch.empty(B, S, H + KV, DH, dtype=bf), kc, vc, last, slots, wrap=rec, window=T,
                             pdl=1, new_kv=(torch.empty(B, S, KV, DH, dtype=bf), torch.zeros(B, S, dtype=i64), 1e-6,
                                            5e5, True), table=table if form == "fused_table" else None)
            partial = {"k_ptr", "v_ptr", "po_ptr", "pm_ptr", "pl_ptr"}
        want = {"_partial_kernel": partial, "_combine_kernel": {"out_ptr"}}
    assert [k.fn.__name__ for k, _ in rec.calls] == list(want)
    for kernel, kwargs in rec.calls:
        assert inductor_writes(kernel, kwargs) == want[kernel.fn.__name__], kernel.fn.__name__


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs Triton's compiler (not its CPU interpreter)")
@pytest.mark.parametrize("form", ["linear", "linear_silu_mul", "linear_rope_table", "linear_late",
                                  "linear_silu_mul_late", "linear_rope_table_late", "linear_w8a8",
                                  "linear_w8a8_static", "linear_w8a8_split", "linear_w8a8_rows", "gated_residual",
                                  "gated_residual_rows", "gated_residual_rows_static", "head_norm_rope_cache",
                                  "markov"])
def test_inductor_finds_no_caller_input_written_but_the_declared_ones(form, hopper_target):
    """The step's other plugin kernels, as their launchers call them at the Muse-Spark shape (batch
    1): Inductor's mutation analysis names no buffer the caller passed in as written, except those
    the op declares mutated (the caches, the Markov workspace). Such a false positive is copied
    before every launch in the packages, and written back where it is a graph input. ``_late``: the
    GEMMs with their late trigger (``PDL`` 3, the kernel option ``pdl_gemm_trigger``), whose first form
    fed the stores' addresses and made the packages copy the GEMMs' inputs. ``linear_w8a8``: the row-quantizing
    kernel and the W8A8 GEMM on the down projection's shape, per token and with a static scale (an input)."""
    from muse_spark.plugins.gated_residual.triton_kernel import launch_gated_residual_add
    from muse_spark.plugins.head_norm_rope.triton_kernel import launch_head_norm_rope_cache
    from muse_spark.plugins.linear.triton_kernel import launch_linear, launch_linear_rope_table
    from muse_spark.plugins.markov import triton_kernel as mk

    rec = _LaunchRecorder()
    bf, i64, f32 = torch.bfloat16, torch.int64, torch.float32
    B, S, H, KV, DH, D, T = 1, 8, 32, 8, 128, 4096, 1152
    declared = []
    pdl = 3 if form.endswith("_late") else 2
    form = form.removesuffix("_late")
    if form in ("linear", "linear_silu_mul"):
        inputs = [torch.empty(B, S, D, dtype=bf), torch.empty(2 * 14336 if form != "linear" else 4096, D, dtype=bf)]
        launch_linear(*inputs, silu_mul=form != "linear", wrap=rec, pdl=pdl)
    elif form in ("linear_w8a8", "linear_w8a8_static", "linear_w8a8_split"):
        inputs = [torch.empty(B, S, 14336, dtype=bf), torch.empty(D, 14336, dtype=torch.float8_e4m3fn),
                  torch.ones(D), torch.ones(1)]
        launch_linear(*inputs[:2], wrap=rec, pdl=pdl, scale=inputs[2], w8a8=True,
                      input_scale=inputs[3] if form == "linear_w8a8_static" else None,
                      config=dict(BLOCK_N=64, BLOCK_K=512, num_warps=4, num_stages=4, SPLIT_K=4)
                      if form == "linear_w8a8_split" else None)
    elif form == "linear_w8a8_rows":  # (the rows quantized by the residual kernel: inputs here, only read)
        inputs = [torch.empty(B, S, D, dtype=bf), torch.empty(2 * 14336, D, dtype=torch.float8_e4m3fn),
                  torch.ones(2 * 14336), torch.empty(B * S, D, dtype=torch.float8_e4m3fn), torch.ones(B * S)]
        launch_linear(*inputs[:2], silu_mul=True, wrap=rec, pdl=pdl, scale=inputs[2], w8a8=True,
                      rows=(inputs[3], inputs[4]))
    elif form == "linear_rope_table":
        inputs = [torch.empty(B, S, D, dtype=bf), torch.empty((H + 2 * KV) * DH, D, dtype=bf),
                  torch.zeros(B, S, dtype=i64)]
        launch_linear_rope_table(*inputs, 5e5, DH, wrap=rec, pdl=pdl)
    elif form == "gated_residual":
        inputs = [torch.empty(B, S, D), torch.empty(B, S, D, dtype=bf), torch.empty(D), torch.empty(D, dtype=bf)]
        launch_gated_residual_add(*inputs, 1e-6, False, True, bf, wrap=rec, pdl=1)
    elif form in ("gated_residual_rows", "gated_residual_rows_static"):
        inputs = [torch.empty(B, S, D), torch.empty(B, S, D, dtype=bf), torch.empty(D), torch.empty(D, dtype=bf),
                  torch.ones(1)]
        launch_gated_residual_add(*inputs[:4], 1e-6, False, True, bf, wrap=rec, pdl=1, quantize=True,
                                  input_scale=inputs[4] if form.endswith("static") else None)
    elif form == "head_norm_rope_cache":
        declared = [torch.empty(2, T, KV, DH, dtype=bf), torch.empty(2, T, KV, DH, dtype=bf)]
        inputs = [torch.empty(B, S, H + KV, DH, dtype=bf), torch.empty(B, S, KV, DH, dtype=bf),
                  torch.zeros(B, S, dtype=i64), torch.zeros(B, dtype=i64)]
        launch_head_norm_rope_cache(inputs[0], inputs[1], inputs[2], 1e-6, 5e5, True, *declared, inputs[3], wrap=rec,
                                    pdl=1)
    else:
        V, Vd, r, gamma = 131072, 32768, 256, 7
        inputs = [torch.empty(B, gamma, Vd), torch.zeros(B, dtype=i64), torch.empty(V, r, dtype=bf),
                  torch.empty(Vd, r, dtype=bf), torch.zeros(Vd, dtype=i64), torch.zeros(B, dtype=i64),
                  torch.zeros(B, dtype=i64), torch.ones(B)]
        declared = [torch.zeros(mk.workspace_words(B, gamma, Vd, r, torch.device("cuda")), dtype=i64)]
        mk.launch_markov_sample(*inputs, wrap=rec, workspace=declared[0])
    assert rec.calls, "the launcher launched nothing"
    storages = {t.untyped_storage().data_ptr() for t in inputs}
    allowed = {t.untyped_storage().data_ptr() for t in declared}
    for kernel, kwargs in rec.calls:
        written = inductor_writes(kernel, kwargs)
        callers = {n for n in written if torch.is_tensor(kwargs[n])
                   and kwargs[n].untyped_storage().data_ptr() in storages - allowed}
        assert not callers, (kernel.fn.__name__, sorted(callers))
        assert written, kernel.fn.__name__  # (the analysis ran: every kernel writes something)
