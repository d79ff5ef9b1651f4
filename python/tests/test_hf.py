"""attn_implementation="attnkit" (attnkit.hf) end to end on small randomly initialized
transformers models built from a config here (no downloads).

Each model runs three ways from one set of weights: attnkit, the model's own SDPA path in the
same dtype (the naive yardstick; eager where SDPA cannot run the model), and that path in
float64 (the oracle). The logits must satisfy docs/testing.md's rule
max|attnkit - ref64| <= 2 * max|naive - ref64| + 1e-3, and each test also checks that a wrong
mask would have broken that bound (so the comparison can fail). CPU tests run on the reference
backend; the CUDA variants need a GPU and attnkit's CUDA backend (bf16)."""

import copy

import numpy as np
import pytest

from conftest import assert_close

import attnkit

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("attnkit.hf")

from model_checks import DEVICES, seed  # noqa: E402
from model_checks import check_outputs as _check  # noqa: E402


def _variants(model, device, dtype, naive="sdpa"):
    """(attnkit, naive, ref64) copies of one randomly initialized model, in eval mode; ref64 runs
    the naive implementation in float64 (eager's finfo.min mask overflows to NaN in float64 on
    fully padded rows, SDPA's boolean mask does not)."""
    model = model.eval()
    out = []
    for impl, dt in (("attnkit", dtype), (naive, dtype), (naive, torch.float64)):
        m = copy.deepcopy(model).to(device=device, dtype=dt)
        m.set_attn_implementation(impl)
        out.append(m)
    return out


def _logits(model, **inputs):
    with torch.no_grad():
        return model(**inputs).logits.double().cpu().numpy()


def _llama(rng, **extra):
    seed(rng)
    config = transformers.LlamaConfig(
        vocab_size=101,
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        initializer_range=0.2,
        **extra,
    )
    return transformers.LlamaForCausalLM(config)


def _ids(rng, shape, vocab=101, device="cpu"):
    return torch.from_numpy(rng.integers(0, vocab, size=shape)).to(device)


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_llama_causal_batch(rng, device, dtype, monkeypatch):
    ours, naive, ref = _variants(_llama(rng), device, dtype)
    ids = _ids(rng, (3, 37), device=device)
    calls = []
    prefill = attnkit.prefill
    monkeypatch.setattr(attnkit, "prefill", lambda *a, **kw: calls.append(kw) or prefill(*a, **kw))
    wrong = copy.deepcopy(ref)
    wrong.config.is_causal = False  # bidirectional: what a lost causal mask would compute
    for layer in wrong.model.layers:
        layer.self_attn.is_causal = False
    _check(_logits(ours, input_ids=ids), _logits(naive, input_ids=ids), _logits(ref, input_ids=ids),
           wrong=_logits(wrong, input_ids=ids))
    assert len(calls) == 2 and all(c["causal"] for c in calls)  # one prefill per layer


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_llama_left_padded_batch_and_decode_steps(rng, device, dtype):
    """Left-padded prompts (transformers' batched generation), then decode steps through the
    model's DynamicCache: the boolean-mask path (unpadded varlen prefill), compared at the
    prompts' real tokens and at every step."""
    models = _variants(_llama(rng), device, dtype)
    lens = [29, 17, 1, 23]
    width = max(lens)
    ids = _ids(rng, (len(lens), width), device=device)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lens):
        mask[b, width - n:] = 1
    steps = [_ids(rng, (len(lens), 1), device=device) for _ in range(3)]
    keep = mask.bool().cpu().numpy()
    results = []
    for model in models:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            logits = [out.logits.double().cpu().numpy()[keep]]
            cache, step_mask = out.past_key_values, mask
            for tok in steps:
                step_mask = torch.cat([step_mask, torch.ones_like(tok)], 1)
                # past_key_values: the spelling every transformers 5.x takes (later ones
                # also take cache=).
                out = model(input_ids=tok, attention_mask=step_mask, past_key_values=cache,
                            use_cache=True)
                logits.append(out.logits.double().cpu().numpy()[:, 0])
                cache = out.past_key_values
        results.append(logits)
    with torch.no_grad():  # attending the padding: what an ignored mask would compute
        wrong = models[2](input_ids=ids).logits.double().cpu().numpy()[keep]
    for i, (ours, naive, ref) in enumerate(zip(*results)):
        _check(ours, naive, ref, wrong=wrong if i == 0 else None)


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_mistral_sliding_window(rng, device, dtype):
    seed(rng)
    window = 6
    config = transformers.MistralConfig(
        vocab_size=101, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, sliding_window=window,
        max_position_embeddings=256, initializer_range=0.2)
    models = _variants(transformers.MistralForCausalLM(config), device, dtype)
    ids = _ids(rng, (2, 31), device=device)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding on one row
    keep = mask.bool().cpu().numpy()
    ours, naive, ref = (_logits(m, input_ids=ids, attention_mask=mask) for m in models)
    wide = copy.deepcopy(models[2])
    wide.config.sliding_window = None  # full causal attention instead of the window
    for layer in wide.model.layers:
        layer.self_attn.sliding_window = None
    wide.config.layer_types = ["full_attention"] * config.num_hidden_layers
    _check(ours, naive, ref, wrong=_logits(wide, input_ids=ids, attention_mask=mask), keep=keep)


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_gemma2_softcap_and_alternating_windows(rng, device, dtype):
    """Gemma 2: logit soft-capping (which SDPA rejects, so the yardstick is eager in the same
    dtype), a query_pre_attn_scalar scale and sliding / full layers in turn."""
    seed(rng)
    config = transformers.Gemma2Config(
        vocab_size=101, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=8,
        query_pre_attn_scalar=48, attn_logit_softcapping=2.0, final_logit_softcapping=None,
        max_position_embeddings=256, initializer_range=0.2)
    model = transformers.Gemma2ForCausalLM(config)
    ours, naive, ref = _variants(model, device, dtype, naive="eager")
    ids = _ids(rng, (2, 27), device=device)
    uncapped = copy.deepcopy(ref)
    uncapped.config.attn_logit_softcapping = None
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    _check(_logits(ours, input_ids=ids), _logits(naive, input_ids=ids),
           _logits(ref, input_ids=ids), wrong=_logits(uncapped, input_ids=ids))


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_bert_bidirectional_with_padding(rng, device, dtype):
    """An encoder: bidirectional attention with key padding (dense() without a mask, the varlen
    prefill with causal=False with one); every position compared, padded queries included."""
    seed(rng)
    config = transformers.BertConfig(
        vocab_size=101, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=384, max_position_embeddings=64, initializer_range=0.2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    models = _variants(transformers.BertModel(config), device, dtype)
    ids = _ids(rng, (3, 19), device=device)
    mask = torch.ones_like(ids)
    mask[0, 11:] = 0
    mask[2, 4:] = 0

    def hidden(model, **kw):
        with torch.no_grad():
            return model(input_ids=ids, **kw).last_hidden_state.double().cpu().numpy()

    ours, naive, ref = (hidden(m, attention_mask=mask) for m in models)
    _check(ours, naive, ref, wrong=hidden(models[2]))
    ours, naive, ref = (hidden(m) for m in models)
    _check(ours, naive, ref)


def test_rejects_what_it_cannot_serve(rng):
    module = torch.nn.Module()
    q = torch.randn(2, 4, 5, 64)
    k = v = torch.randn(2, 2, 5, 64)

    def call(**kw):
        return hf.attention_forward(module, q, k, v, kw.pop("attention_mask", None), **kw)

    with pytest.raises(attnkit.Error, match="attention_mask: dtype torch.float32"):
        call(attention_mask=torch.zeros(2, 1, 5, 5))
    random_mask = torch.from_numpy(rng.random((2, 1, 5, 5)) < 0.5)
    random_mask[..., 0] = True
    with pytest.raises(attnkit.Error, match="attention_mask: is not a causal"):
        call(attention_mask=random_mask)
    per_head = torch.ones(2, 4, 5, 5, dtype=torch.bool).tril()
    per_head[:, 1, 4, 0] = False
    with pytest.raises(attnkit.Error, match="attention_mask: differs between heads"):
        call(attention_mask=per_head)
    with pytest.raises(attnkit.Error, match="dropout: got 0.1"):
        call(dropout=0.1)
    with pytest.raises(attnkit.Error, match="position_bias"):
        call(position_bias=torch.zeros(2, 4, 5, 5))
    with pytest.raises(attnkit.Error, match="s_aux"):
        call(s_aux=torch.zeros(4))
    with pytest.raises(attnkit.Error, match="output_attentions"):
        call(output_attentions=True)
    with pytest.raises(attnkit.Error, match="value: head_dim 32"):
        hf.attention_forward(module, q, k, v[..., :32], None)
    with pytest.raises(attnkit.Error, match="sliding_window"):
        call(is_causal=False, sliding_window=3)


def test_t5_position_bias_is_rejected(rng):
    """T5 adds a learned relative position bias to the logits (the position_bias argument of the
    attention function), which attnkit does not compute. T5's encoder and decoder stacks hold
    copies of the model's config, which model.set_attn_implementation() leaves as they were, so
    attnkit is chosen at construction, and the test checks that the stacks took it."""
    seed(rng)
    config = transformers.T5Config(vocab_size=101, d_model=64, d_kv=16, d_ff=128, num_layers=1,
                                   num_heads=4, dropout_rate=0.0)
    model = transformers.AutoModel.from_config(config, attn_implementation="attnkit").eval()
    for part in (model, model.encoder, model.decoder):
        assert part.config._attn_implementation == "attnkit", type(part).__name__
    ids = _ids(rng, (1, 7))
    rejected = pytest.raises(attnkit.Error, match="^position_bias: given by T5Attention")
    with torch.no_grad(), rejected:
        model(input_ids=ids, decoder_input_ids=ids)


def test_matches_sdpa_function_directly(rng):
    """The function against torch's SDPA on raw tensors: GQA, a padded causal mask from
    transformers' own builder, a scale."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    module = torch.nn.Module()
    module.is_causal = True
    b, hq, hkv, s, d = 2, 6, 2, 13, 64
    q, k, v = (torch.from_numpy(rng.standard_normal((b, h, s, d))).float()
               for h in (hq, hkv, hkv))
    pad = torch.ones(b, s, dtype=torch.bool)
    pad[1, :4] = False
    mask = sdpa_mask(batch_size=b, q_length=s, kv_length=s, attention_mask=pad,
                     mask_function=causal_mask_function, allow_is_causal_skip=False)
    out, weights = hf.attention_forward(module, q, k, v, mask, scaling=0.2)
    assert weights is None and out.shape == (b, s, hq, d)

    def sdpa(dtype):
        kk, vv = (x.to(dtype).repeat_interleave(hq // hkv, 1) for x in (k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q.to(dtype), kk, vv, attn_mask=mask,
                                                             scale=0.2)
        return o.transpose(1, 2).double().numpy()

    keep = pad.numpy()
    assert_close(out.numpy()[keep], sdpa(torch.float64)[keep], sdpa(torch.float32)[keep])
    assert np.all(out.numpy()[~keep] == 0.0)  # padded query rows: zeros, never NaN
