"""The Triton ops' registration and dispatch, and the ops in an exported graph, under
torch.compile and in an AOTInductor package."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from muse_spark.plugins import dispatch
from muse_spark.plugins.markov.reference import markov_sample_ref

from kernels.kernel_utils import DEV, markov_inputs, needs_gpu, needs_kernels
from tolerances import TOL


def test_importing_plugins_imports_no_triton():
    code = (
        "import sys, torch; before = 'triton' in sys.modules\n"
        "import muse_spark.plugins, muse_spark.plugins.dispatch\n"
        "assert 'muse_spark.plugins.triton_ops' not in sys.modules\n"
        "assert before or 'triton' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@needs_kernels
def test_dispatch_selects_the_triton_ops(tops):
    args = markov_inputs(2, 3, 300, 400, 16)
    with dispatch.plugin_impl("triton"):
        ids, probs = dispatch.markov_sample(*args)
    ref_ids, ref_probs = markov_sample_ref(*args)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(probs, ref_probs, **TOL["draft_probs"])
    stream = torch.randn(2, 64, device=DEV)
    branch = torch.randn(2, 64, device=DEV).bfloat16()
    gate = torch.rand(64, device=DEV)
    with dispatch.plugin_impl("triton"):
        new, _ = dispatch.gated_residual_add(stream, branch, gate, None, 1e-6, False, True, torch.bfloat16)
    assert torch.equal(new, stream + gate * branch.float())


class _Tiny(torch.nn.Module):
    """A function of both ops, as an engine graph would call them."""

    def forward(self, stream, branch, gate, w, x, wl, U, h, anchor, w1, w2, d2t, seeds, positions, temps, ws):
        new, normed = torch.ops.muse_spark.gated_residual_add_triton(stream, branch, gate, w, 1e-6, False, True,
                                                                    torch.bfloat16)
        y = torch.ops.muse_spark.linear_triton(normed, wl, False)
        act = torch.ops.muse_spark.linear_triton(x, wl, True)
        # y's rows as [B = 2, S = 2, heads 3, Dh 32] at the requests' positions
        qk = torch.ops.muse_spark.head_norm_rope_triton(y.view(2, 2, 3, 32), positions[:, None].expand(2, 2), 1e-6,
                                                        5e5, True)
        ids, probs = torch.ops.muse_spark.markov_sample_triton(U, h, anchor, w1, w2, d2t, seeds, positions, temps,
                                                               "vanilla", None, None, 0, ws)
        return new, normed, y, act, qk, ids, probs


def _tiny_args(tops):
    g = torch.Generator().manual_seed(5)
    resid = [torch.randn(4, 128, generator=g), torch.randn(4, 128, generator=g).bfloat16(),
             torch.rand(128, generator=g), torch.randn(128, generator=g).bfloat16(),
             torch.randn(8, 128, generator=g).bfloat16(), (0.1 * torch.randn(96, 128, generator=g)).bfloat16()]
    markov = markov_inputs(2, 3, 512, 1024, 32)[:9]
    n_ws = tops.markov_workspace_words(2, 3, 512, 1024, 32, "vanilla", markov[0].device, markov[3].dtype)
    return [t.to(DEV) for t in resid] + markov + [torch.zeros(n_ws, dtype=torch.int64, device=DEV)]


@needs_gpu  # (the interpreter's kernels cannot be traced with fake tensors)
def test_triton_ops_export_as_ops(tops):
    """The ops stay ops in an exported graph, and the graph computes what the ops do in eager; the
    Markov op's kept workspace is mutated in place (the second call, eager, reads the parity the
    exported one left and gets the same results)."""
    args = _tiny_args(tops)
    assert args[-1].numel() > 0
    ep = torch.export.export(_Tiny(), tuple(args))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "muse_spark.gated_residual_add_triton.default" in targets
    assert "muse_spark.markov_sample_triton.default" in targets
    assert "muse_spark.linear_triton.default" in targets
    assert "muse_spark.head_norm_rope_triton.default" in targets
    for a, b in zip(ep.module()(*args), _Tiny()(*args)):
        assert torch.equal(a, b)
    assert int(args[-1][0]) > 0 and int(args[-1][2]) == 0  # two calls counted on the kept words; no error flag


@needs_gpu
def test_triton_ops_under_torch_compile(tops):
    args = _tiny_args(tops)
    eager = _Tiny()(*args)
    compiled = torch.compile(_Tiny(), fullgraph=True)(*args)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)


@needs_gpu
@pytest.mark.slow
def test_triton_ops_compile_into_an_aoti_package(tops, tmp_path):
    args = _tiny_args(tops)
    ep = torch.export.export(_Tiny(), tuple(args))
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "tiny.pt2"))
    from muse_spark.runtime.aoti_engine import load_package  # (the runtime's loader: docs/aoti.md)

    runner = load_package(path, torch.device(DEV))
    got = runner(*args)
    assert int(args[-1][0]) > 0  # the package counted its call on the caller's workspace, in place
    for a, b in zip(got, _Tiny()(*args)):
        assert torch.equal(a, b)
