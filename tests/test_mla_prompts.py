"""MLA prompts in the expanded form (`mla_prompts.py`) beside latent decodes, against the dense MLA reference."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SMALL_TILES, SPECS, Step, assert_matches, make_block_table
from test_mla import H, L, P, R, V, mla_tensors
from vllm_gaudi_unified import build_unified_batch
from vllm_gaudi_unified.mla import absorb_query, expand_output, mla_attention
from vllm_gaudi_unified.mla_prompts import expanded_first, mla_prompt_rows
from vllm_gaudi_unified.reference import reference_mla

#: steps with prompts, chunks over context, shared prefixes, ragged and partly filled last blocks
#: decodes first, then chunks over context (one over a prefix the decodes share) and a prompt: the order
#: vLLM's reorder gives (decodes, extends, prefills)
SUFFIX = Step([1, 1, 1, 16, 9, 5], [13, 13, 30, 13, 7, 0], 4, prefix_groups=[([0, 1, 3], 3)])
CASES = {**{n: SPECS[n] for n in ("seed", "prefill", "chunked_prefill", "ragged_partial", "long_causal")},
         "suffix": SUFFIX,
         # a short draft over a shared prefix stays on the shared tiles (latent) between two prompt-route rows
         "shared_draft": Step([12, 3, 1, 17], [9, 13, 13, 0], 4, prefix_groups=[([1, 2], 3)])}


def kv_b_weight(w_uk, w_uv):
    """vLLM's `kv_b_proj` weight `[H * (P + V), L]` from W_UK `[H, P, L]` and W_UV `[H, L, V]`."""
    return torch.cat([w_uk, w_uv.transpose(1, 2)], dim=1).reshape(-1, w_uk.shape[-1])


def split_case(step: Step, dtype=torch.float64, options=SMALL_TILES, seed=0, suffix=False, device="cpu"):
    """-> (prompt rows expanded + other rows latent then W_UV, the dense reference, batch, rows on the route)."""
    table, num_blocks, q_nope, q_pe, w_uk, w_uv, latent, cache = mla_tensors(step, dtype, seed)  # NaN: unreadable
    t, bs = sum(step.query_lens), step.block_size
    batch = build_unified_batch(step.query_lens, step.context_lens, table, bs, num_blocks=num_blocks,
                                options=options, device=device)
    assert batch.bucket.num_prompts > 0  # the expanded form has rows to run
    scale = (P + R) ** -0.5
    rows = batch.bucket.query_len
    pad = lambda x: F.pad(x, (0,) * (2 * x.dim() - 2) + (0, rows - t))  # noqa: E731  (the bucket's rows)
    first = expanded_first(batch) if suffix else 0
    assert first is not None
    # the latent rows: the step minus its prompt route (q of the expanded rows never read: zeros)
    q_lat = absorb_query(q_nope, q_pe, w_uk)
    q_lat[first:] = 0 if suffix else q_lat[first:]
    dev = lambda x: x.to(device)  # noqa: E731
    lat = mla_attention(dev(pad(q_lat)), dev(pad(latent)), dev(cache), batch, scale, L, checked=True,
                        prompt_route=False)[:t].cpu()
    weight = dev(kv_b_weight(w_uk, w_uv))
    q = dev(pad(torch.cat([q_nope, q_pe], -1))[first:])
    exp = mla_prompt_rows(q, dev(pad(latent)[first:]), dev(cache), batch, scale, L, lambda c: c @ weight.T,
                          first=first).cpu()
    exp = torch.cat([exp.new_zeros((first,) + exp.shape[1:]), exp])[:t]  # token order
    on_route = torch.zeros(rows + 1, dtype=torch.bool)
    on_route[batch.prompt_rows.reshape(-1).cpu()] = True  # (padding rows: index `rows`, dropped)
    on_route = on_route[:t]
    out = torch.where(on_route[:, None, None], exp, expand_output(lat, w_uv))
    ref = reference_mla(q_nope, q_pe, latent, cache, w_uk, w_uv, step.query_lens, step.context_lens, table, scale,
                        L)
    return out, ref, batch, on_route


@pytest.mark.parametrize("name", sorted(CASES))
def test_expanded_prompts_beside_latent_rows(name):
    """Prompt rows expanded through kv_b_proj, the other rows latent: the dense MLA reference (fp64, 1e-6)."""
    out, ref, _, on_route = split_case(CASES[name])
    assert on_route.any()
    assert_matches(out, ref)


@pytest.mark.parametrize("name", ["seed", "chunked_prefill", "ragged_partial", "shared_draft"])
def test_bf16(name):
    out, ref, _, _ = split_case(CASES[name], dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert_matches(out, ref)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_suffix_rows_as_vllm_hands_them(dtype):
    """vLLM's layer hands the prefill tokens as the step's last ones (`first` on); decodes first."""
    out, ref, batch, on_route = split_case(SUFFIX, dtype=dtype, suffix=True)
    first = expanded_first(batch)
    assert first == 3 and bool(on_route[3:].all()) and not bool(on_route[:3].any())
    assert_matches(out, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["chunked_prefill", "suffix", "shared_draft"])
def test_on_cuda(name):
    """bf16 on CUDA: torch SDPA with keys P + R and values V (flash / memory-efficient), within 1e-2."""
    out, ref, _, _ = split_case(CASES[name], dtype=torch.bfloat16, device="cuda", suffix=name == "suffix")
    assert_matches(out, ref)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_steps(data):
    """Ragged steps (decodes first or not, prompts over context, a shared prefix, any block size): fp64 1e-6."""
    n = data.draw(st.integers(1, 5))
    q = data.draw(st.lists(st.integers(1, 20), min_size=n, max_size=n))
    q[-1] = max(q[-1], 2)  # at least one request on the prompt route
    ctx = data.draw(st.lists(st.integers(0, 23), min_size=n, max_size=n))
    bs = data.draw(st.sampled_from([2, 4, 8]))
    groups = []
    if n >= 2 and min(ctx[:2]) >= bs and data.draw(st.booleans()):
        groups = [([0, 1], 1)]
    suffix = data.draw(st.booleans())
    if suffix:  # vLLM's order: decodes (one token over context) first
        order = sorted(range(n), key=lambda r: (q[r] > 1 or ctx[r] == 0))
        q, ctx = [q[r] for r in order], [ctx[r] for r in order]
        groups = []
    step = Step(q, ctx, bs, prefix_groups=groups)
    rng = np.random.default_rng(0)
    table, nb = make_block_table(step, rng)
    batch = build_unified_batch(q, ctx, table, bs, num_blocks=nb, options=SMALL_TILES)
    if batch.bucket.num_prompts == 0 or (suffix and expanded_first(batch) is None):
        return  # (every long request short and sharing a prefix: no prompt route; a draft between prompts)
    out, ref, _, _ = split_case(step, seed=data.draw(st.integers(0, 99)), suffix=suffix)
    assert_matches(out, ref)


def test_rows_not_a_suffix_or_not_final_run_latent():
    """Prompt rows before decodes (not a suffix), fused kernels off (the partial form) or no prompts: None."""
    rng = np.random.default_rng(0)

    def first(step, options=SMALL_TILES):
        table, nb = make_block_table(step, rng)
        return expanded_first(build_unified_batch(step.query_lens, step.context_lens, table, step.block_size,
                                                  num_blocks=nb, options=options))
    assert first(SPECS["seed"]) is None  # [8, 4, 1, 1]: the prompts come first
    assert first(CASES["shared_draft"]) is None  # a latent draft between prompt rows
    assert first(SPECS["decode"]) is None
    assert first(SPECS["prefill"]) == 0
    assert first(SUFFIX, replace(SMALL_TILES, fused_kernels=False)) is None
    assert first(SUFFIX, replace(SMALL_TILES, prompt_route="tiles")) is None


def test_prompt_route_off_needs_the_final_form():
    step = SPECS["chunked_prefill"]
    rng = np.random.default_rng(0)
    table, nb = make_block_table(step, rng)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=nb,
                                options=replace(SMALL_TILES, fused_kernels=False))
    t = batch.bucket.query_len
    with pytest.raises(ValueError, match="prompt_route=False"):
        mla_attention(torch.zeros(t, H, L + R), torch.zeros(t, L + R), torch.zeros(nb, 4, L + R), batch, 0.3, L,
                      checked=True, prompt_route=False)


def test_bad_latent_shapes_are_named():
    step = SPECS["prefill"]
    batch = build_unified_batch(step.query_lens, step.context_lens, np.zeros((4, 8), np.int64), 4, num_blocks=2)
    t = batch.bucket.query_len
    with pytest.raises(ValueError, match="latent"):
        mla_prompt_rows(torch.zeros(t, H, P + R), torch.zeros(t, L), torch.zeros(2, 4, L + R), batch, 0.3, L,
                        lambda c: c)


def test_a_kv_b_proj_of_the_wrong_size_is_named():
    step = SPECS["prefill"]
    batch = build_unified_batch(step.query_lens, step.context_lens, np.zeros((4, 8), np.int64), 4, num_blocks=2)
    t = batch.bucket.query_len
    with pytest.raises(ValueError, match="kv_b_proj gave"):
        mla_prompt_rows(torch.zeros(t, H, P + R), torch.zeros(t, L + R), torch.zeros(2, 4, L + R), batch, 0.3, L,
                        lambda c: torch.zeros(c.shape[0], (H - 1) * (P + V)))


def test_a_bad_context_value_reaches_exactly_the_rows_that_read_it():
    """NaN in a readable context slot: the rows of that prompt only (unused slots' NaN reach none)."""
    step = SPECS["chunked_prefill"]  # [12, 5] over [20, 9]
    rng = np.random.default_rng(0)
    table, nb = make_block_table(step, rng)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, num_blocks=nb, options=SMALL_TILES)
    g = torch.Generator().manual_seed(0)
    t = batch.bucket.query_len
    cache = torch.randn(nb, 4, L + R, generator=g, dtype=torch.float64)
    cache[table[1, 0], 2] = float("nan")  # request 1's context position 2
    weight = torch.randn(H * (P + V), L, generator=g, dtype=torch.float64)
    out = mla_prompt_rows(torch.randn(t, H, P + R, generator=g, dtype=torch.float64),
                          torch.randn(t, L + R, generator=g, dtype=torch.float64), cache, batch, 0.3, L,
                          lambda c: c @ weight.T)
    assert out[:12].isfinite().all() and out[12:17].isnan().all()


def test_a_bad_new_latent_of_prompts_without_context_reaches_only_later_rows():
    """Prompts alone, no context: one causal call over the expanded keys (key and value head dims differ, so
    torch SDPA takes its math kernel, which adds -inf to a NaN score rather than selecting it away). A NaN new
    latent at token 3 of prompt 0 reaches that prompt's rows 3.. and nothing else."""
    step = Step([12, 5], [0, 0], 4)
    table, nb = make_block_table(step, np.random.default_rng(0))
    batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, num_blocks=nb, options=SMALL_TILES)
    g = torch.Generator().manual_seed(0)
    t = batch.bucket.query_len
    weight = torch.randn(H * (P + V), L, generator=g, dtype=torch.float64)
    latent = torch.randn(t, L + R, generator=g, dtype=torch.float64)
    latent[3, 5] = float("nan")
    out = mla_prompt_rows(torch.randn(t, H, P + R, generator=g, dtype=torch.float64), latent,
                          torch.randn(nb, 4, L + R, generator=g, dtype=torch.float64), batch, 0.3, L,
                          lambda c: c @ weight.T)
    assert out[:3].isfinite().all() and out[3:12].isnan().all() and out[12:17].isfinite().all()
