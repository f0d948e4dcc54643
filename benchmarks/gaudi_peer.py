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
from dataclasses import dataclass
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


def exp_range(lo: int, step: int, hi: int, count: int) -> list[int]:
    """vllm-gaudi's exponential bucket values of one dimension (`bucketing/exponential.py`, its default
    strategy): `count` points from `lo` to `hi` spaced evenly in log scale, each rounded up to `step`; a
    `lo` of 0 or 1 starts the spacing at `step` and keeps `lo` as a value of its own."""
    start = step if lo in (0, 1) else lo
    out = {lo} if lo in (0, 1) else set()
    if count <= 1:
        return [hi]
    out |= {int(math.ceil(start * (hi / start) ** (i / (count - 1)) / step)) * step for i in range(count)}
    values = sorted(out)
    values[-1] = min(values[-1], hi)
    return values


@dataclass(frozen=True)
class ExpBuckets:
    """vllm-gaudi's default `exp` buckets for a server (prompt: batch, query length, context blocks; decode:
    batch, blocks), each dimension padded up on its own to its next value (its `find` takes the smallest
    generated bucket at least the step in every dimension; per dimension is that or smaller)."""

    prompt_bs: list
    prompt_query: list
    prompt_ctx: list
    decode_bs: list
    decode_blocks: list

    @classmethod
    def for_server(cls, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int,
                   num_blocks: int) -> "ExpBuckets":
        lg = lambda x: math.ceil(math.log2(max(x, 2)))  # noqa: E731
        long_ctx = max_model_len >= 8192
        max_ctx = max(1, (max_model_len - (max_num_batched_tokens if long_ctx else block_size)) // block_size)
        dec_blocks = min(-(-max_model_len // block_size) * max_num_seqs, 3 * num_blocks)
        return cls(exp_range(1, 2, max_num_seqs, lg(max_num_seqs) + 1),
                   exp_range(block_size, block_size, max_num_batched_tokens, lg(max_num_batched_tokens)),
                   exp_range(0, 1, max_ctx, 2 if max_ctx == 1 else lg(max_ctx) + 1),
                   exp_range(1, 2, max_num_seqs, lg(max_num_seqs) + 1),
                   exp_range(1, max_num_seqs, dec_blocks, lg(dec_blocks) + 1))

    @staticmethod
    def up(value: int, values: list) -> int:
        """The smallest of `values` at least `value` (the value itself past the largest: a new graph)."""
        return next((v for v in values if v >= value), value)


def decode_metadata(blocks, seq_lens, block_size, device, dtype, pad_to: tuple[int, int] | None = None):
    """What the v1 runner builds for a decode batch: block_list, block_groups, block_mapping, block_bias;
    `pad_to` = (batch, blocks): padded as its buckets pad it (padding blocks in a group of their own past the
    batch, one slot visible so no block's softmax is empty; padding requests have no block)."""
    counts = [-(-s // block_size) for s in seq_lens]
    block_list = torch.cat([torch.as_tensor(b[:n]) for b, n in zip(blocks, counts)]).to(device)
    groups = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).to(device)
    usage = torch.tensor([min(block_size, s - i * block_size) for s, n in zip(seq_lens, counts) for i in range(n)],
                         device=device)
    if pad_to is not None:
        batch, nb = max(pad_to[0], len(counts)), max(pad_to[1], block_list.numel())
        extra = nb - block_list.numel()
        block_list = torch.cat([block_list, torch.zeros(extra, dtype=block_list.dtype, device=device)])
        groups = torch.cat([groups, torch.full((extra,), batch, dtype=groups.dtype, device=device)])
        usage = torch.cat([usage, torch.ones(extra, dtype=usage.dtype, device=device)])
        mapping = F.one_hot(groups, num_classes=batch + 1)[:, :batch].to(dtype)
        mask = torch.arange(block_size, device=device)[None, :] >= usage[:, None]
        bias = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(mask, -math.inf)
        return block_list, groups, mapping, bias
    mapping = F.one_hot(groups, num_classes=len(counts)).to(dtype)
    mask = torch.arange(block_size, device=device)[None, :] >= usage[:, None]
    bias = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(mask, -math.inf)
    return block_list, groups, mapping, bias


def prefill_metadata(blocks, query_lens, context_lens, block_size, device, dtype, pad_to: tuple | None = None):
    """A prefill batch: padded length, context blocks padded per request, and `_set_attn_bias`'s mask;
    `pad_to` = (query length, context blocks): the padded sizes (the batch is padded by the caller)."""
    b, s = len(query_lens), max(query_lens)
    ctx_blocks = max(-(-c // block_size) for c in context_lens)
    if pad_to is not None:
        s, ctx_blocks = max(s, pad_to[0]), max(ctx_blocks, pad_to[1])
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


def build(query, key, value, key_cache, value_cache, query_lens, context_lens, blocks, scale,
          buckets: ExpBuckets | None = None):
    """A zero-argument callable running vllm-gaudi's algorithms for this step, returning `[T, Hq, D]`.

    The new tokens' K/V are written into their cache slots here, once (vllm-gaudi does it
    before attention each layer; untimed, as for the other baselines). Requests with one new
    token are the decode batch; the others the prefill batch. `buckets`: both batches padded to
    vllm-gaudi's own buckets (padding prompts of one token over no context, padding decodes without
    blocks; their rows dropped)."""
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
        qls, cls, pblocks = [query_lens[r] for r in pre], [context_lens[r] for r in pre], [blocks[r] for r in pre]
        pad = None
        if buckets is not None:
            n = ExpBuckets.up(len(pre), buckets.prompt_bs) - len(pre)
            qls, cls, pblocks = qls + [1] * n, cls + [0] * n, pblocks + [[0]] * n
            pad = (ExpBuckets.up(max(qls), buckets.prompt_query),
                   ExpBuckets.up(max(-(-c // bs) for c in cls), buckets.prompt_ctx))
        s, block_list, bias = prefill_metadata(pblocks, qls, cls, bs, device, dtype, pad)
        # token index of each padded [request, position] slot (pad: the first token, dropped after)
        idx = torch.zeros(len(qls), s, dtype=torch.long)
        for i, r in enumerate(pre):
            idx[i, :query_lens[r]] = torch.arange(starts[r], starts[r] + query_lens[r])
        valid = torch.arange(s)[None, :] < torch.tensor(qls)[:, None]
        valid[len(pre):] = False  # padding prompts: computed, dropped
        dest, picked = idx[valid].to(device), valid.flatten().nonzero()[:, 0].to(device)  # host-side: graphs
        idx = idx.to(device)
        prefill_args = _common_args(vg, scale, kc, vc, block_list, bs)
        seq_t = torch.tensor(qls, device=device)

        def prefill():
            out = ops.prompt_attention(impl=CONFIG.prompt_attn_impl, query=query[idx], key=key[idx], value=value[idx],
                                       is_causal=True, attn_bias=bias, position_bias=None, valid_seq_lengths=seq_t,
                                       **prefill_args)
            return dest, out.reshape(len(qls) * s, hq, d)[picked]
        steps.append(prefill)
    if dec:
        seq_lens = [context_lens[r] + 1 for r in dec]
        pad = None
        if buckets is not None:
            pad = (ExpBuckets.up(len(dec), buckets.decode_bs),
                   ExpBuckets.up(sum(-(-s // bs) for s in seq_lens), buckets.decode_blocks))
        dec_blocks, groups, mapping, block_bias = decode_metadata([blocks[r] for r in dec], seq_lens, bs, device, dtype,
                                                                  pad)
        batch = mapping.shape[1]
        decode_args = _common_args(vg, scale, kc, vc, dec_blocks, bs)
        for k in ("fsdpa_op", "softmax_op"):
            decode_args.pop(k)
        rows = torch.tensor([starts[r] for r in dec], device=device)
        q_rows = torch.cat([rows, rows[:1].expand(batch - len(dec))])  # padding decodes: the first one's query

        def decode():
            out = ops.flat_pa(query=query[q_rows].reshape(batch, 1, hq * d), block_mapping=mapping,
                              block_bias=block_bias, block_groups=groups, position_bias=None, **decode_args)
            return rows, out.reshape(batch, hq, d)[:len(dec)]
        steps.append(decode)

    def run():
        out = torch.empty(query.shape, dtype=dtype, device=device)
        for step in steps:
            rows, o = step()
            out[rows] = o.to(dtype)
        return out
    return run
