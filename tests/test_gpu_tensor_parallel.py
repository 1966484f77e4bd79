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


@pytest.mark.parametrize("world", [2, 4, 8])
def test_split_target_on_gpus_gives_the_single_gpu_tokens(agreeing_pair, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    try:
        tp.check_split(EagerEngine.from_checkpoints(*agreeing_pair, max_batch=1, max_seq=64).tcfg, world)
    except tp.TensorParallelError as e:
        pytest.skip(str(e))
    single = Generator(EagerEngine.from_checkpoints(*agreeing_pair, device="cuda", max_batch=2, max_seq=128)
                       ).generate(PROMPTS, PARAMS)
    out = tp.generate(*agreeing_pair, PROMPTS, PARAMS, world, device="cuda", max_batch=2, max_seq=128)
    assert [o["output"] for o in out] == [r.output for r in single]
