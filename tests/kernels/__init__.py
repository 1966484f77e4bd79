"""The Triton plugin kernels against their references (plugins/*/reference.py), one file an op.

Runs on a CUDA device with Triton. Without one every kernel test skips, except
under Triton's CPU interpreter (``TRITON_INTERPRET=1`` with Triton installed),
where the same tests run at small sizes: correct, not fast. Compilation tests
(torch.compile, AOTInductor) need the GPU.

A package (tests/ is on pytest's path), so that ``kernels.kernel_utils`` resolves to this
folder even where a distribution of that name is installed.
"""
