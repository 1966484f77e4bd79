"""Tensor parallelism on GPUs (NCCL, one GPU a rank): the split target's tokens equal the
single-GPU engine's, at every rank count the machine has GPUs for (2, 4, 8). Skips below 2 GPUs."""

from __future__ import annotations

import pytest
import torch

from muse_spark.runtime import EagerEngine, Generator, SamplingParams
from muse_spark.runtime import tensor_parallel as tp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")]

PROMPTS = [[65, 66, 67], [70, 71], [40 + i % 20 for i in range(30)]]
PARAMS = [SamplingParams(max_tokens=24, ignore_eos=True),
          SamplingParams(max_tokens=20, temperature=0.8, seed=4, ignore_eos=True),
          SamplingParams(max_tokens=16, ignore_eos=True)]


def _skip_unless_split(pair, world: int) -> None:
    """Skip where the machine has fewer than ``world`` GPUs or the tiny target does not split over them."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    try:
        tp.check_split(EagerEngine.from_checkpoints(*pair, max_batch=1, max_seq=64).tcfg, world)
    except tp.TensorParallelError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_split_target_on_gpus_gives_the_single_gpu_tokens(agreeing_pair, world):
    _skip_unless_split(agreeing_pair, world)
    single = Generator(EagerEngine.from_checkpoints(*agreeing_pair, device="cuda", max_batch=2, max_seq=128)
                       ).generate(PROMPTS, PARAMS)
    out = tp.generate(*agreeing_pair, PROMPTS, PARAMS, world, device="cuda", max_batch=2, max_seq=128)
    assert [o["output"] for o in out] == [r.output for r in single]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_compiled_ranks_on_gpus_give_the_single_gpu_tokens(agreeing_pair, tmp_path, world):
    """`build --backend aoti --tp N` on CUDA: every rank replays the packages' step graph (its NCCL all-reduces
    captured in it) on its slice; the tokens equal the single-GPU eager engine's."""
    import functools

    from conftest import run_cli

    _skip_unless_split(agreeing_pair, world)
    engine = tmp_path / "engine"
    r = run_cli("build", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--out", engine, "--tp", world,
                "--backend", "aoti", "--device", "cuda", "--max-batch", 2, "--max-seq", 128)
    assert r.returncode == 0, r.stderr[-4000:]
    single = Generator(EagerEngine.from_checkpoints(*agreeing_pair, device="cuda", max_batch=2, max_seq=128)
                       ).generate(PROMPTS, PARAMS)
    out = tp.launch(world, tp.lead_or_follow, str(engine), None,
                    functools.partial(tp.generate_lead, prompts=PROMPTS, params=PARAMS), "cuda", device="cuda")
    assert [o["output"] for o in out] == [r.output for r in single]
