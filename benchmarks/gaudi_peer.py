"""The same-rules peer: vllm-gaudi's own attention algorithms, run as torch ops on this device.

What a Gaudi user runs today instead of unified attention (vllm-gaudi 091bbadd,
default settings with prefix caching on):

* decodes: `ops.flat_pa` (flat paged attention: every block of every decode
  in one batched product, per-block softmax, `block2batch` matmuls to merge);
* prompts without cached context: `ops.prompt_attention(impl='fsdpa_impl')`
  over the batch padded to its longest prompt, causal, no bias;
* prompts with cached context (prefix caching, chunked prefill): the same call
  with `block_list` (the context blocks, gathered and put in front of the new
  keys by `_include_past`) and the `attn_bias` that `HPUModelRunner._set_attn_bias`
  builds (context past its length and non-causal pairs at -inf);
* a mixed step: the v1 model runner runs the prompts as one prefill batch and
  the decodes as a separate decode batch (`execute_model`), one after the other.

`vllm_gaudi/extension/ops.py` and `extension/utils.py` are loaded unchanged from
the vllm-gaudi tarball. Replaced, because they have no CUDA build:
`habana_frameworks` (`mark_step` a no-op; the device type reads Gaudi 3) and
`FusedSDPA`, which becomes torch SDPA (same arguments: GQA, causal or an
additive mask). The runtime config is vllm-gaudi's defaults for a Llama model on
a device without the fused `block_softmax_adjustment` kernel (that kernel is
Gaudi-3-only: on Gaudi 2, and here, flat_pa merges with matmuls), prefix
caching on (so `use_contiguous_pa` is off and blocks are gathered by id). The
vLLM modules ops.py imports for its MoE/quantization code are empty stand-ins,
installed only while the file loads. The project's shared stand-in
(`tests/habana_standin.py`) is not used here: it completes a real vLLM and
vllm-gaudi install, and the GPU machine this peer runs on has neither.
"""
from __future__ import annotations

import enum
import math
import sys
import tarfile
import types
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

TARBALL_NAME = "vllm-gaudi-091bbadd.tar.gz"
SOURCES = ("vllm_gaudi/extension/utils.py", "vllm_gaudi/extension/ops.py")

#: vllm-gaudi's runtime config as it resolves for a Llama model, prefix caching on, no fused HPU kernels.
CONFIG = SimpleNamespace(fp32_softmax=False, fused_block_softmax=False, fused_block_softmax_adjustment=False,
                         prompt_attn_impl="fsdpa_impl", use_contiguous_pa=False, per_token_kv_scaling_support=False,
                         enable_fsdpa_slicing=False, use_hpu_aligned_scale=False, merged_prefill=False,
                         bucketing_strategy="exp", use_bucketing=True)


def find_tarball() -> Path:
    """The vllm-gaudi tarball: `$VLLM_GAUDI_TARBALL`, else `shared/third_party/` beside the checkout
    (`../shared`, as CI has it) or inside it (`_shared`). Nowhere else: no machine's own path."""
    import os

    here = Path(__file__).resolve().parent.parent
    for cand in (os.environ.get("VLLM_GAUDI_TARBALL"), here / "_shared" / "third_party" / TARBALL_NAME,
                 here.parent / "shared" / "third_party" / TARBALL_NAME):
        if cand and Path(cand).is_file():
            return Path(cand)
    raise FileNotFoundError(f"{TARBALL_NAME} not found: set VLLM_GAUDI_TARBALL, or put it in ../shared/third_party/ "
                            "beside the checkout")


class FusedSDPAStandIn:
    """`habana_frameworks.torch.hpex.kernels.FusedSDPA` on CUDA: torch SDPA with the same meaning.

    q/k/v `[B, H, S, D]`; `is_causal` without a mask (prompts without context) or an
    additive mask with `is_causal` already cleared by `ModuleFusedSDPA` (prompts with
    context). Softmax/recompute modes, valid lengths and padding side change only
    padded rows, which the caller drops."""

    @staticmethod
    def apply(query, key, value, attn_mask, dropout_p, is_causal, scale, softmax_mode, recompute_mode,
              valid_sequence_lengths, padding_side, *unused):
        gqa = query.shape[1] != key.shape[1]
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal and attn_mask is None, scale=scale, enable_gqa=gqa)


def _stand_in_modules() -> dict[str, types.ModuleType]:
    """Modules ops.py / utils.py import that have no CUDA build or are not installed here."""
    mods = {}

    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        m.__path__ = []  # a package, so submodules import
        mods[name] = m
        return m

    class SynDeviceType(enum.Enum):
        synDeviceGaudi2 = 2
        synDeviceGaudi3 = 3

    class AnyAttribute(type):
        def __getattr__(cls, name):  # class-level constants read at import (e.g. `...Supported.CHANNEL`)
            return SimpleNamespace(value=f"{cls.__name__}.{name}", name=name)

    class Placeholder(metaclass=AnyAttribute):  # MoE / quantization names the attention code never touches
        def __init__(self, *a, **k):
            raise RuntimeError("not available in the same-rules peer")

    hf = mod("habana_frameworks")
    hf.torch = mod("habana_frameworks.torch")
    hf.torch.core = mod("habana_frameworks.torch.core", mark_step=lambda *a, **k: None)
    hf.torch.utils = mod("habana_frameworks.torch.utils")
    hf.torch.utils.experimental = mod("habana_frameworks.torch.utils.experimental", synDeviceType=SynDeviceType,
                                      _get_device_type=lambda: SynDeviceType.synDeviceGaudi3)
    hf.torch.hpex = mod("habana_frameworks.torch.hpex")
    hf.torch.hpex.kernels = mod("habana_frameworks.torch.hpex.kernels", FusedSDPA=FusedSDPAStandIn)
    vg = mod("vllm_gaudi")
    vg.extension = mod("vllm_gaudi.extension")
    mod("vllm_gaudi.extension.runtime", get_config=lambda: CONFIG)
    mod("vllm_gaudi.extension.logger", logger=lambda: SimpleNamespace(warning_once=print, info=print))
    mod("vllm_gaudi.extension.scales", ConvertScaleToHwAligned=Placeholder)
    mod("vllm")
    mod("vllm.model_executor")
    mod("vllm.model_executor.layers")
    mod("vllm.model_executor.layers.quantization", get_quantization_config=Placeholder)
    mod("vllm.model_executor.layers.quantization.utils", replace_parameter=Placeholder)
    mod("vllm.model_executor.layers.quantization.base_config", QuantizationConfig=Placeholder)
    mod("vllm.model_executor.layers.fused_moe", FusedMoeWeightScaleSupported=Placeholder)
    mod("vllm.model_executor.layers.fused_moe.activation", MoEActivation=Placeholder)
    return mods


_LOADED: dict = {}


def load_vllm_gaudi(tarball: Path | None = None) -> SimpleNamespace:
    """vllm-gaudi's `extension.utils` and `extension.ops`, executed from the tarball's unchanged source."""
    if "ns" in _LOADED:
        return _LOADED["ns"]
    tarball = tarball or find_tarball()
    with tarfile.open(tarball) as tf:
        names = {Path(m.name).as_posix(): m for m in tf.getmembers()}
        src = {}
        for rel in SOURCES:
            member = next(m for n, m in names.items() if n.endswith(rel))
            src[rel] = tf.extractfile(member).read().decode()
    stand_ins = _stand_in_modules()
    saved = {n: sys.modules.get(n) for n in stand_ins}
    sys.modules.update(stand_ins)
    try:
        loaded = {}
        for rel, name in zip(SOURCES, ("vllm_gaudi.extension.utils", "vllm_gaudi.extension.ops")):
            m = types.ModuleType(name)
            m.__file__ = f"{tarball.name}:{rel}"
            sys.modules[name] = m
            exec(compile(src[rel], m.__file__, "exec"), m.__dict__)
            short = name.rsplit(".", 1)[1]
            # Under a name of ours, kept importable: torch.compile re-imports a function's module by name.
            m.__name__ = f"{__name__}._vllm_gaudi_{short}"
            sys.modules[m.__name__] = loaded[short] = m
    finally:  # leave no stand-in behind (the CPU venv has a real vLLM)
        for n in list(stand_ins) + ["vllm_gaudi.extension.utils", "vllm_gaudi.extension.ops"]:
            if saved.get(n) is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = saved[n]
    ns = _LOADED["ns"] = SimpleNamespace(ops=loaded["ops"], utils=loaded["utils"])
    return ns


def _common_args(vg, scale, key_cache, value_cache, block_list, block_size):
    """`HPUAttentionImpl.common_attention_args` with the modules vllm-gaudi builds per layer."""
    u = vg.utils
    return dict(scale=scale, matmul_qk_op=u.Matmul(), matmul_av_op=u.Matmul(), batch2block_matmul_op=u.B2BMatmul(),
                block2batch_matmul_op=u.B2BMatmul(), fsdpa_op=u.ModuleFusedSDPA(FusedSDPAStandIn),
                keys_fetch_func=u.VLLMKVCache().fetch_from_cache,
                values_fetch_func=u.VLLMKVCache(is_v_cache=True).fetch_from_cache, softmax_op=torch.softmax,
                block_list=block_list, key_cache=key_cache, value_cache=value_cache, block_size=block_size,
                sinks=None, k_scales=None, v_scales=None)


def decode_metadata(blocks, seq_lens, block_size, device, dtype):
    """What the v1 runner builds for a decode batch: block_list, block_groups, block_mapping, block_bias."""
    counts = [-(-s // block_size) for s in seq_lens]
    block_list = torch.cat([torch.as_tensor(b[:n]) for b, n in zip(blocks, counts)]).to(device)
    groups = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).to(device)
    usage = torch.tensor([min(block_size, s - i * block_size) for s, n in zip(seq_lens, counts) for i in range(n)],
                         device=device)
    mapping = F.one_hot(groups, num_classes=len(counts)).to(dtype)
    mask = torch.arange(block_size, device=device)[None, :] >= usage[:, None]
    bias = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(mask, -math.inf)
    return block_list, groups, mapping, bias


def prefill_metadata(blocks, query_lens, context_lens, block_size, device, dtype):
    """A prefill batch: padded length, context blocks padded per request, and `_set_attn_bias`'s mask."""
    b, s = len(query_lens), max(query_lens)
    ctx_blocks = max(-(-c // block_size) for c in context_lens)
    if ctx_blocks == 0:
        return s, None, None
    table = torch.zeros(b, ctx_blocks, dtype=torch.long)
    for r, (bl, c) in enumerate(zip(blocks, context_lens)):
        n = -(-c // block_size)
        table[r, :n] = torch.as_tensor(bl[:n])
    block_list = table.flatten().to(device)
    ctx_t = torch.tensor(context_lens, device=device)
    seq_t = torch.tensor(query_lens, device=device)
    past = torch.arange(ctx_blocks * block_size, device=device)[None, :] >= ctx_t[:, None]
    past = past[:, None, None, :].expand(b, 1, s, -1)
    length = (torch.arange(s, device=device)[None, :] >= seq_t[:, None]).view(b, 1, 1, s)
    causal = torch.triu(torch.ones((b, 1, s, s), device=device, dtype=torch.bool), diagonal=1)
    mask = torch.cat([past, causal | length], dim=-1)
    bias = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(mask, -math.inf)
    return s, block_list, bias


def build(query, key, value, key_cache, value_cache, query_lens, context_lens, blocks, scale):
    """A zero-argument callable running vllm-gaudi's algorithms for this step, returning `[T, Hq, D]`.

    The new tokens' K/V are written into their cache slots here, once (vllm-gaudi does it
    before attention each layer; untimed, as for the other baselines). Requests with one new
    token are the decode batch; the others the prefill batch."""
    vg = load_vllm_gaudi()
    ops = vg.ops
    device, dtype = query.device, query.dtype
    hq, d = query.shape[1], query.shape[2]
    hkv = key.shape[1]
    bs = key_cache.shape[1]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    for r, (q, c) in enumerate(zip(query_lens, context_lens)):  # new K/V into the cache (vllm-gaudi's k_cache())
        pos = torch.arange(c, c + q)
        slots = torch.as_tensor(blocks[r])[pos // bs].to(device) * bs + (pos % bs).to(device)
        key_cache.view(-1, hkv, d)[slots] = key[starts[r]:starts[r] + q]
        value_cache.view(-1, hkv, d)[slots] = value[starts[r]:starts[r] + q]
    kc, vc = key_cache.view(-1, hkv, d), value_cache.view(-1, hkv, d)
    dec = [r for r, q in enumerate(query_lens) if q == 1]
    pre = [r for r, q in enumerate(query_lens) if q > 1]
    steps = []
    if pre:
        qls, cls = [query_lens[r] for r in pre], [context_lens[r] for r in pre]
        s, block_list, bias = prefill_metadata([blocks[r] for r in pre], qls, cls, bs, device, dtype)
        # token index of each padded [request, position] slot (pad: the first token, dropped after)
        idx = torch.zeros(len(pre), s, dtype=torch.long)
        for i, r in enumerate(pre):
            idx[i, :query_lens[r]] = torch.arange(starts[r], starts[r] + query_lens[r])
        valid = torch.arange(s)[None, :] < torch.tensor(qls)[:, None]
        dest, picked = idx[valid].to(device), valid.flatten().nonzero()[:, 0].to(device)  # host-side: graphs
        idx = idx.to(device)
        prefill_args = _common_args(vg, scale, kc, vc, block_list, bs)
        seq_t = torch.tensor(qls, device=device)

        def prefill():
            out = ops.prompt_attention(impl=CONFIG.prompt_attn_impl, query=query[idx], key=key[idx], value=value[idx],
                                       is_causal=True, attn_bias=bias, position_bias=None, valid_seq_lengths=seq_t,
                                       **prefill_args)
            return dest, out.reshape(len(pre) * s, hq, d)[picked]
        steps.append(prefill)
    if dec:
        seq_lens = [context_lens[r] + 1 for r in dec]
        dec_blocks, groups, mapping, block_bias = decode_metadata([blocks[r] for r in dec], seq_lens, bs, device, dtype)
        decode_args = _common_args(vg, scale, kc, vc, dec_blocks, bs)
        for k in ("fsdpa_op", "softmax_op"):
            decode_args.pop(k)
        rows = torch.tensor([starts[r] for r in dec], device=device)

        def decode():
            out = ops.flat_pa(query=query[rows].reshape(len(dec), 1, hq * d), block_mapping=mapping, block_bias=block_bias,
                              block_groups=groups, position_bias=None, **decode_args)
            return rows, out.reshape(len(dec), hq, d)
        steps.append(decode)

    def run():
        out = torch.empty(query.shape, dtype=dtype, device=device)
        for step in steps:
            rows, o = step()
            out[rows] = o.to(dtype)
        return out
    return run
