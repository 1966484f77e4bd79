"""Programmatic dependent launch (docs/pdl.md): the kernels wait before any global access, and
programmatic edges in a captured graph change no result."""

from __future__ import annotations

import pytest
import torch

from kernels.kernel_utils import DEV, HAS_TRITON, INTERPRETED, compile_for_hopper, needs_gpu


def _global_accesses_before_the_wait(ptx: str) -> tuple[bool, list[str]]:
    import re

    lines = ptx.splitlines()
    wait = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), None)
    access = [line.strip() for i, line in enumerate(lines)
              if re.search(r"\b(ld|st|atom|red)\.global|cp\.async\.(cg|ca)", line) and (wait is None or i < wait)]
    return wait is not None, access


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs Triton's compiler (not its CPU interpreter)")
@pytest.mark.parametrize("mode", [1, 2, 3], ids=["trigger_then_wait", "wait_only", "wait_then_late_trigger"])
def test_pdl_kernels_wait_before_any_global_access(mode):
    """Compiled for sm_90 without a GPU, with ``PDL`` each plugin kernel executes
    ``griddepcontrol.wait`` before its first global load or store (the data dependency on
    ``pdl_enter``'s zero holds through the compiler's scheduling and software pipelining). Without
    ``PDL`` there is no wait at all. Mode 3 (the kernel option ``pdl_gemm_trigger``, the GEMMs only): the linear
    kernel triggers its dependents after its last weight load and before its first store; the other
    kernels (never compiled so) only wait."""
    from muse_spark.plugins.attention import triton_kernel as ak
    from muse_spark.plugins.gated_residual import triton_kernel as gk
    from muse_spark.plugins.head_norm_rope import triton_kernel as hk
    from muse_spark.plugins.linear import triton_kernel as lk

    names = ["q_ptr", "k_ptr", "v_ptr", "mask_ptr", "slot_ptr", "po_ptr", "pm_ptr", "pl_ptr", "S", "T", "M", "KV",
             "NSPLIT", "N_ROWS", "sq_b", "sq_s", "sq_h", "sk_b", "sk_t", "sk_h", "sv_b", "sv_t", "sv_h", "sm_b", "sm_s"]
    types = ["*bf16", "*bf16", "*bf16", "*i64", "*i64", "*fp32", "*fp32", "*fp32"] + ["i32"] * 17
    cfg = ak.DEFAULT_CONFIG
    attn = dict(SCALE=128 ** -0.5, REP=4, DH=128, BLOCK_M=cfg["BLOCK_M"], BLOCK_T=cfg["BLOCK_T"],
                SPLIT_T=cfg["SPLIT_T"], IEEE_DOT=False, HAS_SLOTS=True, EARLY_KV=True, BOUNDS=True)
    lin_names = ["x_ptr", "w_ptr", "y_ptr", "M", "N", "K", "stride_xm", "stride_ym"]
    lin = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, EVEN_N=True, EVEN_K=True, SILU_MUL=False, IEEE_DOT=False)
    cases = {
        "partial": (ak._partial_kernel, dict(zip(names, types)), attn, 4, None, ()),
        "combine": (ak._combine_kernel, dict(zip(["po_ptr", "pm_ptr", "pl_ptr", "out_ptr", "S", "M", "KV", "NSPLIT",
                                                   "H"], ["*fp32", "*fp32", "*fp32", "*bf16"] + ["i32"] * 5)),
                    dict(REP=4, DH=128, CHUNK=cfg["MERGE_CHUNK"]), 1, None, ()),
        "gated_residual": (gk._gated_residual_norm_kernel, dict(zip(
            ["stream_ptr", "branch_ptr", "gate_ptr", "weight_ptr", "bweight_ptr", "new_ptr", "out_ptr", "D"],
            ["*fp32", "*bf16", "*fp32", "*bf16", "*bf16", "*fp32", "*bf16", "i32"])),
            dict(EPS=1e-6, HAS_WEIGHT=True, ZERO_CENTERED=False, APPLY_NORM=True, BLOCK_D=4096, NORM_BRANCH=True,
                 HAS_BRANCH_WEIGHT=True), 8, None, ()),
        # its normed rows also quantized for the W8A8 gate/up product (per token)
        "gated_residual_rows": (gk._gated_residual_norm_kernel, dict(zip(
            ["stream_ptr", "branch_ptr", "gate_ptr", "weight_ptr", "bweight_ptr", "new_ptr", "out_ptr", "D", "q_ptr",
             "qs_ptr", "in_scale_ptr"],
            ["*fp32", "*bf16", "*fp32", "*bf16", "*bf16", "*fp32", "*bf16", "i32", "*fp8e4nv", "*fp32", "*fp32"])),
            dict(EPS=1e-6, HAS_WEIGHT=True, ZERO_CENTERED=False, APPLY_NORM=True, BLOCK_D=4096, NORM_BRANCH=True,
                 HAS_BRANCH_WEIGHT=True, QUANT=1), 8, None, ()),
        "head_norm_rope": (hk._head_norm_rope_kernel, dict(zip(
            ["x_ptr", "pos_ptr", "out_ptr", "S", "NH", "sx_b", "sx_s", "sx_h", "sp_b", "sp_s"],
            ["*bf16", "*i64", "*bf16"] + ["i32"] * 7)), dict(EPS=1e-6, THETA=5e5, DH=128, BLOCK_H=16, ROPE=True), 4,
            None, ()),
        "head_norm_rope_cache": (hk._head_norm_rope_cache_kernel, dict(zip(
            ["x_ptr", "v_ptr", "pos_ptr", "slot_ptr", "out_ptr", "kc_ptr", "vc_ptr", "S", "NH", "H", "KVH", "N_SLOTS",
             "T", "sx_b", "sx_s", "sx_h", "sp_b", "sp_s", "sv_b", "sv_s", "sv_h", "skc_n", "skc_t", "skc_h", "svc_n",
             "svc_t", "svc_h"], ["*bf16", "*bf16", "*i64", "*i64", "*bf16", "*bf16", "*bf16"] + ["i32"] * 20)),
            dict(EPS=1e-6, THETA=5e5, DH=128, BLOCK_H=16, ROPE=True, BLOCK_KV=8), 4, None, ()),
        "linear": (lk._linear_kernel, dict(zip(lin_names, ["*bf16"] * 3 + ["i32"] * 5)), lin, 4, 4,
                   ("N", "K", "stride_xm", "stride_ym")),
        # the RoPE table (the default): the qkv GEMM's extra program
        # that writes it, and the norm kernel reading it
        "linear_rope_table": (lk._linear_kernel, dict(zip(
            lin_names + ["pos_ptr", "cos_ptr", "sin_ptr", "N_POS"],
            ["*bf16"] * 3 + ["i32"] * 5 + ["*i64", "*fp32", "*fp32", "i32"])),
                              dict(lin, ROPE_TABLE=True, THETA=5e5, DH_ROPE=128, BLOCK_POS=16), 4, 4,
                              ("N", "K", "stride_xm", "stride_ym")),
        # FP8 weights: W8A16 (each tile dequantized as it streams in) and W8A8 (FP8 codes on both sides, the
        # activations' row scales read in the epilogue)
        "linear_fp8": (lk._linear_kernel, dict(zip(lin_names + ["s_ptr"], ["*bf16", "*fp8e4nv", "*bf16"] + ["i32"] * 5
                                                   + ["*fp32"])), dict(lin, SCALED=True), 4, 4,
                       ("N", "K", "stride_xm", "stride_ym")),
        "linear_w8a8": (lk._linear_kernel, dict(zip(lin_names + ["s_ptr", "xs_ptr"],
                                                    ["*fp8e4nv", "*fp8e4nv", "*bf16"] + ["i32"] * 5 + ["*fp32"] * 2)),
                        dict(lin, W8A8=True), 4, 4, ("N", "K", "stride_xm", "stride_ym")),
        # split-K: the parts' sums stored by the GEMM, then added, scaled and rounded by a kernel of their own
        "linear_w8a8_split": (lk._linear_kernel, dict(zip(lin_names + ["s_ptr", "xs_ptr", "part_ptr"],
                                                          ["*fp8e4nv", "*fp8e4nv", "*bf16"] + ["i32"] * 5
                                                          + ["*fp32"] * 3)),
                              dict(lin, W8A8=True, SPLIT_K=4), 4, 4, ("N", "K", "stride_xm", "stride_ym")),
        "split_sum": (lk._split_sum_kernel, dict(part_ptr="*fp32", y_ptr="*bf16", xs_ptr="*fp32", s_ptr="*fp32",
                                                 M="i32", N="i32", stride_ym="i32"),
                      dict(SPLIT_K=4, BLOCK=1024, W8A8=True), 4, None, ("N", "stride_ym")),
        # W8A8: the rows quantized by a launch before the GEMM, per token or with a static scale
        "quantize_rows": (lk._quantize_rows_kernel, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", K="i32",
                                                         stride_xm="i32", in_scale_ptr="*fp32"), dict(BLOCK_K=1024), 4,
                          None, ("K", "stride_xm")),
        "quantize_rows_static": (lk._quantize_rows_kernel, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32",
                                                                K="i32", stride_xm="i32", in_scale_ptr="*fp32"),
                                 dict(BLOCK_K=1024, STATIC=True), 4, None, ("K", "stride_xm")),
        "quantize_rows_one_load": (lk._quantize_rows_kernel, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32",
                                                                  K="i32", stride_xm="i32", in_scale_ptr="*fp32"),
                                   dict(BLOCK_K=4096, ONE_LOAD=True), 4, None, ("K", "stride_xm")),
        "linear_fp8_rope_table": (lk._linear_kernel, dict(zip(
            lin_names + ["pos_ptr", "cos_ptr", "sin_ptr", "N_POS", "s_ptr"],
            ["*bf16", "*fp8e4nv", "*bf16"] + ["i32"] * 5 + ["*i64", "*fp32", "*fp32", "i32", "*fp32"])),
            dict(lin, ROPE_TABLE=True, THETA=5e5, DH_ROPE=128, BLOCK_POS=16, SCALED=True), 4, 4,
            ("N", "K", "stride_xm", "stride_ym")),
        "attention_cache_table": (ak._partial_kernel, dict(zip(
            names + ["vn_ptr", "pos_ptr", "svn_b", "svn_s", "svn_h", "sp_b", "sp_s", "T_CACHE", "cos_ptr", "sin_ptr"],
            types + ["*bf16", "*i64"] + ["i32"] * 6 + ["*fp32", "*fp32"])),
            dict(attn, NORM_QK=True, EPS=1e-6, THETA=5e5, ROPE=True, TABLE=True), 4, None, ()),
        "head_norm_rope_cache_table": (hk._head_norm_rope_cache_kernel, dict(zip(
            ["x_ptr", "v_ptr", "pos_ptr", "slot_ptr", "out_ptr", "kc_ptr", "vc_ptr", "S", "NH", "H", "KVH", "N_SLOTS",
             "T", "sx_b", "sx_s", "sx_h", "sp_b", "sp_s", "sv_b", "sv_s", "sv_h", "skc_n", "skc_t", "skc_h", "svc_n",
             "svc_t", "svc_h", "cos_ptr", "sin_ptr"],
            ["*bf16", "*bf16", "*i64", "*i64", "*bf16", "*bf16", "*bf16"] + ["i32"] * 20 + ["*fp32", "*fp32"])),
            dict(EPS=1e-6, THETA=5e5, DH=128, BLOCK_H=16, ROPE=True, BLOCK_KV=8, TABLE=True), 4, None, ()),
    }
    from muse_spark.plugins.pdl import PDL_KERNELS

    # Every kernel an engine built with the kernel option pdl launches as a programmatic dependent is checked here.
    assert set(PDL_KERNELS) <= {case[0].fn.__name__ for case in cases.values()}
    for name, (fn, sig, consts, warps, stages, m16) in cases.items():
        ptx = compile_for_hopper(fn, sig, dict(consts, PDL=mode), warps, stages, multiples_of_16=m16).asm["ptx"]
        waits, before = _global_accesses_before_the_wait(ptx)
        assert waits and before == [], (name, before)
        late = mode == 3 and fn is lk._linear_kernel
        assert ("griddepcontrol.launch_dependents" in ptx) == (mode == 1 or late), name
        if late and name == "linear":  # after the weight stream, before the stores
            lines = ptx.splitlines()
            trigger = next(i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line)
            loads = [i for i, line in enumerate(lines) if "cp.async.cg.shared.global" in line or "ld.global" in line]
            stores = [i for i, line in enumerate(lines) if "st.global" in line]
            assert loads and stores and max(loads) < trigger < min(stores), (max(loads), trigger, min(stores))
        if name in ("partial", "linear"):  # and without PDL: no wait
            plain = compile_for_hopper(fn, sig, dict(consts, PDL=0), warps, stages, multiples_of_16=m16).asm["ptx"]
            assert "griddepcontrol" not in plain
            if name == "linear":  # the same vectorized, pipelined weight loads
                assert plain.count("cp.async.cg.shared.global") == ptx.count("cp.async.cg.shared.global")


@needs_gpu
def test_a_gemm_triggering_after_its_weight_stream_changes_no_result():
    """``PDL`` 3 (the kernel option ``pdl_gemm_trigger``) in a captured graph with programmatic edges: a
    producer, a GEMM that triggers its dependents after its weight stream, then a GEMM reading its
    output (launched early, waiting). Every replay with new producer input gives the plain
    launches' result bit for bit: the dependent reads nothing of the first GEMM's output before it
    is complete, though it launched before that GEMM's stores."""
    from muse_spark.plugins.linear.triton_kernel import launch_linear
    from muse_spark.runtime.cuda_graph import make_programmatic

    g = torch.Generator().manual_seed(5)
    src = torch.randn(8, 4096, generator=g).to(torch.bfloat16).to(DEV)
    x = torch.empty_like(src)
    w1 = (torch.randn(2 * 2048, 4096, generator=g) / 64).to(torch.bfloat16).to(DEV)
    w2 = (torch.randn(4096, 2048, generator=g) / 45).to(torch.bfloat16).to(DEV)

    def step(pdl):
        torch.mul(src, 2.0, out=x)
        return launch_linear(launch_linear(x, w1, True, pdl=pdl), w2, pdl=2)

    step(3)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        out = step(3)
    assert make_programmatic(graph.raw_cuda_graph(), {"_linear_kernel"})[0] == 2
    graph.instantiate()
    for i in range(10):
        src.copy_(torch.randn(src.shape, device=DEV, generator=torch.Generator(DEV).manual_seed(i)))
        graph.replay()
        want = launch_linear(launch_linear(src * 2.0, w1, True), w2)
        torch.cuda.synchronize()
        assert torch.equal(out, want), i


@needs_gpu
@pytest.mark.parametrize("port", ["programmatic", "launch_order"])
def test_programmatic_edges_into_a_waiting_kernel_change_no_result(port):
    """``runtime.cuda_graph.make_programmatic`` on a captured graph: a 64 MB elementwise producer,
    then the q/k norm kernel compiled with the PDL wait reading the producer's last rows. Only the
    edge into the named kernel becomes programmatic (one of the graph's edges), and every replay
    with new producer input gives the unfused result bit for bit: the consumer launched early
    reads nothing before its wait. A graph whose kernels are not named keeps its edges."""
    from muse_spark.plugins.head_norm_rope.triton_kernel import launch_head_norm_rope
    from muse_spark.runtime.cuda_graph import make_programmatic

    B, S, NH, DH = 2, 8, 12, 128
    n = B * S * NH * DH
    src = torch.randn(1 << 25, device=DEV, dtype=torch.bfloat16)
    buf = torch.empty_like(src)
    pos = torch.arange(B * S, device=DEV).view(B, S) + 100

    def step(pdl):
        torch.mul(src, 2.0, out=buf)  # the producer: every element, its last rows read next
        return launch_head_norm_rope(buf[-n:].view(B, S, NH, DH), pos, 1e-6, 5e5, True, pdl=pdl)

    def capture(names):
        step(2)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(g):
            out = step(2)
        counts = make_programmatic(g.raw_cuda_graph(), names, port)
        g.instantiate()
        return g, out, counts

    g, out, counts = capture({"_head_norm_rope_kernel"})
    assert counts == (1, 2)
    for i in range(10):
        src.copy_(torch.randn(src.shape, device=DEV, generator=torch.Generator(DEV).manual_seed(i)))
        g.replay()
        want = launch_head_norm_rope((src[-n:] * 2.0).view(B, S, NH, DH), pos, 1e-6, 5e5, True)
        torch.cuda.synchronize()
        assert torch.equal(out, want), i
    assert capture({"_some_other_kernel"})[2] == (0, 2)
    with pytest.raises(ValueError, match="PDL port"):
        make_programmatic(g.raw_cuda_graph(), {"_head_norm_rope_kernel"}, "early")
