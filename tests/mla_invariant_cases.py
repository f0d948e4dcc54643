"""Cases for MLA's one-token requests in the batch-invariant mode (paths/mla_invariant.py).

On the CPU `test_mla_invariant.py::test_mla_invariant_interpreted` runs this file in a process of its own with
TRITON_INTERPRET=1 (float64 and float32, the kernel's keys per step and per split made small so that a token's
keys span several loop steps and several splits); on CUDA `test_mla_invariant_on_cuda` runs `check("cuda")`
compiled, bfloat16 and float16, and `test_mla_invariant_deepseek_on_cuda` `check_long` (DeepSeek's shapes, the
module's own constants). Each case: a target decode alone, then inside batches
that change everything else (other decodes whose longer contexts launch more splits, prompts and chunks and
verify steps on the other routes, a padded bucket, other positions and orders): the target's rows the same
bits every time; every batch against the dense reference (float64, expanded MLA: 1e-6; 16-bit: 1e-2 in
latent space); NaN in every unreadable cache slot.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import assert_matches  # noqa: E402
from test_batch_invariance import _padded_bucket, assert_same_bits  # noqa: E402

from vllm_gaudi_unified import PlanOptions, build_unified_batch, plan_step  # noqa: E402
from vllm_gaudi_unified.mla import absorb_query, expand_output, latent_views, mla_attention  # noqa: E402
from vllm_gaudi_unified.paths import mla_decode, mla_invariant  # noqa: E402
from vllm_gaudi_unified.plan import invariant as plan_invariant  # noqa: E402
from vllm_gaudi_unified.reference import reference_attention, reference_mla  # noqa: E402

L, R, P, V, H = 16, 8, 12, 10, 16
OPTIONS = PlanOptions(batch_invariant=True, invariant_rows=2, invariant_chunk=3, invariant_causal_chunk=2,
                      causal_tile=4, unique_tokens=3)

#: (target (query_len 1, context_len), others as (query_len, context_len), block size, bucket padding)
CASES = [
    ((1, 70), [(1, 5), (1, 200), (1, 0), (1, 33)], 16, None),  # longer contexts: more splits launched
    ((1, 70), [(1, 200), (5, 0), (6, 20), (2, 30), (1, 12)], 16, None),  # prompts, a chunk, a verify step
    ((1, 70), [(1, 33), (7, 9), (1, 5)], 16, (3, 2, 2, 0, 2)),  # a padded bucket
    ((1, 70), [(1, 12), (2, 30), (6, 20), (5, 0), (1, 200)], 16, None),  # the same others reversed
    ((1, 0), [(1, 40), (3, 12)], 16, None),  # no context: the own pair alone
    # alone one split of the plan's (a few launched), in the batch several (more empty ones in the combine)
    ((1, 20), [(1, 200), (3, 12)], 16, None),
    ((1, 45), [(1, 2)], 4, None),  # 4-slot blocks: a key tile spans slots (no ONE_SLOT)
    ((1, 45), [(1, 90), (4, 7), (1, 3)], 4, (2, 0, 1, 0, 1)),
]


def world(target, others, position, bs, dtype, seed=0, shared=0):
    """Block table (shuffled, null block 0), cache (NaN where unreadable), queries and latents; the target's
    drawn from its own generator, so alone and in a batch it has the same tensors. `shared`: the target's
    first blocks that every other request with as many whole blocks of context reads too (a shared prefix)."""
    reqs = others[:position] + [target] + others[position:]
    rng = np.random.default_rng(seed)
    need = [-(-(c + q) // bs) for q, c in reqs]
    num_blocks = sum(need) + 5
    free = list(rng.permutation(np.arange(1, num_blocks)))
    table = np.full((len(reqs), max(need) + 1), -1, np.int64)
    for r, n in enumerate(need):
        table[r, :n] = [free.pop() for _ in range(n)]
    for r, (_, c) in enumerate(reqs):
        if shared and r != position and c >= shared * bs:
            table[r, :shared] = table[position, :shared]
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape, gen=g, s=1.0: (s * torch.randn(*shape, generator=gen, dtype=torch.float64))  # noqa: E731
    cache = rand(num_blocks, bs, L + R)
    readable = torch.zeros(num_blocks, bs, dtype=torch.bool)
    for r, (_, c) in enumerate(reqs):
        for pos in range(c):
            readable[table[r, pos // bs], pos % bs] = True
    cache[~readable] = float("nan")
    mine = torch.Generator().manual_seed(seed + 7)
    q_nope, q_pe, latent = [], [], []
    for r, (q, _) in enumerate(reqs):
        gen = mine if r == position else g
        q_nope.append(rand(q, H, P, gen=gen))
        q_pe.append(rand(q, H, R, gen=gen))
        latent.append(rand(q, L + R, gen=gen))
    w = torch.Generator().manual_seed(99)
    w_uk, w_uv = rand(H, P, L, gen=w, s=0.3), rand(H, L, V, gen=w, s=0.3)
    return reqs, table, num_blocks, torch.cat(q_nope), torch.cat(q_pe), torch.cat(latent), cache, w_uk, w_uv


def run_case(target, others, position, bs, pad, dtype, device, ref=True, shared=0):
    """-> (the target alone, the target in the batch): its latent rows `[1, H, L]` from the same cache, after
    checking both steps against the reference (with `ref`)."""
    reqs, table, num_blocks, q_nope, q_pe, latent, cache, w_uk, w_uv = world(target, others, position, bs, dtype,
                                                                             shared=shared)
    ql, cl = [q for q, _ in reqs], [c for _, c in reqs]
    start = sum(ql[:position])
    query = absorb_query(q_nope, q_pe, w_uk)
    mine = slice(start, start + 1)
    alone = step(query[mine], q_nope[mine], q_pe[mine], latent[mine], cache, w_uk, w_uv, [1], [target[1]],
                 table[position:position + 1], num_blocks, bs, None, dtype, device, ref)
    inside = step(query, q_nope, q_pe, latent, cache, w_uk, w_uv, ql, cl, table, num_blocks, bs, pad, dtype, device,
                  ref)
    return alone, inside[mine]


def step(query, q_nope, q_pe, latent, cache, w_uk, w_uv, ql, cl, table, num_blocks, bs, pad, dtype, device, ref=True):
    """One invariant latent step's output `[T, H, L]`, checked against the reference with `ref` (NaN slots unread
    always)."""
    bucket = None
    if pad:
        bucket = _padded_bucket(plan_step(ql, cl, table, bs, options=OPTIONS).shape, pad)
    batch = build_unified_batch(ql, cl, table, bs, num_blocks=num_blocks, options=OPTIONS, bucket=bucket,
                                device=device)
    scale = (P + R) ** -0.5
    on = lambda x: x.to(dtype).to(device)  # noqa: E731
    out = mla_attention(on(query), on(latent), on(cache), batch, scale, L).cpu()
    assert torch.isfinite(out).all(), "an unreadable slot was read"
    if not ref:
        return out
    if dtype == torch.float64:
        ref = reference_mla(q_nope, q_pe, latent, cache, w_uk, w_uv, ql, cl, table, scale, L)
        assert_matches(expand_output(out, w_uv), ref)
    else:
        k, v = latent_views(latent.to(dtype), L)
        kc, vc = latent_views(cache.to(dtype), L)
        assert_matches(out, reference_attention(query.to(dtype), k, v, kc, vc, ql, cl, table, scale))
    return out


#: On CUDA with the module's own constants (`SPLIT_KEYS` 8192 in splits of 2048, `MLA_KEYS` 64) at DeepSeek's shapes:
#: three splits launched alone, ten in the batch (the ordered combine), block 128; a 3k decode (one split on the
#: seesaw: its rows from the kernel) alone and beside a 9k one.
LONG = [((1, 5000), [(1, 20000), (1, 100), (4, 0), (1, 16384)], 128, None),
        ((1, 3000), [(1, 9000)], 128, None)]  # one split (the seesaw's rows final) beside five; bitwise only
DEEPSEEK = (512, 64, 128, 128, 128)  # L, R, P, V, H


def check_long(device: str = "cuda") -> int:
    """`LONG` at DeepSeek's shapes, compiled, bf16: alone = in the batch at up to three positions, the first
    case's first against the reference (the float64 reference over 40k keys x 128 heads is the slow part)."""
    global L, R, P, V, H
    saved = L, R, P, V, H
    L, R, P, V, H = DEEPSEEK
    try:
        return check(device, small=False, cases=LONG, dtypes=[torch.bfloat16])
    finally:
        L, R, P, V, H = saved


def check_prompt_bf16(device: str = "cpu") -> None:
    """A 4-token prompt without context and a short decode at DeepSeek's shapes in bf16 (the torch route's tiles
    on the CPU) against the reference: its scores `|q . k|` reach ~250, where a bf16 score is off by up to 0.5."""
    global L, R, P, V, H
    saved = L, R, P, V, H
    L, R, P, V, H = DEEPSEEK
    try:
        reqs, table, num_blocks, q_nope, q_pe, latent, cache, w_uk, w_uv = world((4, 0), [(1, 300)], 0, 128,
                                                                                 torch.bfloat16)
        step(absorb_query(q_nope, q_pe, w_uk), q_nope, q_pe, latent, cache, w_uk, w_uv, [q for q, _ in reqs],
             [c for _, c in reqs], table, num_blocks, 128, None, torch.bfloat16, device)
    finally:
        L, R, P, V, H = saved


def check(device: str = "cpu", small: bool = True, cases=None, dtypes=None) -> int:
    """Every case at three positions of the target: alone and in the batch the same bits, both against the
    reference. On the CPU float64 and float32; on CUDA bfloat16 and float16. -> cases run."""
    real_route, real_rows, calls, seen = mla_decode.mla_unique_route, mla_invariant.decode_rows, [], set()
    saved = {"SPLIT_KEYS": plan_invariant.SPLIT_KEYS, "MLA_KEYS": mla_decode.MLA_KEYS}

    def route(batch, query, key_cache, value_cache, cap, k_scale, v_scale):  # the kernel on the CPU too
        return "kernel" if mla_decode.latent_cache(key_cache, value_cache) and cap is None else None

    def rows(*args, **kwargs):
        plan = args[4].plan  # (the plan's split count at `SPLIT_KEYS`: its longest context's)
        calls.append(max(1, -(-plan.slot_most * plan.block_size // plan_invariant.SPLIT_KEYS)))
        seen.add(calls[-1])
        return real_rows(*args, **kwargs)

    if device == "cpu":
        mla_decode.mla_unique_route = route
    mla_invariant.decode_rows = rows
    if small:  # several loop steps and several splits per token at these lengths
        mla_decode.MLA_KEYS, plan_invariant.SPLIT_KEYS = (8 if device == "cpu" else 16), 32  # (GPU dots: 16+)
    done = 0
    try:
        # (the interpreter has no bfloat16: numpy's loads of it are not its values. On CUDA the route takes
        # 16-bit caches only, `unique.KERNEL_CACHE_DTYPES`: fp32 keeps the tile route there)
        dtypes = dtypes or ([torch.float64, torch.float32] if device == "cpu" else [torch.bfloat16, torch.float16])
        for dtype in dtypes:
            for i, (target, others, bs, pad) in enumerate(cases or CASES):
                for position in sorted({0, len(others) // 2, len(others)}):
                    calls.clear()
                    ref = cases is None or (position == 0 and i == 0)  # (given cases: the first one's, once)
                    assert_same_bits(*run_case(target, others, position, bs, pad, dtype, device, ref))
                    assert len(calls) == 2, "the invariant MLA kernel route did not run"
                    done += 1
        # a step of one plan split and one of several both ran
        assert 1 in seen and max(seen) >= 3, seen
    finally:
        mla_decode.mla_unique_route = real_route
        mla_invariant.decode_rows = real_rows
        mla_decode.MLA_KEYS, plan_invariant.SPLIT_KEYS = saved["MLA_KEYS"], saved["SPLIT_KEYS"]
    return done


#: The torch route's own cases (`mla_invariant_torch.py`): decodes over the target's first 4 blocks (its whole
#: chunks: share calls in the batch, one-row tiles alone), as (case, shared blocks).
SHARED = [(((1, 70), [(1, 80), (1, 75), (1, 200), (3, 12), (1, 66)], 16, None), 4),
          (((1, 70), [(1, 90), (1, 64), (5, 0), (1, 71)], 16, (3, 2, 2, 0, 2)), 4)]


def check_torch(device: str = "cpu", dtypes=None, gaudi_scores: bool = False, long: bool = False) -> int:
    """Every case (`CASES`, then `SHARED`) on the torch route (`mla_invariant_torch.decode_rows`, the Gaudi
    route's): alone and in the batch the same bits at three positions, every step against the reference;
    `gaudi_scores`: the scores in the product's 16 bits, as a Gaudi keeps them (`tiles.gaudi_product`);
    `long`: `LONG` at DeepSeek's shapes with the default options (chunks of 4 blocks of 128), bitwise only."""
    global L, R, P, V, H
    if long:
        saved_shapes, (L, R, P, V, H) = (L, R, P, V, H), DEEPSEEK
        try:
            return _check_torch(device, dtypes or [torch.bfloat16], gaudi_scores, [(case, 0) for case in LONG],
                                PlanOptions(batch_invariant=True), ref=False)
        finally:
            L, R, P, V, H = saved_shapes
    return _check_torch(device, dtypes or [torch.float64, torch.float32, torch.bfloat16], gaudi_scores,
                        [(case, 0) for case in CASES] + SHARED, replace(OPTIONS, shared_tile_keys=32), ref=True)


def _check_torch(device, dtypes, gaudi_scores, cases, options, ref) -> int:
    from vllm_gaudi_unified.paths import mla_invariant_torch, tiles

    global OPTIONS
    real_rows, real_product, saved, calls, done = mla_invariant_torch.decode_rows, tiles.gaudi_product, OPTIONS, [], 0
    OPTIONS = options  # (`CASES`: chunks of 2 blocks of 16, several a token, whole ones shared)

    def rows(*args, **kwargs):
        calls.append(args[4].share_rows.shape[0])
        return real_rows(*args, **kwargs)

    mla_invariant_torch.decode_rows = rows
    if gaudi_scores:
        tiles.gaudi_product = lambda device_type: True
    try:
        for dtype in dtypes:
            for (target, others, bs, pad), shared in cases:
                for position in sorted({0, len(others) // 2, len(others)}):
                    calls.clear()
                    assert_same_bits(*run_case(target, others, position, bs, pad, dtype, device, ref, shared))
                    assert len(calls) == 2, "the torch MLA route did not run"
                    assert not shared or (calls[0] == 0 and calls[1] > 0), calls  # alone no share call, in batch
                    done += 1
    finally:
        mla_invariant_torch.decode_rows, tiles.gaudi_product, OPTIONS = real_rows, real_product, saved
    return done


if __name__ == "__main__":
    print("ok", check())
