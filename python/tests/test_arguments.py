"""Bad arguments of every public function raise attnkit.Error naming the argument as the Python
function spells it (never TypeError with nanobind's signature listing, std::bad_cast, or NumPy's
own errors), and write nothing; empty batches (zero-size arrays) run on every entry point."""

import re

import numpy as np
import pytest

import attnkit

HQ, HKV, D = 4, 2, 16


def _f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _nan(*shape, dtype=np.float32):
    return np.full(shape, np.nan, dtype=dtype)


def _read_only(a):
    a = a.copy()
    a.setflags(write=False)
    return a


# ---- the valid call of each function, which every case below breaks in one argument ----------


def _prefill(rng):
    q, k, v = _f32(rng, 6, HQ, D), _f32(rng, 6, HKV, D), _f32(rng, 6, HKV, D)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=[0, 2, 6], cu_seqlens_k=[0, 2, 6], out=_nan(6, HQ, D))
    return attnkit.prefill, args


def _decode(rng):
    cache = rng.standard_normal((6, HKV, 8, D)).astype(np.float16)
    args = dict(q=_f32(rng, 2, HQ, D), k_cache=cache, v_cache=cache.copy(), seq_lens=[5, 9],
                block_table=[[0, 1, 2], [3, 4, 5]], out=_nan(2, HQ, D))
    return attnkit.decode, args


def _append_kv(rng):
    cache = np.zeros((4, HKV, 8, D), np.float16)
    view = attnkit.KvView(cache, cache.copy(), None, [[0, 1], [2, 3]])
    qkv = rng.standard_normal((3, (HQ + 2 * HKV) * D)).astype(np.float16)
    args = dict(kv_cache=view, positions=[0, 1, 2], row_of_token=[0, 0, 1], qkv=qkv,
                q_out=_nan(3, HQ, D, dtype=np.float16))
    return attnkit.append_kv, args


def _forward(rng):
    cache = attnkit.KvCache(num_kv_heads=HKV, head_dim=D, max_seq_len=64, tokens_per_block=16,
                            dtype="f16", max_tokens=256)
    cache.add(0, [1, 2, 3])
    qkv = rng.standard_normal((3, (HQ + 2 * HKV) * D)).astype(np.float16)
    args = dict(qkv=qkv, kv_cache=cache.view(0, [0]), cu_seqlens_q=[0, 3], past_lens=[0],
                num_context=1, out=_nan(3, HQ, D, dtype=np.float16))
    return attnkit.forward, args


def _dense(rng):
    args = dict(q=_f32(rng, 1, 8, HQ, D), k=_f32(rng, 1, 8, HKV, D), v=_f32(rng, 1, 8, HKV, D),
                out=_nan(1, 8, HQ, D))
    return attnkit.dense, args


def _merge_states(rng):
    args = dict(out_a=_f32(rng, 3, 2, 8), lse_a=_f32(rng, 3, 2), out_b=_f32(rng, 3, 2, 8),
                lse_b=_f32(rng, 3, 2), out=_nan(3, 2, 8))
    return attnkit.merge_states, args


def _kv_view(rng):
    cache = np.zeros((4, HKV, 8, D), np.float16)
    return attnkit.KvView, dict(k=cache, v=cache.copy(), seq_lens=[3], block_table=[[0, 1]])


def _kv_cache_args():
    return dict(num_kv_heads=HKV, head_dim=D, max_seq_len=64, tokens_per_block=16, dtype="f16",
                max_tokens=256)


def _kv_cache(rng):
    return attnkit.KvCache, _kv_cache_args()


def _decode_workspace(rng):
    # Valid but for the device on a CPU-only build; the cases break an argument checked first.
    args = dict(num_q_heads=8, num_kv_heads=2, head_dim=128, max_rows=4, max_splits=8,
                device="cuda")
    return attnkit.DecodeWorkspace, args


def _alibi(rng):
    return attnkit.default_alibi_slopes, dict(num_heads=8)


def _check_errors(rng):
    return attnkit.check_errors, dict(stream=0)


def _from_json(rng):
    return attnkit.AttentionConfig.from_json, dict(text='{"default": {"backend": "auto"}}')


def _from_file(rng):
    return attnkit.AttentionConfig.from_file, dict(path="/nonexistent/attnkit.json")


def _resolve(rng):
    config = attnkit.AttentionConfig.from_json('{"default": {"backend": "auto"}}')
    return config.resolve, dict(role="self")


def _cache_method(name, **args):
    def make(rng):
        cache = attnkit.KvCache(**_kv_cache_args())
        cache.add(0, [1, 2, 3])
        return getattr(cache, name), args

    make.__name__ = f"_kv_cache_{name}"
    return make


def _skip(**skip):
    return dict(skip_softmax=skip)


CALIBRATED = dict(target_sparsity=0.5, calibration={"a": 80.0, "b": 4.0})

# (valid call, arguments that replace its own, the Python name the message must lead with, and
# an optional fragment it must also hold: what is accepted).
CASES = [
    # prefill
    (_prefill, dict(q=[[1.0]]), "q", "expected an array"),
    (_prefill, dict(q=np.zeros((6, HQ * D), np.float32)), "q", "3 dimensions"),
    (_prefill, dict(q=np.zeros((6, HQ, D))), "q", "float64"),
    (_prefill, dict(q=np.zeros((6, HQ, 2 * D), np.float32)[..., ::2]), "q", "contiguous"),
    (_prefill, dict(q=np.zeros((6, HQ, 20), np.float32)), "q.shape[2]", "multiple of 8"),
    (_prefill, dict(k=np.zeros((6, 3, D), np.float32)), "k.shape[1]", "must divide q.shape[1]"),
    (_prefill, dict(v=np.zeros((5, HKV, D), np.float32)), "v", None),
    (_prefill, dict(window=2**40), "window", "[-2147483648, 2147483647]"),
    (_prefill, dict(window=1.5), "window", "integer"),
    (_prefill, dict(window="8"), "window", "integer"),
    (_prefill, dict(window=-1), "window", ">= 1"),
    (_prefill, dict(window=4, sink_tokens=-1), "sink_tokens", ">= 0"),
    (_prefill, dict(sink_tokens=2), "sink_tokens", "sliding window"),
    (_prefill, dict(causal="yes"), "causal", "True or False"),
    (_prefill, dict(causal=None), "causal", "True or False"),
    (_prefill, dict(softcap="x"), "softcap", "a number"),
    (_prefill, dict(softcap=-1.0), "softcap", ">= 0"),
    (_prefill, dict(softcap=float("nan")), "softcap", "finite"),
    (_prefill, dict(softmax_scale="a"), "softmax_scale", "a number"),
    (_prefill, dict(softmax_scale=-1.0), "softmax_scale", ">= 0"),
    (_prefill, dict(alibi="yes"), "alibi", "sequence"),
    (_prefill, dict(alibi=[1.0]), "alibi", "needs q.shape[1]=4 values"),
    (_prefill, dict(alibi=[float("inf")] * HQ), "alibi", "finite"),
    (_prefill, dict(alibi=["a"] * HQ), "alibi[0]", "a number"),
    (_prefill, dict(backend=3), "backend", "a str"),
    (_prefill, dict(backend="fast"), "backend", "'auto', 'fused' or 'vanilla'"),
    (_prefill, dict(kernel="x"), "kernel", "'auto', 'portable' or 'hopper'"),
    (_prefill, dict(out=_read_only(_nan(6, HQ, D))), "out", "writable"),
    (_prefill, dict(out=[0.0] * 6), "out", "expected an array"),
    (_prefill, dict(out=_nan(6, HQ, D - 8)), "out", None),
    (_prefill, dict(out=_nan(6, HQ, D, dtype=np.float16)), "out", None),
    (_prefill, dict(lse=_read_only(_nan(6, HQ))), "lse", "writable"),
    (_prefill, dict(cu_seqlens_q=[0, 2.5, 6]), "cu_seqlens_q", "integers"),
    (_prefill, dict(cu_seqlens_q="abc"), "cu_seqlens_q", None),
    (_prefill, dict(cu_seqlens_q=[0, 2**40, 6]), "cu_seqlens_q", "int32"),
    (_prefill, dict(cu_seqlens_q=[0, 2, 7]), "cu_seqlens_q", None),
    (_prefill, dict(cu_seqlens_q=np.array([0, 2, 6], np.float32)), "cu_seqlens_q", "int32"),
    (_prefill, dict(cu_seqlens_k=[0, 2, 5]), "cu_seqlens_k", "k.shape[0]"),
    (_prefill, dict(max_seqlen_q=-1), "max_seqlen_q", ">= 0"),
    (_prefill, dict(max_seqlen_k=-1), "max_seqlen_k", ">= 0"),
    (_prefill, dict(max_seqlen_k=2**40), "max_seqlen_k", "integer"),
    (_prefill, dict(return_lse="no"), "return_lse", "True or False"),
    (_prefill, dict(checked=2), "checked", "True or False"),
    (_prefill, dict(stream=-1), "stream", "[0, 18446744073709551615]"),
    (_prefill, dict(stream="s"), "stream", "integer"),
    (_prefill, dict(k=None, v=None, cu_seqlens_k=None, kv_cache="cache"), "kv_cache", "KvView"),
    # decode
    (_decode, dict(k_cache=[[0.0]]), "k_cache", "expected an array"),
    (_decode, dict(k_cache=np.zeros((6, HKV, D), np.float16)), "k_cache", "4 dimensions"),
    (_decode, dict(v_cache=np.zeros((6, HKV, 4, D), np.float16)), "v_cache", "shape"),
    (_decode, dict(k_cache=np.zeros((6, HKV, 8, D), np.float32),
                   v_cache=np.zeros((6, HKV, 8, D), np.float32)), "k_cache", "bf16, f16"),
    (_decode, dict(seq_lens=[5, 99]), "seq_lens", "capacity"),
    (_decode, dict(seq_lens=[5.5, 9]), "seq_lens", "integers"),
    (_decode, dict(block_table=[[0, 1, 2], [3, 99, 5]]), "block_table", "99"),
    (_decode, dict(k_scale=np.ones(1)), "k_scale", "float64"),
    (_decode, dict(kv_dtype=5), "kv_dtype", "a str"),
    (_decode, dict(kv_dtype="f32"), "kv_dtype", "'bf16', 'f16', 'fp8_e4m3' or 'int8'"),
    (_decode, dict(window_slots="x"), "window_slots", "integer"),
    (_decode, dict(window_slots=-1), "window_slots", ">= 0"),
    (_decode, dict(beam_width=0), "beam_width", ">= 1"),
    (_decode, dict(beam_width=2**40), "beam_width", "integer"),
    (_decode, dict(num_splits=-1), "num_splits", ">= 0"),
    (_decode, dict(max_seq_len=-1), "max_seq_len", ">= 0"),
    (_decode, dict(workspace=bytearray(16)), "workspace", "DecodeWorkspace"),
    (_decode, dict(deterministic="x"), "deterministic", "True or False"),
    (_decode, dict(batch_invariant=None), "batch_invariant", "True or False"),
    (_decode, dict(cache_indirection=[[1]]), "cache_indirection", None),
    (_decode, dict(out=_read_only(_nan(2, HQ, D))), "out", "writable"),
    (_decode, dict(q=np.zeros((2, HQ, 8), np.float32), out=None), "k_cache.shape[3]",
     "q.shape[2] (8)"),
    # append_kv
    (_append_kv, dict(kv_cache="x"), "kv_cache", "KvView"),
    (_append_kv, dict(qkv=np.zeros((3, 100), np.float16)), "qkv", "(Hq + 2 * Hkv) * D"),
    (_append_kv, dict(qkv=[[0.0] * 128] * 3), "qkv", "expected an array"),
    (_append_kv, dict(num_q_heads=0), "num_q_heads", "integer"),
    (_append_kv, dict(num_q_heads=3), "kv_cache.k.shape[1]", "must divide num_q_heads (3)"),
    (_append_kv, dict(num_q_heads=6), "qkv", None),
    (_append_kv, dict(positions=[0, 1]), "positions", None),
    (_append_kv, dict(positions=[0, -1, 2]), "positions", ">= 0"),
    (_append_kv, dict(row_of_token=[0, 0, 7]), "row_of_token", None),
    (_append_kv, dict(rope="rotary"), "rope", "'none', 'gpt_neox' or 'gptj'"),
    (_append_kv, dict(rope="gpt_neox", rotary_dim=3), "rotary_dim", "even"),
    (_append_kv, dict(rope="gpt_neox", rope_base="x"), "rope_base", "a number"),
    (_append_kv, dict(rope="gpt_neox", rope_base=0.5), "rope_base", "> 1"),
    (_append_kv, dict(rope_scaling="cubic"), "rope_scaling", "'none', 'linear' or 'llama3'"),
    (_append_kv, dict(rope="gpt_neox", rope_scaling="linear", rope_factor=0), "rope_factor",
     "> 0"),
    (_append_kv, dict(rope="gpt_neox", rope_scaling="llama3", low_freq_factor=5.0),
     "low_freq_factor, high_freq_factor", "low_freq_factor < high_freq_factor"),
    (_append_kv, dict(rope="gpt_neox", rope_scaling="llama3", original_max_position=0),
     "original_max_position", ">= 1"),
    (_append_kv, dict(q_out=_read_only(_nan(3, HQ, D, dtype=np.float16))), "q_out", "writable"),
    (_append_kv, dict(qkv_bias=np.zeros(7, np.float16)), "qkv_bias", None),
    # forward: a qkv width that leaves no query heads once gave NumPy's "negative dimensions"
    (_forward, dict(qkv=np.zeros((3, 2 * D), np.float16)), "qkv", "Hq >= 1"),
    (_forward, dict(past_lens=[0.5]), "past_lens", "integers"),
    (_forward, dict(cu_seqlens_q=[0, 2]), "cu_seqlens_q", None),
    (_forward, dict(num_context=2), "num_context", None),
    (_forward, dict(num_context="1"), "num_context", "integer"),
    (_forward, dict(decode_workspace=3), "decode_workspace", "DecodeWorkspace"),
    (_forward, dict(kv_cache=None), "kv_cache", "KvView"),
    (_forward, dict(softcap=-2.0), "softcap", ">= 0"),
    # dense
    (_dense, dict(skip_softmax=0.1), "skip_softmax", "a dict"),
    (_dense, dict(skip_softmax=True), "skip_softmax", "a dict"),
    (_dense, _skip(treshold=0.1), "skip_softmax", "unknown key 'treshold'"),
    (_dense, _skip(threshold="x"), 'skip_softmax["threshold"]', "a number"),
    (_dense, _skip(threshold=-1.0), 'skip_softmax["threshold"]', ">= 0"),
    (_dense, _skip(target_sparsity=0.5), "skip_softmax", "calibration"),
    (_dense, _skip(target_sparsity=2.0, calibration={"a": 1.0, "b": 1.0}),
     'skip_softmax["target_sparsity"]', "[0, 1]"),
    (_dense, _skip(target_sparsity=0.5, calibration={"a": 1.0}), 'skip_softmax["calibration"]',
     '"b"'),
    (_dense, _skip(target_sparsity=0.5, calibration=[1.0, 2.0]), 'skip_softmax["calibration"]',
     '{"a": a, "b": b}'),
    (_dense, _skip(target_sparsity=0.5, calibration_a=1.0, calibration_b=1.0), "skip_softmax",
     "unknown key 'calibration_a'"),
    (_dense, _skip(**CALIBRATED, disabled_until_timestep=2.0),
     'skip_softmax["disabled_until_timestep"]', "[0, 1]"),
    (_dense, dict(quant="int8"), "quant", "a dict"),
    (_dense, dict(quant={"dtype_qk": "int4"}), 'quant["dtype_qk"]',
     "expected 'int8' or 'fp8_e4m3', got 'int4'"),
    (_dense, dict(quant={"q_block_size": 3}), "quant", "1, 4 or 16"),
    (_dense, dict(quant={"q_block_size": 2**40}), 'quant["q_block_size"]', "integer"),
    (_dense, dict(quant={1: 2}), "quant", "keys must be str"),
    (_dense, dict(timestep=2.0), "timestep", None),
    (_dense, dict(timestep="x"), "timestep", "a number"),
    (_dense, dict(block_m=100), "block_m", "16, 32, 64, 128 or 256"),
    (_dense, dict(block_n=2.0), "block_n", "integer"),
    (_dense, dict(config="cfg"), "config", "AttentionConfig"),
    (_dense, dict(config=attnkit.AttentionConfig(), role=3), "role", "a str"),
    (_dense, dict(return_stats="x"), "return_stats", "True or False"),
    (_dense, dict(skip_stats=np.zeros(2, np.int32)), "skip_stats", None),
    (_dense, dict(k=np.zeros((1, 8, 3, D), np.float32)), "k.shape[2]", "must divide"),
    (_dense, dict(q=np.zeros((8, HQ, D), np.float32)), "q", "4 dimensions"),
    # merge_states
    (_merge_states, dict(lse_a=np.zeros((3, 3), np.float32)), "lse_a", None),
    (_merge_states, dict(out_b=[[0.0]]), "out_b", "expected an array"),
    (_merge_states, dict(out=_read_only(_nan(3, 2, 8))), "out", "writable"),
    (_merge_states, dict(return_lse=None), "return_lse", "True or False"),
    (_merge_states, dict(lse_b=np.zeros((3, 2), np.float16)), "lse_b", None),
    # KvView
    (_kv_view, dict(k=[0.0]), "k", "expected an array"),
    (_kv_view, dict(v=np.zeros((4, HKV, D), np.float16)), "v", "4 dimensions"),
    (_kv_view, dict(window_slots="2"), "window_slots", "integer"),
    (_kv_view, dict(kv_dtype=1), "kv_dtype", "a str"),
    (_kv_view, dict(seq_lens=[1.5]), "seq_lens", "integers"),
    (_kv_view, dict(block_table=[[0, 2**33]]), "block_table", "int32"),
    # KvCache
    (_kv_cache, dict(dtype=np.float16), "dtype", "a str"),
    (_kv_cache, dict(dtype="f32"), "dtype", "'f16', 'bf16', 'fp8_e4m3' or 'int8'"),
    (_kv_cache, dict(num_kv_heads=0), "num_kv_heads", ">= 1"),
    (_kv_cache, dict(head_dim=2**40), "head_dim", "integer"),
    (_kv_cache, dict(max_tokens="x"), "max_tokens", "integer"),
    (_kv_cache, dict(max_seq_len=0), "max_seq_len", ">= 1"),
    (_kv_cache, dict(device="gpu"), "device", "'cpu', 'cuda' or 'cuda:N'"),
    (_kv_cache, dict(layer_windows=[1.5]), "layer_windows[0]", "integer"),
    (_kv_cache, dict(enable_prefix_reuse="yes"), "enable_prefix_reuse", "True or False"),
    (_kv_cache, dict(free_gpu_memory_fraction="most"), "free_gpu_memory_fraction", "a number"),
    (_kv_cache, dict(stream=-1), "stream", "integer"),
    (_cache_method("add", seq=1, prompt=[1]), dict(seq="a"), "seq", "integer"),
    (_cache_method("add", seq=1, prompt=[1]), dict(prompt=[1.5]), "prompt[0]", "integer"),
    (_cache_method("add", seq=1, prompt=[1]), dict(prompt=[2**40]), "prompt[0]", "integer"),
    (_cache_method("add", seq=1, prompt=[1]), dict(prompt=5), "prompt", "sequence"),
    (_cache_method("add", seq=1, prompt=[1]), dict(salt=-1), "salt", "integer"),
    (_cache_method("add", seq=1, prompt=[1]), dict(priority=2**40), "priority", "integer"),
    (_cache_method("add", seq=1, prompt=[1]), dict(seq=0), "KvCache.add", None),
    (_cache_method("append", seq=0, tokens=[1]), dict(tokens=["x"]), "tokens[0]", "integer"),
    (_cache_method("fork", src=0, dst=1), dict(src="a"), "src", "integer"),
    (_cache_method("fork", src=0, dst=1), dict(dst=0), "KvCache.fork", None),
    (_cache_method("release", seq=0), dict(seq=None), "seq", "integer"),
    (_cache_method("length", seq=0), dict(seq=1.0), "seq", "integer"),
    (_cache_method("reorder_beams", beams=[0], parents=[0]), dict(parents=[0.5]), "parents[0]",
     "integer"),
    (_cache_method("view", layer=0, seqs=[0]), dict(layer=5), "KvCache.window_slots", "layer"),
    (_cache_method("view", layer=0, seqs=[0]), dict(layer="0"), "layer", "integer"),
    (_cache_method("view", layer=0, seqs=[0]), dict(seqs=["a"]), "seqs[0]", "integer"),
    (_cache_method("block_tables", seqs=[0]), dict(seqs=0), "seqs", "sequence"),
    (_cache_method("cache_indirection", beams=[0], beam_width=1, max_seq=4), dict(beam_width=0),
     "beam_width", ">= 1"),
    (_cache_method("probe_prefix", prompt=[1]), dict(salt="x"), "salt", "integer"),
    # DecodeWorkspace, default_alibi_slopes, check_errors, AttentionConfig
    (_decode_workspace, dict(num_q_heads="8"), "num_q_heads", "integer"),
    (_decode_workspace, dict(max_rows=2**70), "max_rows", "integer"),
    (_decode_workspace, dict(device=3), "device", "a str"),
    (_decode_workspace, dict(device="gpu"), "device", "'cpu', 'cuda' or 'cuda:N'"),
    (_decode_workspace, dict(num_kv_heads=3), "num_kv_heads", "must divide num_q_heads"),
    (_alibi, dict(num_heads=-1), "num_heads", "[1, 65536]"),
    (_alibi, dict(num_heads=0), "num_heads", "[1, 65536]"),
    (_alibi, dict(num_heads=2**40), "num_heads", "integer"),
    (_alibi, dict(num_heads="4"), "num_heads", "integer"),
    (_check_errors, dict(stream=-1), "stream", "integer"),
    (_check_errors, dict(stream="x"), "stream", "integer"),
    (_from_json, dict(text=123), "text", "a str"),
    (_from_file, dict(path=123), "path", "os.PathLike"),
    (_resolve, dict(role=3), "role", "a str"),
]


def _case_id(case):
    make, changed, name, _ = case
    values = ",".join(f"{k}={v!r}"[:30] for k, v in changed.items())
    return f"{make.__name__.lstrip('_')}-{name}-{values}"


def _leads_with(message, name):
    """The message's subject is `name`: "name: ...", "op: name: ..." or "name of ..."."""
    return re.search(r"(^|: )" + re.escape(name) + r"(:| )", message) is not None


# Every valid call that the cases start from runs (so a case fails only for its own argument).
@pytest.mark.parametrize(
    "make",
    [_prefill, _decode, _append_kv, _forward, _dense, _merge_states, _kv_view, _kv_cache, _alibi,
     _check_errors, _from_json, _resolve],
)
def test_the_valid_calls_run(rng, make):
    function, args = make(rng)
    function(**args)
    if "out" in args:
        assert np.isfinite(np.asarray(args["out"], np.float64)).all()


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_bad_argument_raises_error_naming_it(rng, case):
    make, changed, name, fragment = case
    function, args = make(rng)
    out_before = {
        k: np.array(v) for k, v in args.items() if k in ("out", "q_out") and k not in changed
    }
    args.update(changed)
    with pytest.raises(attnkit.Error) as err:
        function(**args)
    message = str(err.value)
    assert _leads_with(message, name), f"{name!r} is not the subject of: {message}"
    if fragment is not None:
        assert fragment in message, f"{fragment!r} not in: {message}"
    for leak in ("incompatible function arguments", "std::", "bad_cast", "spec.", "cu_seqlens_kv",
                 "KvCacheManagerConfig", "KvCacheManager::"):
        assert leak not in message, message
    for key, before in out_before.items():
        np.testing.assert_array_equal(args[key], before, err_msg=f"a rejected call wrote {key}")


def test_calibration_schema_is_the_json_configs():
    # The dict that a config resolves to is accepted back as skip_softmax= and means the same.
    text = ('{"default": {"skip_softmax": {"target_sparsity": 0.6, '
            '"calibration": {"a": 70.0, "b": 3.5}, "disabled_until_timestep": 0.8}}}')
    resolved = attnkit.AttentionConfig.from_json(text).resolve("self")["skip_softmax"]
    assert resolved == {"target_sparsity": 0.6, "calibration": {"a": 70.0, "b": 3.5},
                        "disabled_until_timestep": 0.8}
    rng = np.random.default_rng(7)
    q, k, v = _f32(rng, 1, 300, HQ, D), _f32(rng, 1, 300, HKV, D), _f32(rng, 1, 300, HKV, D)
    config = attnkit.AttentionConfig.from_json(text)
    for timestep in (0.5, 0.9):
        by_config, stats_config = attnkit.dense(q, k, v, config=config, role="self",
                                                timestep=timestep, block_m=16, block_n=16,
                                                return_stats=True)
        by_dict, stats_dict = attnkit.dense(q, k, v, skip_softmax=dict(resolved),
                                            timestep=timestep, block_m=16, block_n=16,
                                            return_stats=True)
        np.testing.assert_array_equal(by_config, by_dict)
        assert stats_config == stats_dict
    # lambda = a * exp(b * s) / Skv: a curve that makes lambda large skips tiles.
    _, stats = attnkit.dense(q, k, v, skip_softmax={"target_sparsity": 1.0,
                                                    "calibration": {"a": 1e6, "b": 1.0}},
                             block_m=16, block_n=16, return_stats=True)
    assert stats["tiles_skipped"] > 0


# ---- empty batches ------------------------------------------------------------------------------


def test_empty_prefill_runs_and_returns_empty_outputs(rng):
    q, k, v = _f32(rng, 6, HQ, D), _f32(rng, 6, HKV, D), _f32(rng, 6, HKV, D)
    out, lse = attnkit.prefill(q[:0], k[:0], v[:0], [0], [0], return_lse=True)
    assert out.shape == (0, HQ, D) and lse.shape == (0, HQ)
    out = attnkit.prefill(q[:0], k[:0], v[:0], [0, 0, 0], [0, 0, 0])
    assert out.shape == (0, HQ, D)
    # No queries over existing keys.
    assert attnkit.prefill(q[:0], k, v, [0, 0], [0, 6]).shape == (0, HQ, D)
    # Paged, with no rows.
    cache = np.zeros((2, HKV, 8, D), np.float32)
    view = attnkit.KvView(cache.astype(np.float16), cache.astype(np.float16),
                          np.zeros(0, np.int32), np.zeros((0, 2), np.int32))
    assert attnkit.prefill(q[:0], kv_cache=view, cu_seqlens_q=[0]).shape == (0, HQ, D)


def test_empty_decode_append_forward_leave_the_cache_untouched(rng):
    k = rng.standard_normal((4, HKV, 8, D)).astype(np.float16)
    v = rng.standard_normal((4, HKV, 8, D)).astype(np.float16)
    k0, v0 = k.copy(), v.copy()
    q = _f32(rng, 0, HQ, D)
    out, lse = attnkit.decode(q, k, v, np.zeros(0, np.int32), np.zeros((0, 2), np.int32),
                              return_lse=True)
    assert out.shape == (0, HQ, D) and lse.shape == (0, HQ)
    assert attnkit.decode(q, k, v, [], None).shape == (0, HQ, D)
    qkv = np.zeros((0, (HQ + 2 * HKV) * D), np.float16)
    view = attnkit.KvView(k, v, np.zeros(0, np.int32), np.zeros((0, 2), np.int32))
    assert attnkit.append_kv(view, [], [], qkv=qkv).shape == (0, HQ, D)
    assert attnkit.forward(qkv, view, [0], [], num_context=0).shape == (0, HQ, D)
    np.testing.assert_array_equal(k, k0)
    np.testing.assert_array_equal(v, v0)


def test_empty_dense_and_merge_states(rng):
    out, lse = attnkit.dense(_f32(rng, 0, 8, HQ, D), _f32(rng, 0, 8, HKV, D),
                             _f32(rng, 0, 8, HKV, D), return_lse=True)
    assert out.shape == (0, 8, HQ, D) and lse.shape == (0, 8, HQ)
    assert attnkit.dense(_f32(rng, 1, 0, HQ, D), _f32(rng, 1, 8, HKV, D),
                         _f32(rng, 1, 8, HKV, D)).shape == (1, 0, HQ, D)
    # Queries without keys: zeros and lse -inf (a fully masked row), never NaN.
    out, lse = attnkit.dense(_f32(rng, 1, 3, HQ, D), _f32(rng, 1, 0, HKV, D),
                             _f32(rng, 1, 0, HKV, D), out=_nan(1, 3, HQ, D), return_lse=True)
    np.testing.assert_array_equal(out, 0.0)
    assert np.all(lse == -np.inf)
    out, lse = attnkit.merge_states(_f32(rng, 0, 2, 8), _f32(rng, 0, 2), _f32(rng, 0, 2, 8),
                                    _f32(rng, 0, 2))
    assert out.shape == (0, 2, 8) and lse.shape == (0, 2)


# ---- torch tensors (skipped without torch; the CUDA ones without a GPU and a CUDA build) --------

try:
    import torch
except ImportError:
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="needs PyTorch")
needs_cuda = pytest.mark.skipif(
    torch is None or not (torch.cuda.is_available() and attnkit.info()["cuda"]),
    reason="needs PyTorch, a CUDA GPU and attnkit built with the CUDA backend",
)


def _torch_prefill_args(rng, device, dtype):
    make = lambda *shape: torch.from_numpy(_f32(rng, *shape)).to(device, dtype)  # noqa: E731
    return dict(q=make(6, HQ, D), k=make(6, HKV, D), v=make(6, HKV, D),
                cu_seqlens_q=[0, 2, 6], cu_seqlens_k=[0, 2, 6])


def _expect_error(name, fragment, function, **args):
    with pytest.raises(attnkit.Error) as err:
        function(**args)
    message = str(err.value)
    assert _leads_with(message, name), message
    assert fragment in message, message
    assert "incompatible function arguments" not in message and "std::" not in message


@needs_torch
def test_torch_bad_arguments_name_the_argument(rng):
    args = _torch_prefill_args(rng, "cpu", torch.float32)
    attnkit.prefill(**args)
    _expect_error("q", "detach()", attnkit.prefill,
                  **dict(args, q=args["q"].clone().requires_grad_()))
    cu64 = torch.tensor([0, 2, 6], dtype=torch.int64)
    _expect_error("cu_seqlens_q", "int32", attnkit.prefill, **dict(args, cu_seqlens_q=cu64))
    _expect_error("window", "integer", attnkit.prefill, **dict(args, window=torch.tensor(2**40)))
    out = torch.full((6, HQ, D), float("nan"), dtype=torch.float16)
    _expect_error("out", "dtype", attnkit.prefill, **dict(args, out=out))
    assert torch.isnan(out).all()


@needs_cuda
def test_cuda_bad_arguments_name_the_argument(rng):
    args = _torch_prefill_args(rng, "cuda", torch.bfloat16)
    attnkit.prefill(**args)
    out = torch.full((6, HQ, D), float("nan"), dtype=torch.bfloat16)  # on the CPU
    _expect_error("out", "cuda", attnkit.prefill, **dict(args, out=out))
    _expect_error("max_seqlen_q", ">= 0", attnkit.prefill, **dict(args, max_seqlen_q=-1))
    _expect_error("q", "detach()", attnkit.prefill,
                  **dict(args, q=args["q"].clone().requires_grad_()))
    _expect_error("kernel", "'auto', 'portable' or 'hopper'", attnkit.prefill,
                  **dict(args, kernel="fa3"))


@needs_cuda
def test_cuda_empty_batches_run_and_write_nothing(rng):
    make = lambda *shape: torch.from_numpy(_f32(rng, *shape)).to("cuda", torch.bfloat16)  # noqa
    q, k, v = make(6, HQ, D), make(6, HKV, D), make(6, HKV, D)
    assert attnkit.prefill(q[:0], k[:0], v[:0], [0], [0]).shape == (0, HQ, D)
    assert attnkit.prefill(q[:0], k, v, [0, 0], [0, 6]).shape == (0, HQ, D)
    cache = attnkit.KvCache(num_kv_heads=HKV, head_dim=D, max_seq_len=64, dtype="bf16",
                            device="cuda", max_tokens=256)
    pool = cache.pool.clone()
    view = cache.view(0, [])
    assert attnkit.decode(q[:0], view).shape == (0, HQ, D)
    qkv = torch.zeros((0, (HQ + 2 * HKV) * D), dtype=torch.bfloat16, device="cuda")
    assert attnkit.append_kv(view, [], [], qkv=qkv).shape == (0, HQ, D)
    assert attnkit.forward(qkv, view, [0], [], num_context=0).shape == (0, HQ, D)
    assert attnkit.prefill(q[:0], kv_cache=view, cu_seqlens_q=[0]).shape == (0, HQ, D)
    dq, dk = make(0, 8, HQ, D), make(0, 8, HKV, D)
    assert attnkit.dense(dq, dk, dk).shape == (0, 8, HQ, D)
    lse = torch.zeros((0, HQ), dtype=torch.float32, device="cuda")
    out, lse_out = attnkit.merge_states(q[:0], lse, q[:0], lse)
    assert out.shape == (0, HQ, D) and lse_out.shape == (0, HQ)
    attnkit.check_errors()
    assert torch.equal(cache.pool, pool), "an empty call wrote into the cache"
