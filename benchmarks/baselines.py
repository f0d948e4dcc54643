"""What unified attention is compared with, built once per scenario and timed in the same run.

* `reference_fp32`: the check. Per request, gather K/V through the block table,
  append the new tokens, softmax in float32 with an explicit bottom-right causal
  mask. Far faster than the float64 loop of `vllm_gaudi_unified.reference`, and
  exact enough for a bf16 comparison by relative norm.
* `per_request_sdpa`: the same loop as a fast baseline: bf16 gather, then torch
  SDPA (flash when the shapes allow: decodes and pure prefills; a bottom-right
  causal bias otherwise).
* `padded_sdpa`: every request padded to the longest, K/V gathered into a dense
  `[R, H, L, D]` tensor, one masked SDPA call.
* `flex_paged`: torch FlexAttention reading the paged cache in place: all new
  tokens as one sequence, the whole cache as the keys, a mask built from
  block ownership. It applies where no block has two owners (not the shared
  prefix scenarios) and needs the new tokens' K/V written into their cache slots
  first, as vLLM does before attention (done at setup, not timed).

Each builder returns a zero-argument callable producing `[T, Hq, D]`.

How every benchmark checks and times a callable is here too: `_rel_err`/`_readable` (the check and the
cache slots no request may read, poisoned while checking), `time_ms` (device events on CUDA: median,
warmed up, L2 flushed; a host clock on CPU), `capture` (a replayed CUDA graph: the stand-in for an HPU
graph per bucket, no launch gaps), `peak_bytes`, `measure` (check, then time: a runner's row), and
`environment` (device, versions, date and commit of a run).
"""
from __future__ import annotations

import datetime
import math
import platform
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def _request_kv(key_cache, value_cache, blocks, ctx, k_new, v_new):
    """[ctx + q, Hkv, D] keys and values of one request: cache through its blocks, then the new tokens."""
    bs = key_cache.shape[1]
    nb = -(-ctx // bs)
    kc = key_cache[blocks[:nb]].flatten(0, 1)[:ctx]
    vc = value_cache[blocks[:nb]].flatten(0, 1)[:ctx]
    return torch.cat([kc, k_new]), torch.cat([vc, v_new])


def _lower_right(q_len: int, kv_len: int, device) -> torch.Tensor:
    """[q_len, kv_len] bool: token j (at position kv_len - q_len + j) sees keys <= its position."""
    j = torch.arange(q_len, device=device)[:, None]
    return torch.arange(kv_len, device=device)[None, :] <= j + (kv_len - q_len)


def reference_fp32(query, key, value, key_cache, value_cache, query_lens, context_lens, blocks, scale):
    """The check: float32 softmax per request; `blocks[r]` is a device tensor of request r's blocks."""
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    start = 0
    group = query.shape[1] // key.shape[1]
    for r, (q_len, ctx) in enumerate(zip(query_lens, context_lens)):
        sl = slice(start, start + q_len)
        k, v = _request_kv(key_cache, value_cache, blocks[r], ctx, key[sl], value[sl])
        q = query[sl].float().transpose(0, 1)  # [Hq, q, D]
        k = k.float().transpose(0, 1).repeat_interleave(group, 0)  # [Hq, L, D]
        v = v.float().transpose(0, 1).repeat_interleave(group, 0)
        s = torch.matmul(q, k.transpose(1, 2)) * scale
        s = s.masked_fill(~_lower_right(q_len, ctx + q_len, q.device), float("-inf"))
        out[sl] = torch.matmul(torch.softmax(s, -1), v).transpose(0, 1)
        start += q_len
    return out


def per_request_sdpa(query, key, value, key_cache, value_cache, query_lens, context_lens, blocks, scale):
    """A loop of gathers and SDPA calls, one per request (what a naive paged backend does)."""
    from torch.nn.attention.bias import causal_lower_right

    group = query.shape[1] // key.shape[1]
    spans, start = [], 0
    for q_len in query_lens:
        spans.append(slice(start, start + q_len))
        start += q_len

    def run():
        outs = []
        for r, (q_len, ctx) in enumerate(zip(query_lens, context_lens)):
            sl = spans[r]
            k, v = _request_kv(key_cache, value_cache, blocks[r], ctx, key[sl], value[sl])
            q = query[sl].transpose(0, 1)[None]  # [1, Hq, q, D]
            k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            if q_len == 1 or ctx == 0:  # flash: no mask, or plain causal on a square
                o = F.scaled_dot_product_attention(q, k, v, is_causal=q_len > 1, scale=scale, enable_gqa=True)
            else:
                k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q_len, ctx + q_len),
                                                   scale=scale)
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs)

    return run


def padded_sdpa(query, key, value, key_cache, value_cache, query_lens, context_lens, block_table, scale,
                max_bytes: float = 24e9):
    """Pad every request to the longest; one masked SDPA over dense gathered K/V (KV heads repeated).
    Returns None when the padded tensors would exceed `max_bytes`."""
    dev = query.device
    bs = key_cache.shape[1]
    r_n = len(query_lens)
    hq, hkv, d = query.shape[1], key.shape[1], key.shape[2]
    max_q = max(query_lens)
    nb = max(-(-c // bs) for c in context_lens) if max(context_lens) else 0
    max_k = nb * bs + max_q
    if 4 * r_n * hq * max_k * d * query.element_size() + r_n * hq * max_q * max_k * 4 > max_bytes:
        return None
    table = torch.as_tensor(block_table[:, :nb].clip(min=0), device=dev)
    # Where each new token lands in its request's padded row: right after its context.
    ctx_t = torch.as_tensor(context_lens, device=dev)
    q_t = torch.as_tensor(query_lens, device=dev)
    req = torch.repeat_interleave(torch.arange(r_n, device=dev), q_t)
    j = torch.arange(len(req), device=dev) - (torch.cumsum(q_t, 0) - q_t)[req]
    key_col = nb * bs + j  # new keys go after the (padded) cached part
    # Mask: cached key p visible iff p < ctx; new key i visible iff i <= j.
    kpos = torch.arange(max_k, device=dev)
    qj = torch.arange(max_q, device=dev)
    cached_ok = kpos[None, None, :] < ctx_t[:, None, None]
    new_ok = (kpos[None, None, :] >= nb * bs) & (kpos[None, None, :] - nb * bs <= qj[None, :, None]) \
        & (kpos[None, None, :] - nb * bs < q_t[:, None, None])
    mask = (((kpos[None, None, :] < nb * bs) & cached_ok) | new_ok)[:, None]  # [R, 1, max_q, max_k]

    def run():
        k = torch.zeros(r_n, max_k, hkv, d, dtype=key.dtype, device=dev)
        v = torch.zeros_like(k)
        if nb:
            k[:, :nb * bs] = key_cache[table].flatten(1, 2)
            v[:, :nb * bs] = value_cache[table].flatten(1, 2)
        k[req, key_col] = key
        v[req, key_col] = value
        qp = torch.zeros(r_n, max_q, hq, d, dtype=query.dtype, device=dev)
        qp[req, j] = query
        kk = k.transpose(1, 2).repeat_interleave(hq // hkv, 1)
        vv = v.transpose(1, 2).repeat_interleave(hq // hkv, 1)
        o = F.scaled_dot_product_attention(qp.transpose(1, 2), kk, vv, attn_mask=mask, scale=scale)
        return o.transpose(1, 2)[req, j]

    return run


def flex_paged(query, key, value, key_cache, value_cache, query_lens, context_lens, owned, scale):
    """FlexAttention over the paged cache in place; None where a block has two owners.

    Writes the new tokens' K/V into copies of the caches (vLLM's cache write, not timed)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dev = query.device
    num_blocks, bs = key_cache.shape[:2]
    owner = torch.full((num_blocks,), -1, dtype=torch.int64)
    logical = torch.zeros(num_blocks, dtype=torch.int64)
    for r, blocks in enumerate(owned):
        b = torch.as_tensor(blocks)
        if (owner[b] >= 0).any():
            return None
        owner[b] = r
        logical[b] = torch.arange(len(blocks))
    owner, logical = owner.to(dev), logical.to(dev)
    q_t = torch.as_tensor(query_lens, device=dev)
    ctx_t = torch.as_tensor(context_lens, device=dev)
    q_req = torch.repeat_interleave(torch.arange(len(query_lens), device=dev), q_t)
    q_pos = ctx_t[q_req] + torch.arange(len(q_req), device=dev) - (torch.cumsum(q_t, 0) - q_t)[q_req]
    own_blocks = [torch.as_tensor(b, device=dev) for b in owned]
    slot = torch.cat([own_blocks[r][q_pos[q_req == r] // bs] * bs + q_pos[q_req == r] % bs
                      for r in range(len(query_lens))])
    kc, vc = key_cache.clone(), value_cache.clone()
    kc.view(-1, *kc.shape[2:])[slot] = key
    vc.view(-1, *vc.shape[2:])[slot] = value
    kf = kc.view(1, -1, *kc.shape[2:]).transpose(1, 2)  # [1, Hkv, N*bs, D]: a view, no copy
    vf = vc.view(1, -1, *vc.shape[2:]).transpose(1, 2)

    def mask_mod(b, h, qi, ki):
        blk = ki // bs
        return (owner[blk] == q_req[qi]) & (logical[blk] * bs + ki % bs <= q_pos[qi])

    t, n_keys = query.shape[0], num_blocks * bs
    block_mask = create_block_mask(mask_mod, None, None, t, n_keys, device=dev)
    compiled = torch.compile(flex_attention, dynamic=False)
    q4 = query.transpose(0, 1)[None]

    def run():
        return compiled(q4, kf, vf, block_mask=block_mask, scale=scale, enable_gqa=True)[0].transpose(0, 1)

    return run


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def capture(fn, device: torch.device):
    """Warm `fn` up, capture it in a CUDA graph; returns (replay, output buffer of the captured call)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    sync(device)
    return graph.replay, out


def time_ms(fn, device: torch.device, *, reps: int = 50, warmup_ms: float = 25, rep_ms: float = 150) -> float:
    """Median milliseconds of one call."""
    if device.type != "cuda":
        for _ in range(2):
            fn()
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)
    try:
        from triton.testing import do_bench
    except ImportError:  # pragma: no cover - CUDA without Triton
        do_bench = None
    if do_bench is not None:
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    flush = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device=device)  # pragma: no cover
    for _ in range(3):  # pragma: no cover
        fn()
    times = []  # pragma: no cover
    for _ in range(reps):  # pragma: no cover
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)  # pragma: no cover


def host_ms(fn, reps: int = 5) -> tuple[float, object]:
    """Median host milliseconds of `fn()` (planning, copies with a sync inside) and its last result."""
    samples, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples), out


def peak_bytes(fn, device: torch.device) -> int | None:
    """Device memory a call allocates beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return int(peak)


def measure(row, fn, ref, device, tol: float = 1e-2, reps: int = 50, form: str = "graph", poison=None) -> None:
    """Check `fn` against `ref` (relative error at most `tol`), then time it (`reps` calls on the CPU): a
    replayed CUDA graph (`form` graph) or plain calls (eager, and always on the CPU). `poison`: (key cache,
    value cache, slots no request may read) filled with NaN/inf (an fp8 cache: 0x7f) while the check runs; a
    graph's output is filled with NaN before its checking replay."""
    t0 = time.time()
    fn()
    sync(device)
    row["compile_s"] = time.time() - t0
    peak = peak_bytes(fn, device)
    row["peak_mb"] = None if peak is None else peak / 2**20
    graph = form != "eager" and device.type == "cuda"
    call, out = capture(fn, device) if graph else (fn, None)
    if poison is not None:
        kc, vc = (c.view(torch.uint8) if c.dtype.itemsize == 1 else c for c in poison[:2])
        dead = poison[2]
        saved = kc[dead].clone(), vc[dead].clone()
        kc[dead], vc[dead] = (0x7F, 0x7F) if kc.dtype == torch.uint8 else (float("nan"), float("inf"))
    try:
        if graph:
            out.fill_(float("nan"))
            call()
            sync(device)
        else:
            out = call()
        row["rel_err"] = _rel_err(out[: ref.shape[0]], ref)
    finally:
        if poison is not None:
            kc[dead], vc[dead] = saved
    row["ok"] = row["rel_err"] <= tol
    if row["ok"]:
        row["ms"] = time_ms(call, device, reps=reps)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return math.inf
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def _readable(lay, device) -> torch.Tensor:
    """[num_blocks, block_size] True for slots some request of `lay` (`scenarios.Layout`) may read (context
    or its new tokens)."""
    bs = lay.block_size
    ok = torch.zeros(lay.num_blocks * bs, dtype=torch.bool)
    for blocks, q, c in zip(lay.owned, lay.scenario.query_lens, lay.scenario.context_lens):
        pos = np.arange(c + q)
        ok[torch.as_tensor(blocks[pos // bs] * bs + pos % bs)] = True
    return ok.view(lay.num_blocks, bs).to(device)


def commit() -> str:
    """The checkout measured: its short commit, `+dirty` when files differ from it. A copy of the tree outside
    its own git checkout may name its commit in a `COMMIT` file at its root; '' when neither says."""
    root = Path(__file__).resolve().parent.parent
    git = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True)  # noqa: E731
    top = git("rev-parse", "--show-toplevel")
    if top.returncode or Path(top.stdout.strip()).resolve() != root:
        named = root / "COMMIT"
        return named.read_text().strip() if named.is_file() else ""
    head = git("rev-parse", "--short", "HEAD")
    return head.stdout.strip() + ("+dirty" if git("status", "--porcelain", "-uno").stdout.strip() else "")


def environment(device: torch.device) -> dict:
    """What a results file records of its run: device, versions, date (UTC) and commit."""
    env = dict(torch=torch.__version__, python=platform.python_version(), device_type=device.type,
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=commit())
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(device=p.name, sms=p.multi_processor_count, memory_gb=round(p.total_memory / 2**30, 1),
                   cuda=torch.version.cuda)
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        env["device"] = platform.processor() or platform.machine()
    return env
