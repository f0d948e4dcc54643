"""Cases for MLA's Gluon kernels (paths/mla_gluon.py, paths/mla_gluon_seesaw.py, sm_90 only), used by
test_mla_decode.py on an H100.

The Gluon kernels cover DeepSeek's latent shapes only (64-head groups, values 64-512 dims, rope 16-256,
block sizes a multiple of its key tile), so these cases are built at 128 query heads (two head groups)
with latents of 512 + 64 or 128 + 32, in bf16, on shuffled block tables whose unreadable slots hold NaN:
ragged decodes, partial last blocks, a token without cached keys, a shared prefix, prompts in the step,
both unique layouts, several splits, and each of the one-stream kernel's variants (key tile, stages, `PIPE`;
the seesaw kernel: `SEESAW_CASES`), with the shared cells as more slots of the Gluon kernel
(`MLA_GLUON_SHARED`) and with the TMA descriptors built per launch
(`MLA_GLUON_DESC_CACHE` off). `run` prints each case's max error.
"""
from __future__ import annotations

import numpy as np
import torch

from conftest import Step, assert_matches, make_block_table
from test_mla import MODES

from vllm_gaudi_unified import PlanOptions, attention, build_unified_batch
from vllm_gaudi_unified.mla import latent_views, mla_attention
from vllm_gaudi_unified.merge import Partial
from vllm_gaudi_unified.paths import mla_decode
from vllm_gaudi_unified.reference import reference_attention

H = 128
#: (step, plan mode, (L, R), mla_decode constants)
CASES = [
    (Step([1] * 6, [100, 300, 1, 64, 0, 257], 64), "default", (512, 64), {}),
    (Step([1] * 6, [100, 300, 1, 64, 0, 257], 64), "gather", (512, 64), {"MLA_SPLIT_KEYS": 128}),
    # a shared prefix: on the shared route beside the Gluon kernel (the route the kernel took first), and as more slots of the
    # Gluon kernel (`MLA_GLUON_SHARED`, the default)
    (Step([1] * 4, [200] * 4, 64, prefix_groups=[([0, 1, 2, 3], 2)]), "gather", (512, 64),
     {"MLA_KERNEL_SHARED": False}),
    (Step([1] * 4, [200] * 4, 64, prefix_groups=[([0, 1, 2, 3], 2)]), "gather", (512, 64),
     {"MLA_GLUON_SHARED": True}),
    (Step([3, 1, 1, 1], [70, 130, 130, 9], 64, prefix_groups=[([1, 2], 2)]), "default", (512, 64),
     {"MLA_GLUON_SHARED": True, "MLA_SPLIT_KEYS": 64}),
    (Step([1] * 5, [300, 300, 300, 129, 64], 128, prefix_groups=[([0, 1, 2], 2)]), "default", (512, 64),
     {"MLA_GLUON_SHARED": True, "MLA_SPLIT_KEYS": 128}),
    (Step([1] * 4, [90, 90, 200, 7], 64, prefix_groups=[([0, 1], 1)]), "gather", (128, 32),
     {"MLA_GLUON_SHARED": True, "MLA_GLUON_DESC_CACHE": False}),
    (Step([5, 1, 1, 3], [70, 130, 9, 0], 64), "default", (512, 64), {"MLA_SPLIT_KEYS": 64}),  # prompts too
    (Step([1] * 3, [500, 129, 64], 128), "default", (512, 64), {"MLA_SPLIT_KEYS": 256}),
    (Step([1] * 3, [500, 129, 64], 128), "default", (512, 64), {"MLA_GLUON_PIPE": 1, "MLA_SPLIT_KEYS": 128}),
    (Step([1] * 3, [500, 129, 64], 128), "default", (512, 64), {"MLA_GLUON_PIPE": 2, "MLA_GLUON_LAZY_SUM": True}),
    (Step([1] * 3, [500, 129, 64], 128), "gather", (512, 64), {"MLA_GLUON_KEYS": 32, "MLA_GLUON_STAGES": 3}),
    (Step([1] * 3, [500, 129, 64], 128), "gather", (512, 64),
     {"MLA_GLUON_KEYS": 32, "MLA_GLUON_STAGES": 4, "MLA_GLUON_PIPE": 2, "MLA_GLUON_LAZY_SUM": True}),
    (Step([1] * 4, [90, 33, 200, 7], 64), "default", (128, 32), {"MLA_SPLIT_KEYS": 64, "MLA_GLUON_PIPE": 2}),
    (Step([1] * 4, [90, 33, 200, 7], 64), "gather", (128, 32), {"MLA_GLUON_LAZY_SUM": True, "MLA_GLUON_PIPE": 1}),
    (Step([1] * 6, [100, 300, 1, 64, 0, 257], 64), "gather", (512, 64),
     {"MLA_GLUON_META_AHEAD": True, "MLA_GLUON_PIPE": 2, "MLA_GLUON_LAZY_SUM": True, "MLA_SPLIT_KEYS": 128}),
    (Step([1] * 3, [500, 129, 64], 128), "default", (512, 64), {"MLA_GLUON_META_AHEAD": True}),
]

#: The seesaw kernel (`mla_gluon_seesaw.py`, `MLA_GLUON_SEESAW`: 64-key tiles, rope 64): odd and even tile counts
#: (a last pair without its odd tile), a token without cached keys, partial last blocks, shared prefixes (on the
#: shared route and as more slots), prompts in the step, several splits, both unique layouts, latents 512 / 256 /
#: 128, the worker's registers, the descriptors built per launch.
SEESAW = {"MLA_GLUON_SEESAW": True}
SEESAW_CASES = [
    (Step([1] * 6, [100, 300, 1, 64, 0, 257], 64), "default", (512, 64), SEESAW),
    (Step([1] * 6, [100, 300, 1, 64, 0, 257], 64), "gather", (512, 64), dict(SEESAW, MLA_SPLIT_KEYS=128)),
    (Step([1] * 4, [200] * 4, 64, prefix_groups=[([0, 1, 2, 3], 2)]), "gather", (512, 64),
     dict(SEESAW, MLA_KERNEL_SHARED=False)),
    (Step([1] * 4, [200] * 4, 64, prefix_groups=[([0, 1, 2, 3], 2)]), "gather", (512, 64),
     dict(SEESAW, MLA_GLUON_SHARED=True)),
    (Step([3, 1, 1, 1], [70, 130, 130, 9], 64, prefix_groups=[([1, 2], 2)]), "default", (512, 64),
     dict(SEESAW, MLA_GLUON_SHARED=True, MLA_SPLIT_KEYS=64)),
    (Step([1] * 5, [300, 300, 300, 129, 64], 128, prefix_groups=[([0, 1, 2], 2)]), "default", (512, 64),
     dict(SEESAW, MLA_GLUON_SHARED=True, MLA_SPLIT_KEYS=128)),
    (Step([5, 1, 1, 3], [70, 130, 9, 0], 64), "default", (512, 64), dict(SEESAW, MLA_SPLIT_KEYS=64)),
    (Step([1] * 3, [500, 129, 64], 128), "default", (512, 64), dict(SEESAW, MLA_SPLIT_KEYS=256)),
    (Step([1] * 3, [1000, 129, 700], 128), "gather", (512, 64), dict(SEESAW, MLA_GLUON_SEESAW_REGS=240)),
    (Step([1] * 4, [90, 33, 200, 7], 64), "gather", (128, 64), dict(SEESAW, MLA_GLUON_DESC_CACHE=False)),
    (Step([1] * 4, [90, 33, 200, 7], 128), "default", (256, 64), SEESAW),
    (Step([2, 1, 1], [64, 511, 65], 64), "gather", (512, 64), dict(SEESAW, MLA_SPLIT_KEYS=128)),
    # verify steps (DeepSeek MTP: 1 + 1 or 1 + 2 tokens), the drafts inside the kernel (`UNITS`): ragged, a request
    # without cached keys, several splits, both layouts, a shared prefix (a slot per token), the drafts folded after
    (Step([2, 2, 1], [200, 200, 90], 64, prefix_groups=[([0, 1], 2)]), PlanOptions(unique_tokens=2), (512, 64),
     SEESAW),
    (Step([2, 1, 3, 2], [300, 129, 64, 0], 64), PlanOptions(unique_tokens=3), (512, 64), SEESAW),
    (Step([3, 2, 1], [1000, 65, 511], 64), PlanOptions(unique_tokens=3, unique_layout="gather"), (512, 64),
     dict(SEESAW, MLA_SPLIT_KEYS=128)),
    (Step([2, 2, 1], [700, 64, 129], 128), PlanOptions(unique_tokens=2), (512, 64), dict(SEESAW, MLA_SPLIT_KEYS=256)),
    (Step([2, 1, 3], [300, 129, 64], 64), PlanOptions(unique_tokens=3), (512, 64),
     dict(SEESAW, MLA_KERNEL_DRAFTS=False)),
]


def tensors(step: Step, lr: tuple, seed: int = 0):
    """bf16 query `[T, H, L + R]`, new latents, the cache with NaN in every slot no request may read."""
    rng = np.random.default_rng(seed)
    table, num_blocks = make_block_table(step, rng)
    g = torch.Generator().manual_seed(seed)
    t, bs, d = sum(step.query_lens), step.block_size, sum(lr)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(torch.bfloat16)
    query, latent, cache = rand(t, H, d), rand(t, d), rand(num_blocks, bs, d)
    readable = torch.zeros(num_blocks, bs, dtype=torch.bool)
    for r, c in enumerate(step.context_lens):
        for pos in range(c):
            readable[table[r, pos // bs], pos % bs] = True
    cache[~readable] = float("nan")
    return table, num_blocks, query, latent, cache


def run(cases=CASES) -> int:
    """Every case on CUDA through the Gluon kernel against the reference (bf16, 1e-2); returns the count."""
    real_route, real_launch = attention.mla_unique_route, mla_decode._launch_gluon
    launches = []

    def launch(*args, **kwargs):
        launches.append(args[-1])  # (with the token's own pair or not)
        return real_launch(*args, **kwargs)

    attention.mla_unique_route = lambda b, q, kc, vc, cap, *s: "kernel" if mla_decode.latent_cache(kc, vc) else None
    mla_decode._launch_gluon = launch
    saved = {k: getattr(mla_decode, k) for k in ("MLA_GLUON", "MLA_SPLIT_KEYS", "MLA_GLUON_KEYS",
                                                  "MLA_GLUON_STAGES", "MLA_GLUON_PIPE",
                                                  "MLA_GLUON_LAZY_SUM", "MLA_GLUON_META_AHEAD",
                                                  "MLA_KERNEL_SHARED", "MLA_GLUON_SHARED",
                                                  "MLA_GLUON_DESC_CACHE", "MLA_GLUON_SEESAW",
                                                  "MLA_GLUON_SEESAW_REGS", "MLA_KERNEL_DRAFTS")}
    try:
        for step, mode, (L, R), consts in cases:
            mla_decode.MLA_GLUON = True
            mla_decode.MLA_GLUON_SEESAW = False  # (CASES: the one-stream kernel; SEESAW_CASES switch it on)
            for k, v in consts.items():
                setattr(mla_decode, k, v)
            table, num_blocks, query, latent, cache = tensors(step, (L, R))
            batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size,
                                        num_blocks=num_blocks, options=MODES.get(mode, mode))
            scale = (128 + R) ** -0.5
            launches.clear()
            out = mla_attention(query.cuda(), latent.cuda(), cache.cuda(), batch.to("cuda"), scale, L)
            assert launches, f"the Gluon kernel did not run: {step}, {consts}"
            k, v = latent_views(latent, L)
            kc, vc = latent_views(cache, L)
            ref = reference_attention(query, k, v, kc, vc, step.query_lens, step.context_lens, table, scale)
            print(f"gluon case {step.context_lens} {consts}: max err {(out.cpu().double() - ref).abs().max():.2e}")
            assert_matches(out.cpu(), ref)
            self_off(query, cache, batch, scale, L)
            for k, v in saved.items():
                setattr(mla_decode, k, v)
    finally:
        attention.mla_unique_route, mla_decode._launch_gluon = real_route, real_launch
        for k, v in saved.items():
            setattr(mla_decode, k, v)
    return len(cases)


def self_off(query, cache, batch, scale, L):
    """Without the tokens' own pairs (`key=None`): the Gluon kernel's Partial equals the Triton kernel's."""
    q, kc = query.cuda(), latent_views(cache.cuda(), L)[0]
    b = batch.to("cuda")
    mla_decode.MLA_GLUON = True
    ours = mla_decode.kernel_mla_partial(q, kc, L, b, scale)
    mla_decode.MLA_GLUON = False
    theirs = mla_decode.kernel_mla_partial(q, kc, L, b, scale)
    assert (ours is None) == (theirs is None)
    if ours is None:
        return
    seen = theirs.max > float("-inf")  # (rows without a cached key: max -inf, sum 0 in both)
    assert torch.equal(seen, ours.max > float("-inf")) and torch.equal(ours.sum[~seen], theirs.sum[~seen])
    norm = lambda p: (p.acc / p.sum[..., None].clamp(min=1e-30)).double()
    torch.testing.assert_close(norm(ours)[seen], norm(theirs)[seen], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(ours.max[seen].double(), theirs.max[seen].double(), atol=1e-3, rtol=1e-3)
    assert isinstance(ours, Partial)
