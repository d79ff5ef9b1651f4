"""attnkit.diffusers processors end to end on small randomly initialized diffusers models built
from a config here (no downloads): a UNet2DConditionModel (self + cross attention) and an
SD3Transformer2DModel (joint attention, plus SD3.5's dual self-attention).

Each model runs with attnkit's processors, with its own SDPA processors in the same dtype (the
naive yardstick) and with those in float64 (the oracle); the outputs must satisfy
docs/testing.md's rule max|attnkit - ref64| <= 2 * max|naive - ref64| + 1e-3, and the float64
model with every query doubled (twice the logits) must miss it widely (the comparison can fail).
CUDA variants (bf16) need a GPU and attnkit's CUDA backend."""

import copy

import pytest

import attnkit

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
akd = pytest.importorskip("attnkit.diffusers")

from model_checks import DEVICES, check_outputs, seed  # noqa: E402


def _randn(rng, shape, device, dtype):
    return torch.from_numpy(rng.standard_normal(shape)).to(device=device, dtype=dtype)


def _variants(model, device, dtype, config=None):
    """(attnkit, naive, ref64, wrong64) copies of one model: attnkit's processors, the model's
    own, those in float64, and float64 with the queries doubled."""
    model = model.eval()
    ours = copy.deepcopy(model).to(device=device, dtype=dtype)
    akd.set_processors(ours, config)
    naive = copy.deepcopy(model).to(device=device, dtype=dtype)
    ref = copy.deepcopy(model).to(device=device, dtype=torch.float64)
    wrong = copy.deepcopy(ref)
    with torch.no_grad():
        for module in wrong.modules():
            if hasattr(module, "set_processor"):
                _double_queries(module)
    return ours, naive, ref, wrong


def _double_queries(attn):
    """Twice the logits (attention at twice the softmax scale): the last scaling step of each
    query path, its q norm's weight or else the projection."""
    for norm, proj in (("norm_q", "to_q"), ("norm_added_q", "add_q_proj")):
        target = getattr(attn, norm, None)
        if target is None:
            target = getattr(attn, proj, None)
        for param in (getattr(target, "weight", None), getattr(target, "bias", None)):
            if param is not None:
                param.mul_(2)


def _check(*outputs):
    check_outputs(*(x.double().cpu().numpy() for x in outputs))


def _unet(rng):
    seed(rng)
    return diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(64, 128), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=48,
        attention_head_dim=(1, 2), norm_num_groups=32)


def _sd3(rng):
    seed(rng)
    return diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
        attention_head_dim=64, num_attention_heads=2, joint_attention_dim=40,
        caption_projection_dim=128, pooled_projection_dim=24, pos_embed_max_size=16,
        dual_attention_layers=(0,), qk_norm="rms_norm")


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_unet_self_and_cross_attention(rng, device, dtype):
    models = _variants(_unet(rng), device, dtype)
    sample = _randn(rng, (2, 4, 8, 8), device, dtype)
    context = _randn(rng, (2, 7, 48), device, dtype)
    outs = []
    for m in models:
        dt = next(m.parameters()).dtype
        with torch.no_grad():
            outs.append(m(sample.to(dt), 10, encoder_hidden_states=context.to(dt)).sample)
    _check(*outs)


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_sd3_joint_attention(rng, device, dtype):
    models = _variants(_sd3(rng), device, dtype)
    sample = _randn(rng, (2, 4, 8, 8), device, dtype)
    context = _randn(rng, (2, 5, 40), device, dtype)
    pooled = _randn(rng, (2, 24), device, dtype)
    step = torch.tensor([3.0, 700.0], device=device)
    outs = []
    for m in models:
        dt = next(m.parameters()).dtype
        with torch.no_grad():
            outs.append(m(hidden_states=sample.to(dt), encoder_hidden_states=context.to(dt),
                          pooled_projections=pooled.to(dt), timestep=step).sample)
    _check(*outs)


def test_roles_reach_dense(rng, monkeypatch):
    """Every call passes the config, its role (self / cross / joint, or the one ``roles`` fixes)
    and the timestep that set_timestep gave to dense()."""
    calls = []
    dense = attnkit.dense
    monkeypatch.setattr(attnkit, "dense", lambda *a, **kw: calls.append(kw) or dense(*a, **kw))
    config = attnkit.AttentionConfig.from_json('{"per_role": {"cross": {"backend": "auto"}}}')

    unet = _unet(rng).eval()
    procs = akd.set_processors(unet, config, roles=lambda n: "self.up" if "up_blocks" in n and
                               n.endswith("attn1.processor") else None)
    akd.set_timestep(unet, 0.25)
    with torch.no_grad():
        unet(torch.randn(1, 4, 8, 8), 5, encoder_hidden_states=torch.randn(1, 3, 48))
    roles = sorted(c["role"] for c in calls)
    assert roles.count("cross") == roles.count("self") + roles.count("self.up") == len(procs) // 2
    assert roles.count("self.up") > 0 and roles.count("self") > 0
    assert all(c["config"] is config and c["timestep"] == 0.25 for c in calls)

    calls.clear()
    sd3 = _sd3(rng).eval()
    akd.set_processors(sd3, config)
    with torch.no_grad():
        sd3(hidden_states=torch.randn(1, 4, 8, 8), encoder_hidden_states=torch.randn(1, 5, 40),
            pooled_projections=torch.randn(1, 24), timestep=torch.tensor([1.0]))
    assert sorted(c["role"] for c in calls) == ["joint", "joint", "self"]  # dual layer 0: self


def test_rejections(rng):
    unet = _unet(rng).eval()
    akd.set_processors(unet)
    with torch.no_grad(), pytest.raises(attnkit.Error, match="attention_mask"):
        unet(torch.randn(1, 4, 8, 8), 5, encoder_hidden_states=torch.randn(1, 3, 48),
             encoder_attention_mask=torch.ones(1, 3))
    other = _unet(rng)
    from diffusers.models.attention_processor import AttnAddedKVProcessor

    name = next(iter(other.attn_processors))
    other.set_attn_processor({n: (AttnAddedKVProcessor() if n == name else p)
                              for n, p in other.attn_processors.items()})
    before = {n: type(p) for n, p in other.attn_processors.items()}
    with pytest.raises(attnkit.Error, match="model: the processor .* is a AttnAddedKVProcessor"):
        akd.set_processors(other)
    assert {n: type(p) for n, p in other.attn_processors.items()} == before  # nothing changed
    with pytest.raises(attnkit.Error, match="config: expected an attnkit.AttentionConfig"):
        akd.AttnProcessor({"default": {}})
    with pytest.raises(attnkit.Error, match="empty part"):
        akd.AttnProcessor(attnkit.AttentionConfig(), role="self..video")
