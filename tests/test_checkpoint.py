"""Checkpoint loading: vLLM's names and errors, broken checkpoints, round trips."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from muse_spark.checkpoint import CheckpointError, load_draft, load_pair, load_target, save_canonical
from muse_spark.config import load_config
from conftest import clone




def test_pair_loads_and_shares_embeddings(agreeing_pair):
    target, draft = load_pair(*agreeing_pair)
    assert draft.embed_weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert target.model.layers[0].self_attn.qkv_proj.weight.shape == (target.cfg.qkv_out, 64)
    assert target.dtype == torch.bfloat16
    # Residual constants are materialized: g = residual_multiplier * gate, fp32.
    layer = target.model.layers[1]
    assert layer.g_attn.dtype == torch.float32
    torch.testing.assert_close(layer.g_attn, layer.attn_residual_gate.float() * target.cfg.residual_multiplier)


def test_stacking_follows_the_seed_order(agreeing_pair):
    raw = load_file(str(agreeing_pair[0] / "model.safetensors"))
    target = load_target(agreeing_pair[0])
    qkv = target.model.layers[2].self_attn.qkv_proj.weight
    parts = [raw[f"model.layers.2.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj", "o_gate_proj")]
    assert torch.equal(qkv, torch.cat(parts, 0))
    gu = target.model.layers[2].feed_forward.gate_up_proj.weight
    assert torch.equal(gu, torch.cat([raw["model.layers.2.feed_forward.gate_proj.weight"],
                                      raw["model.layers.2.feed_forward.up_proj.weight"]], 0))


def test_draft_ignores_t2d_embeddings_and_mask_embedding(agreeing_pair, tmp_path):
    def edit(t):
        t["embed_tokens.weight"] = torch.zeros(259, 64, dtype=torch.bfloat16)
        t["mask_embedding"] = torch.zeros(64, dtype=torch.bfloat16)

    d = clone(agreeing_pair[1], tmp_path / "draft", edit)
    draft = load_draft(d)
    assert "model.embed_tokens.weight" not in draft.state_dict()
    raw = load_file(str(d / "model.safetensors"))
    assert torch.equal(draft.d2t, raw["d2t"])


def test_missing_lm_head_uses_the_seed_error(agreeing_pair, tmp_path):
    d = clone(agreeing_pair[1], tmp_path / "draft", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="^Muse Spark DSpark requires its own lm_head$"):
        load_draft(d)


def test_missing_d2t_uses_the_seed_error(agreeing_pair, tmp_path):
    d = clone(agreeing_pair[1], tmp_path / "draft", lambda t: t.pop("d2t"))
    with pytest.raises(CheckpointError, match="^Muse Spark DSpark requires a d2t vocabulary mapping$"):
        load_draft(d)


def test_missing_tensor_is_named_with_its_shape(agreeing_pair, tmp_path):
    d = clone(agreeing_pair[0], tmp_path / "target", lambda t: t.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.norm.weight' of shape \[64\]"):
        load_target(d)
    d2 = clone(agreeing_pair[0], tmp_path / "t2", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.self_attn.k_proj.weight'"):
        load_target(d2)


def test_missing_residual_gates_mean_one(agreeing_pair, tmp_path):
    def edit(t):
        for k in [k for k in t if k.endswith("residual_gate")]:
            del t[k]

    target = load_target(clone(agreeing_pair[0], tmp_path / "target", edit))
    assert torch.equal(target.model.layers[0].g_ffn, torch.ones(64))


def test_unexpected_tensor_is_named(agreeing_pair, tmp_path):
    d = clone(agreeing_pair[0], tmp_path / "target", lambda t: t.__setitem__("model.extra.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.extra.weight'"):
        load_target(d)


def test_misshaped_tensor_reports_expected_and_actual(agreeing_pair, tmp_path):
    def edit(t):
        t["model.layers.0.feed_forward.down_proj.weight"] = torch.zeros(64, 95, dtype=torch.bfloat16)

    d = clone(agreeing_pair[0], tmp_path / "target", edit)
    with pytest.raises(CheckpointError, match=r"down_proj.weight' has shape \[64, 95\], expected \[64, 96\]"):
        load_target(d)


def test_draft_kv_geometry_mismatch(agreeing_pair, tmp_path):
    def edit(t):
        t["layers.1.self_attn.k_proj.weight"] = torch.zeros(64, 64, dtype=torch.bfloat16)

    d = clone(agreeing_pair[1], tmp_path / "draft", edit)
    with pytest.raises(CheckpointError, match="Muse Spark DSpark layers must share KV geometry"):
        load_draft(d)


def test_nan_in_weights_is_reported(agreeing_pair, tmp_path):
    def edit(t):
        w = t["lm_head.weight"].clone()
        w[3, 4] = float("nan")
        w[5, 6] = float("inf")
        t["lm_head.weight"] = w

    d = clone(agreeing_pair[0], tmp_path / "target", edit)
    with pytest.raises(CheckpointError, match=r"'lm_head.weight' has non-finite values \(1 NaN, 1 Inf\)"):
        load_target(d)


def test_d2t_outside_target_vocabulary(agreeing_pair, tmp_path):
    def edit(t):
        d2t = t["d2t"].clone()
        d2t[-1] = 1000
        t["d2t"] = d2t

    d = clone(agreeing_pair[1], tmp_path / "draft", edit)
    with pytest.raises(CheckpointError, match=r"d2t maps draft id 130 to target id 1130, outside the target vocabulary \[0, 259\)"):
        load_draft(d)


def test_pickle_checkpoints_are_refused(agreeing_pair, tmp_path):
    d = tmp_path / "target"
    d.mkdir()
    shutil.copy(agreeing_pair[0] / "config.json", d)
    torch.save({"x": torch.zeros(1)}, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle checkpoints are refused"):
        load_target(d)


def test_garbage_safetensors_file(agreeing_pair, tmp_path):
    d = tmp_path / "target"
    d.mkdir()
    shutil.copy(agreeing_pair[0] / "config.json", d)
    (d / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_target(d)


def test_sharded_checkpoint_loads_identically(agreeing_pair, tmp_path):
    d = tmp_path / "target"
    d.mkdir()
    shutil.copy(agreeing_pair[0] / "config.json", d)
    t = load_file(str(agreeing_pair[0] / "model.safetensors"))
    names = sorted(t)
    half = len(names) // 2
    weight_map = {}
    for i, chunk in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: t[n] for n in chunk}, str(d / fname))
        weight_map.update({n: fname for n in chunk})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = load_target(agreeing_pair[0]), load_target(d)
    for (k, v), (k2, v2) in zip(a.state_dict().items(), b.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    # A shard named in the index but missing on disk.
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="points to missing shard"):
        load_target(d)


def test_save_then_load_round_trip(agreeing_pair, tmp_path):
    """Canonical weights saved back in vLLM's unstacked layout load to the same module."""
    target = load_target(agreeing_pair[0])
    canon = tmp_path / "canon.safetensors"
    save_canonical(target, canon)
    sd = load_file(str(canon))
    cfg = target.cfg
    hf = {}
    for k, v in sd.items():
        if k.endswith("qkv_proj.weight"):
            base = k[: -len("qkv_proj.weight")]
            sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size, cfg.q_size]
            for part, piece in zip(("q_proj", "k_proj", "v_proj", "o_gate_proj"), v.split(sizes)):
                hf[f"{base}{part}.weight"] = piece.contiguous()
        elif k.endswith("gate_up_proj.weight"):
            base = k[: -len("gate_up_proj.weight")]
            g, u = v.split(cfg.intermediate_size)
            hf[f"{base}gate_proj.weight"], hf[f"{base}up_proj.weight"] = g.contiguous(), u.contiguous()
        else:
            hf[k] = v
    d = tmp_path / "target"
    d.mkdir()
    shutil.copy(agreeing_pair[0] / "config.json", d)
    save_file(hf, str(d / "model.safetensors"))
    again = load_target(d)
    for k, v in target.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


def test_dtype_override_and_wrong_kind(agreeing_pair):
    t32 = load_target(agreeing_pair[0], dtype="float32")
    assert t32.dtype == torch.float32
    with pytest.raises(CheckpointError, match="this is a DSpark draft checkpoint"):
        load_target(agreeing_pair[1])
    with pytest.raises(CheckpointError, match="not a DSpark draft checkpoint"):
        load_draft(agreeing_pair[0])


def test_draft_vocab_mismatch_with_target(agreeing_pair, tmp_path):
    d = clone(agreeing_pair[1], tmp_path / "draft", config_edit=lambda c: c.update(target_layer_ids=[0, 3]))
    with pytest.raises(ValueError, match="out of range"):
        load_pair(agreeing_pair[0], d)
    assert load_config(agreeing_pair[1]).target_layer_ids == (0, 2)


def _rss_anon_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    pytest.skip("no /proc/self/status RssAnon on this platform")


def test_loading_does_not_copy_the_weights(tmp_path, agreeing_pair):
    """The big tensors stay memory-mapped (file-backed pages, reclaimable), so a
    checkpoint loads in about its own size of RAM, not twice it."""
    import gc

    from builder_tiny_big import write_wide_checkpoint

    d, nbytes = write_wide_checkpoint(tmp_path)
    load_target(agreeing_pair[0])  # warm up: the first meta-device build imports ~70 MB of torch internals
    gc.collect()
    before = _rss_anon_mb()
    target = load_target(d)
    for p in target.parameters():  # read every page (no temporary copies)
        p.view(torch.int16).sum()
    grown = _rss_anon_mb() - before
    assert grown < 0.35 * nbytes / 2**20, f"anonymous memory grew by {grown:.0f} MB for {nbytes / 2**20:.0f} MB"
    assert float(target.model.embed_tokens.weight.float().sum()) != 0.0


# ---- dtypes: checked, not converted silently -----------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int8, torch.float16, torch.float32])
def test_a_weight_of_another_dtype_is_refused(agreeing_pair, tmp_path, dtype):
    name = "model.layers.1.self_attn.q_proj.weight"

    def edit(t):
        t[name] = t[name].to(dtype)

    d = clone(agreeing_pair[0], tmp_path / "target", edit)
    got = str(dtype).removeprefix("torch.")
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has dtype {got}, expected bfloat16, the checkpoint's "
                                              "torch_dtype"):
        load_target(d)
    with pytest.raises(CheckpointError, match=f"has dtype {got}"):
        load_target(d, dtype="float32")  # (--dtype converts checked weights; it does not widen the check)


def test_a_float_d2t_is_refused(agreeing_pair, tmp_path):
    d = clone(agreeing_pair[1], tmp_path / "draft", lambda t: t.__setitem__("d2t", t["d2t"].float()))
    with pytest.raises(CheckpointError, match=r"tensor 'd2t' has dtype float32, expected an integer dtype"):
        load_draft(d)
    d = clone(agreeing_pair[1], tmp_path / "draft32", lambda t: t.__setitem__("d2t", t["d2t"].to(torch.int32)))
    assert load_draft(d).d2t.dtype == torch.int64


def test_vectors_may_be_float32_in_a_bf16_checkpoint(agreeing_pair, tmp_path):
    def edit(t):
        t["model.norm.weight"] = t["model.norm.weight"].float()  # (the residual gates already are)

    target = load_target(clone(agreeing_pair[0], tmp_path / "target", edit))
    assert target.model.norm.weight.dtype == torch.bfloat16

    def fp16_norm(t):
        t["model.norm.weight"] = t["model.norm.weight"].half()

    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has dtype float16, expected bfloat16 \(or float32 "
                                              r"for a vector\)"):
        load_target(clone(agreeing_pair[0], tmp_path / "t16", fp16_norm))


def test_float32_pairs_load_and_convert(tmp_path):
    from muse_spark.builder.tiny import make_tiny

    make_tiny(tmp_path, kind="random", seed=2, dtype="float32")
    target, draft = load_pair(tmp_path / "target", tmp_path / "draft")
    assert target.dtype == draft.dtype == torch.float32
    target, draft = load_pair(tmp_path / "target", tmp_path / "draft", dtype="bfloat16")
    assert target.dtype == draft.dtype == torch.bfloat16


def test_a_folder_in_place_of_the_checkpoint_file(agreeing_pair, tmp_path):
    d = clone(agreeing_pair[0], tmp_path / "target")
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=f"cannot read checkpoint file {d / 'model.safetensors'}: is a directory"):
        load_target(d)
