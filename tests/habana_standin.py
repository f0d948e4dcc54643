"""A stand-in for Intel Gaudi's `habana_frameworks` and `torch.hpu`, so that vllm-gaudi's real
modules import and run on a CPU-only machine.

Why: the project has no Gaudi. vllm-gaudi imports `habana_frameworks.torch` at the top of most
of its modules and calls a handful of its functions (mark_step, synchronize, wrap_in_hpu_graph,
is_lazy, the device type, ...). With these replaced by the CPU meanings below, vllm-gaudi's
platform, worker, model runner, attention backend and ops can be imported and driven by tests
and benchmarks, against its own code rather than a copy of it.

Usage (anything that imports vllm_gaudi must come after `install()`):

    import habana_standin
    habana_standin.install()          # idempotent; returns the `StandIn` state object
    import vllm_gaudi.extension.ops   # now imports on CPU
    ...
    habana_standin.uninstall()        # removes the stand-in modules and `torch.hpu` again

    with habana_standin.installed():  # the same as a context manager
        ...

What it is, deliberately small and explicit (a name that is not here raises AttributeError,
so a new vllm-gaudi dependency shows up as an error naming it, never as a silent no-op):

- `habana_frameworks.torch.core`: `mark_step`, `hpu_initialize`, `hpu_inference_set_env`: no-ops.
- `habana_frameworks.torch.hpu`: `is_available` (True), `device_count` (1), `synchronize`,
  `wrap_in_hpu_graph(module, ...)` (returns the module: no graphs on CPU; counted in
  `StandIn.wrapped`), `metrics.metric_localcontext`.
- `habana_frameworks.torch.utils.internal.is_lazy()`: `lazy` (default False: eager /
  torch.compile mode, the mode vllm-gaudi defaults to today).
- `habana_frameworks.torch.utils.experimental`: `_get_device_type()` returns
  `synDeviceType.synDeviceGaudi3` (`install(device="gaudi2")` for Gaudi2).
- `habana_frameworks.torch.internal.bridge_config.env_setting(name, value)`: a no-op context.
- `habana_frameworks.torch.hpex.kernels`: `apply_rotary_pos_emb` / `RotaryPosEmbeddingMode` (torch
  RoPE with the kernel's contract: vllm-gaudi's rotary embedding has no fallback), and no FusedSDPA,
  so vllm-gaudi's kernel loader (`vllm_gaudi.extension.kernels`) falls back to its native attention.
- `habana_frameworks.torch.hpex.normalization.FusedRMSNorm`: vLLM's native RMSNorm arithmetic
  (vllm-gaudi's RMSNorm has no fallback either).
- `torch.ops.hpu.mixture_of_experts`: Gaudi's fused MoE kernel as torch arithmetic (`habana_moe.py`;
  vllm-gaudi's unquantized MoE layer has no fallback); an engine's process (`vllm_helpers.gaudi_standin_context`)
  also gets vLLM's MoE layer ops for CPU tensors (`habana_moe.vllm_moe_ops_on_cpu`).
- vLLM: `vllm.multimodal.utils.group_mm_kwargs_by_modality`, the one vLLM name that
  vllm-gaudi's `hpu_model_runner` imports and vLLM 0.32 no longer has (added only when
  missing; it refuses, naming 0.32's `group_and_batch_mm_kwargs`: only vllm-gaudi's own multimodal
  batching calls it, the unified runner's `hpu_multimodal.py` calls 0.32's), and the
  `kernel_block_sizes=` argument vllm-gaudi's input batch passes to vLLM's
  `MultiGroupBlockTable` (0.32 has none; accepted when equal to the block sizes), and
  `MultiModalRegistry.supports_multimodal_inputs(model_config)` (0.32: the model config's
  `supports_multimodal_inputs`), `KVCacheTensor.shared_by` (0.32: `layers`), and two 0.32 changes to
  MLA layers that vllm-gaudi's MLA layer predates (`_bridge_mla_layers`: a cache tuple bound as it is,
  the wrapper's `fuse_qkv_rmsnorm` at its default), and
  `PunicaWrapperBase.apply_lora_full_linear` made concrete (0.32 declares it abstract, for LoRA on
  classifier heads only; vllm-gaudi's `PunicaWrapperHPU` lacks it and so cannot be instantiated):
  it raises, naming that case; vllm-gaudi's embedding LoRA layer reads `_embeddings_indices[1]` of the
  `[2, tokens]` layout of earlier vLLM releases, 0.32 keeps that row alone (`[tokens]`): the layer is given a
  view of the punica wrapper with 0.32's tensor as row 1 (`_embedding_lora_reads_row_one`).
- vllm-gaudi's vision-encoder attention: per image, as its FusedSDPA branch (`per_image_encoder_attention`,
  for the multimodal tests).
- vLLM's kernel library: the build this CPU runs, picked as vLLM's CPU platform picks it
  (`Platform.import_kernels`, which vllm-gaudi's platform keeps, imports `vllm._C`: AVX-512 BF16 only).
- vLLM's model inspection (a child process that would load vllm-gaudi's plugins without the
  stand-in): in this process.
- `VLLM_BUILD` (unless set): `0.0.0.0`, the Gaudi software version vllm-gaudi's runtime config
  otherwise reads from habana-torch-plugin's metadata; no version-gated HPU kernel is enabled.
- the torch.compile backend `"hpu_backend"`: runs the captured graph as it is (eager).
- `torch.hpu`: `synchronize`, `is_available`, `device_count`, `current_device`,
  `mem_get_info` (free/total = `memory_bytes`), `max_memory_allocated`,
  `memory_allocated`, `reset_peak_memory_stats`, `Stream`/`Event`/`current_stream`/`stream`
  (CPU no-ops), `random.manual_seed_all`, `graphs.input_hash`, `get_device_properties`.

Not a device: tensors still cannot live on `"hpu"`; `hpu_device_as_cpu()` (a context
manager) maps `device="hpu"` arguments of torch calls to the CPU for tests that need it.
"""
from __future__ import annotations

import contextlib
import enum
import importlib.machinery
import os
import sys
import types
from dataclasses import dataclass, field

import torch

import habana_moe

#: The module names the stand-in provides (and `uninstall` removes).
MODULES = (
    "habana_frameworks",
    "habana_frameworks.torch",
    "habana_frameworks.torch.core",
    "habana_frameworks.torch.hpu",
    "habana_frameworks.torch.hpu.metrics",
    "habana_frameworks.torch.utils",
    "habana_frameworks.torch.utils.internal",
    "habana_frameworks.torch.utils.experimental",
    "habana_frameworks.torch.internal",
    "habana_frameworks.torch.internal.bridge_config",
    "habana_frameworks.torch.hpex",
    "habana_frameworks.torch.hpex.kernels",
    "habana_frameworks.torch.hpex.normalization",
    "torch.hpu",
    "torch.hpu.random",
    "torch.hpu.graphs",
)


class synDeviceType(enum.Enum):  # noqa: N801  (habana's own spelling)
    synDeviceGaudi = 1
    synDeviceGaudi2 = 2
    synDeviceGaudi3 = 3


@dataclass
class StandIn:
    """The installed stand-in's settings and what vllm-gaudi did with it."""

    device: str = "gaudi3"  #: what `_get_device_type()` reports: "gaudi2" or "gaudi3"
    lazy: bool = False  #: what `is_lazy()` reports (vllm-gaudi: lazy mode uses HPU graphs)
    #: free and total memory reported by `torch.hpu.mem_get_info`; vllm-gaudi sizes its KV cache from it
    #: (and the CPU then allocates that cache for real: keep it small)
    memory_bytes: int = 512 << 20
    build: str = "0.0.0.0"  #: VLLM_BUILD, the Gaudi software version vllm-gaudi's runtime config asks for
    wrapped: list = field(default_factory=list)  #: modules passed to `wrap_in_hpu_graph`
    mark_steps: int = 0  #: calls of `htcore.mark_step` / `htorch.core.mark_step`
    set_build: bool = False  #: install() set VLLM_BUILD (uninstall() removes it)


_STATE: StandIn | None = None


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    mod.__file__ = __file__  # so that tools printing a module's file do not fail
    mod.__path__ = []  # a package: `import a.b.c` finds the submodules in sys.modules
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)  # importlib.util.find_spec reads it
    return mod


def _noop(*args, **kwargs) -> None:
    return None


class _Stream:
    """CPU stand-in for torch.hpu.Stream / Event: work is synchronous, so waiting is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def record_event(self, event=None):
        return _Stream()

    def query(self) -> bool:
        return True


class RotaryPosEmbeddingMode(enum.Enum):
    BLOCKWISE = 0  # GPT-NeoX: the two halves of the head rotate together
    PAIRWISE = 1  # GPT-J: neighbouring pairs rotate together


def apply_rotary_pos_emb(x, cos, sin, position_ids=None, offset=0, mode=RotaryPosEmbeddingMode.BLOCKWISE):
    """The HPU RoPE kernel's contract as vllm-gaudi calls it: `cos`/`sin` already expanded to the
    rotated width (halves concatenated for BLOCKWISE, pairs repeated for PAIRWISE), broadcast over heads."""
    if position_ids is not None or offset:
        raise NotImplementedError("the stand-in RoPE takes pre-gathered cos/sin only (vllm-gaudi's use)")
    if mode == RotaryPosEmbeddingMode.BLOCKWISE:
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return (x * cos + rotated * sin).to(x.dtype)


class FusedRMSNorm:
    """`FusedRMSNorm.apply(x, weight, eps)`, with vLLM's native RMSNorm arithmetic (float32 inside).
    vllm-gaudi's RMSNorm calls this kernel with no fallback."""

    @staticmethod
    def apply(x, weight, eps):
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return h.to(dtype) * weight


def _build(state: StandIn) -> dict[str, types.ModuleType]:
    def mark_step(*args, **kwargs):
        state.mark_steps += 1

    def wrap_in_hpu_graph(module, *args, **kwargs):
        state.wrapped.append(module)
        return module

    @contextlib.contextmanager
    def metric_localcontext(name):
        yield types.SimpleNamespace(stats=lambda: [("TotalNumber", 0), ("TotalTime", 0)])

    @contextlib.contextmanager
    def env_setting(name, value):
        yield

    device_types = {"gaudi2": synDeviceType.synDeviceGaudi2, "gaudi3": synDeviceType.synDeviceGaudi3}
    if state.device not in device_types:
        raise ValueError(f"device={state.device!r}: expected one of {sorted(device_types)}")

    mods = {
        "habana_frameworks": _module("habana_frameworks"),
        "habana_frameworks.torch.core": _module("habana_frameworks.torch.core", mark_step=mark_step,
                                                hpu_initialize=_noop, hpu_inference_set_env=_noop),
        "habana_frameworks.torch.hpu.metrics": _module("habana_frameworks.torch.hpu.metrics",
                                                       metric_localcontext=metric_localcontext),
        "habana_frameworks.torch.utils.internal": _module("habana_frameworks.torch.utils.internal",
                                                          is_lazy=lambda: state.lazy),
        "habana_frameworks.torch.utils.experimental": _module(
            "habana_frameworks.torch.utils.experimental", synDeviceType=synDeviceType,
            _get_device_type=lambda: device_types[state.device]),
        "habana_frameworks.torch.internal.bridge_config": _module("habana_frameworks.torch.internal.bridge_config",
                                                                  env_setting=env_setting),
        "habana_frameworks.torch.hpex.kernels": _module(
            "habana_frameworks.torch.hpex.kernels", RotaryPosEmbeddingMode=RotaryPosEmbeddingMode,
            apply_rotary_pos_emb=apply_rotary_pos_emb),
        "habana_frameworks.torch.hpex.normalization": _module("habana_frameworks.torch.hpex.normalization",
                                                              FusedRMSNorm=FusedRMSNorm),
    }
    mods["habana_frameworks.torch.hpu"] = _module(
        "habana_frameworks.torch.hpu", is_available=lambda: True, device_count=lambda: 1, synchronize=_noop,
        wrap_in_hpu_graph=wrap_in_hpu_graph, metrics=mods["habana_frameworks.torch.hpu.metrics"])
    mods["habana_frameworks.torch.utils"] = _module(
        "habana_frameworks.torch.utils", internal=mods["habana_frameworks.torch.utils.internal"],
        experimental=mods["habana_frameworks.torch.utils.experimental"])
    mods["habana_frameworks.torch.internal"] = _module(
        "habana_frameworks.torch.internal", bridge_config=mods["habana_frameworks.torch.internal.bridge_config"])
    mods["habana_frameworks.torch.hpex"] = _module(
        "habana_frameworks.torch.hpex", kernels=mods["habana_frameworks.torch.hpex.kernels"],
        normalization=mods["habana_frameworks.torch.hpex.normalization"])
    mods["habana_frameworks.torch"] = _module(
        "habana_frameworks.torch", torch=torch, core=mods["habana_frameworks.torch.core"],
        hpu=mods["habana_frameworks.torch.hpu"], utils=mods["habana_frameworks.torch.utils"],
        internal=mods["habana_frameworks.torch.internal"], hpex=mods["habana_frameworks.torch.hpex"])
    mods["habana_frameworks"].torch = mods["habana_frameworks.torch"]

    mods["torch.hpu.random"] = _module("torch.hpu.random", manual_seed_all=_noop, manual_seed=_noop)
    mods["torch.hpu.graphs"] = _module("torch.hpu.graphs", input_hash=lambda obj: hash(repr(obj)))
    mods["torch.hpu"] = _module(
        "torch.hpu", synchronize=_noop, is_available=lambda: True, device_count=lambda: 1,
        current_device=lambda: 0, set_device=_noop, mem_get_info=lambda *a: (state.memory_bytes, state.memory_bytes),
        max_memory_allocated=lambda *a, **k: 0, memory_allocated=lambda *a, **k: 0,
        reset_peak_memory_stats=_noop, memory_stats=lambda *a, **k: {}, Stream=_Stream, Event=_Stream,
        current_stream=lambda *a, **k: _Stream(), stream=lambda s: contextlib.nullcontext(),
        get_device_properties=lambda *a: types.SimpleNamespace(name="HPU stand-in (CPU)",
                                                               total_memory=state.memory_bytes),
        random=mods["torch.hpu.random"], graphs=mods["torch.hpu.graphs"])
    return mods


def install(device: str = "gaudi3", lazy: bool = False, memory_bytes: int = 512 << 20) -> StandIn:
    """Put the stand-in modules in `sys.modules` and set `torch.hpu`; returns its state.

    Installing again returns the installed state (its settings are not changed).
    Refuses to replace a real `habana_frameworks` that is already imported.
    """
    global _STATE
    if _STATE is not None:
        return _STATE
    real = sys.modules.get("habana_frameworks")
    if real is not None and getattr(real, "__file__", None) != __file__:
        raise RuntimeError("a real habana_frameworks is already imported; the stand-in would hide it")
    state = StandIn(device=device, lazy=lazy, memory_bytes=memory_bytes)
    sys.modules.update(_build(state))
    torch.hpu = sys.modules["torch.hpu"]
    if "VLLM_BUILD" not in os.environ:  # read from habana-torch-plugin's metadata on a Gaudi
        os.environ["VLLM_BUILD"] = state.build
        state.set_build = True
    _register_compile_backend()
    _provide_missing_vllm_names()
    _import_the_kernels_this_cpu_runs()
    _bridge_mla_layers()  # after the kernel choice: importing vLLM's layers loads its kernel library
    _bridge_lora()  # likewise
    _inspect_models_in_this_process()
    habana_moe.register()
    _STATE = state
    return state


def _eager_backend(graph_module, example_inputs, **options):
    """(`options`: the Gaudi compiler's, e.g. vllm-gaudi's `force_static_compile`; nothing to set on the CPU)"""
    return graph_module.forward


def _register_compile_backend() -> None:
    """`torch.compile(backend="hpu_backend")` (vllm-gaudi decorates functions with it at import):
    on the CPU the captured graph runs as it is. Registered once per process; dynamo has no
    unregister, and an eager backend under that name harms nothing."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if "hpu_backend" not in _COMPILER_FNS:
        register_backend(name="hpu_backend")(_eager_backend)


def _group_mm_kwargs_by_modality(*args, **kwargs):
    raise NotImplementedError(
        "vllm.multimodal.utils.group_mm_kwargs_by_modality is gone from this vLLM (0.32 has "
        "group_and_batch_mm_kwargs); the habana stand-in only provides the name so that vllm-gaudi's "
        "hpu_model_runner imports. vllm-gaudi's own multimodal batching is not supported through it (the "
        "unified runner's, vllm_plugin/hpu_multimodal.py, calls group_and_batch_mm_kwargs).")


def _provide_missing_vllm_names() -> None:
    """vllm-gaudi 091bbadd tracks a vLLM main of 2026-08 whose `vllm.multimodal.utils` still had
    `group_mm_kwargs_by_modality`; vLLM 0.32 does not, and `hpu_model_runner` imports it at the top
    (it calls it only for multimodal inputs). Added as a function that refuses multimodal inputs
    clearly, only when vLLM is importable and lacks it."""
    try:
        import vllm.multimodal.utils as mm_utils
    except ImportError:
        return
    if not hasattr(mm_utils, "group_mm_kwargs_by_modality"):
        mm_utils.group_mm_kwargs_by_modality = _group_mm_kwargs_by_modality
    _accept_kernel_block_sizes()
    from vllm.v1.kv_cache_interface import KVCacheTensor

    if not hasattr(KVCacheTensor, "shared_by"):
        # vllm-gaudi allocates one cache per layer named in `shared_by`; vLLM 0.32 calls that list
        # `layers` (and its `size` covers all of them, so vllm-gaudi sizes each layer's cache for all:
        # more blocks than the scheduler hands out, which costs memory only).
        KVCacheTensor.shared_by = property(lambda self: self.layers)
    from vllm.multimodal.registry import MultiModalRegistry

    if not hasattr(MultiModalRegistry, "supports_multimodal_inputs"):
        # vllm-gaudi asks the registry; vLLM 0.32 moved the answer to the model config.
        MultiModalRegistry.supports_multimodal_inputs = lambda self, model_config: \
            model_config.supports_multimodal_inputs


def _bridge_lora() -> None:
    """vllm-gaudi's LoRA code on vLLM 0.32: the punica wrapper made instantiable, the embedding layer's
    offsets (see the module docstring)."""
    from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase

    if getattr(PunicaWrapperBase.apply_lora_full_linear, "__isabstractmethod__", False):
        # Set before vllm-gaudi's PunicaWrapperHPU class is made (vLLM imports it when LoRA starts).
        PunicaWrapperBase.apply_lora_full_linear = _no_full_linear_lora
    _embedding_lora_reads_row_one()


def _embedding_lora_reads_row_one() -> None:
    """vllm-gaudi 091bbadd's `HPUVocabParallelEmbeddingWithLoRA.forward` reads
    `punica_wrapper._embeddings_indices[1][:num_tokens]`: the per-token row offsets into the stacked LoRA
    embeddings, row 1 of the `[2, tokens]` tensor of earlier vLLM releases. vLLM 0.32 keeps only those
    offsets (`[tokens]`, the same values without extra vocabulary), so `[1]` is one number and the slice
    raises `IndexError: slice() cannot be applied to a 0-dim tensor`. vllm-gaudi's layers get a view of
    the wrapper whose `_embeddings_indices[1]` is 0.32's tensor; everything else is the wrapper's."""
    from vllm.lora.layers.vocab_parallel_embedding import VocabParallelEmbeddingWithLoRA

    base = VocabParallelEmbeddingWithLoRA.set_mapping
    if getattr(base, "_standin", False):
        return

    def set_mapping(self, punica_wrapper):
        if type(self).__module__.startswith("vllm_gaudi.") and punica_wrapper._embeddings_indices.dim() == 1:
            punica_wrapper = _OffsetsAsRowOne(punica_wrapper)
        base(self, punica_wrapper)

    set_mapping._standin = True
    VocabParallelEmbeddingWithLoRA.set_mapping = set_mapping


class _OffsetsAsRowOne:
    """A punica wrapper as vllm-gaudi's embedding LoRA reads it (see `_embedding_lora_reads_row_one`)."""

    def __init__(self, wrapper):
        self._wrapper = wrapper

    def __getattr__(self, name):
        return getattr(self._wrapper, name)

    @property
    def _embeddings_indices(self):
        return (None, self._wrapper._embeddings_indices)


def _no_full_linear_lora(self, *args, **kwargs):
    raise NotImplementedError(
        f"{type(self).__name__}.apply_lora_full_linear: LoRA on a classifier head (vLLM 0.32's "
        "ClassifierWithLoRA) is not in vllm-gaudi 091bbadd's punica wrapper; the habana stand-in only "
        "makes the wrapper instantiable for the LoRA layers it does implement")


def _bridge_mla_layers() -> None:
    """Two vLLM changes after vllm-gaudi's snapshot that stop any MLA model in vllm-gaudi (its own MLA
    backend as well as the unified one) at start-up with vLLM 0.32:

    - `MLAAttention.bind_kv_cache` (called by vLLM's `bind_kv_cache`, which vllm-gaudi's worker and runner
      use) does `kv_cache.squeeze(1)` of vLLM's own page; vllm-gaudi binds its MLA cache tuple
      `(latent_cache, None, None, None)`: `AttributeError: 'tuple' object has no attribute 'squeeze'`.
      A tuple is bound as it is (what vllm-gaudi's `HPUMLAAttention.forward_impl` reads), as vllm-gaudi
      itself does for the same change in `MambaBase.bind_kv_cache` (its patches.py);
    - `MultiHeadLatentAttentionWrapper.forward` reads `self.fuse_qkv_rmsnorm`, which 0.32's `__init__` sets
      (default False: opt-in) and vllm-gaudi's `HPUMultiHeadLatentAttentionWrapper.__init__` (which skips
      the base `__init__`) does not: `AttributeError: ... no attribute 'fuse_qkv_rmsnorm'`. The class
      gets 0.32's default.

    Later vllm-gaudi versions make both changes themselves (`HPUMLAAttention.bind_kv_cache` keeping the
    tuple, after vLLM #51718; `self.fuse_qkv_rmsnorm = False` in its wrapper, after vLLM #53906)."""
    try:
        from vllm.model_executor.layers.attention import MLAAttention
        from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper
    except ImportError:
        return

    bind = MLAAttention.bind_kv_cache
    if not getattr(bind, "_standin", False):
        def bind_kv_cache(self, kv_cache) -> None:
            if isinstance(kv_cache, tuple):
                self.kv_cache = kv_cache
            else:
                bind(self, kv_cache)

        bind_kv_cache._standin = True
        MLAAttention.bind_kv_cache = bind_kv_cache
    if not hasattr(MultiHeadLatentAttentionWrapper, "fuse_qkv_rmsnorm"):
        MultiHeadLatentAttentionWrapper.fuse_qkv_rmsnorm = False


def _import_the_kernels_this_cpu_runs() -> None:
    """vLLM's kernel library for this CPU, chosen as vLLM's CPU platform chooses it.

    vllm-gaudi's `HpuPlatform` keeps `Platform.import_kernels`, which imports `vllm._C`: on a Gaudi
    host vLLM is built without CPU kernels and that import fails harmlessly, but the stand-in runs on
    vLLM's CPU build, whose `vllm._C` needs AVX-512 with BF16 and dies with an illegal instruction on
    any other x86 CPU. `CpuPlatform.import_kernels` picks `_C`, `_C_AVX512` or `_C_AVX2` from torch's
    CPU probes (which `UNIFIED_TEST_CPU=avx2` can hide: tests/cpu_features.py)."""
    try:
        from vllm.platforms.cpu import CpuPlatform
        from vllm.platforms.interface import Platform
    except ImportError:
        return
    import cpu_features

    cpu_features.force_from_env()
    Platform.import_kernels = classmethod(lambda cls: CpuPlatform.import_kernels())


def _inspect_models_in_this_process() -> None:
    """vLLM inspects a model class it has no cached info for in a child process
    (`python -m vllm.model_executor.models.registry`, to keep CUDA out of the parent), which loads the
    general plugins: vllm-gaudi's import `habana_frameworks`, which the child lacks, and the inspection
    fails ("Model architectures [...] failed to be inspected") on a machine whose cache is empty. The
    stand-in runs it in this process, where the stand-in is installed (on the CPU there is no CUDA)."""
    try:
        from vllm.model_executor.models import registry
    except ImportError:
        return
    registry._run_in_subprocess = lambda fn: fn()


def _accept_kernel_block_sizes() -> None:
    """vllm-gaudi's `HPUInputBatch` passes `kernel_block_sizes=` to vLLM's `MultiGroupBlockTable`, whose
    vLLM-0.32 constructor has no such argument. Accepted when each kernel block size equals its group's
    block size (one kernel block per cache block: what 0.32's table does anyway); anything else is refused."""
    import inspect

    from vllm.v1.worker.block_table import MultiGroupBlockTable

    init = MultiGroupBlockTable.__init__
    if "kernel_block_sizes" in inspect.signature(init).parameters or getattr(init, "_standin", False):
        return

    def __init__(self, *args, kernel_block_sizes=None, **kwargs):
        block_sizes = kwargs.get("block_sizes")
        if kernel_block_sizes is not None and list(kernel_block_sizes) != list(block_sizes):
            raise NotImplementedError(f"kernel_block_sizes={kernel_block_sizes} != block_sizes={block_sizes}: "
                                      "vLLM 0.32's block table has no kernel blocks smaller than cache blocks")
        init(self, *args, **kwargs)

    __init__._standin = True
    MultiGroupBlockTable.__init__ = __init__


def uninstall() -> None:
    """Remove every stand-in module and `torch.hpu` (modules that imported them keep their references)."""
    global _STATE
    if _STATE is not None and _STATE.set_build:
        os.environ.pop("VLLM_BUILD", None)
    for name in MODULES:
        sys.modules.pop(name, None)
    if hasattr(torch, "hpu"):
        del torch.hpu
    _STATE = None


def stub_vision_only_vllm_models() -> list[str]:
    """Where torchvision is missing (this project's CPU venv: the PyPI wheels do not match its torch),
    stand in for vLLM model modules that need it and that vllm-gaudi imports for text models too.

    vllm-gaudi's `HPUModelRunner.load_model` -> `apply_model_specific_patches` imports
    `vllm_gaudi.models.llama4`, which imports vLLM's multimodal `mllama4` (transformers' Llama 4
    image processor -> torchvision) only to subclass `Llama4ForConditionalGeneration`. The stand-in
    module holds that class as a placeholder that cannot be built, so vllm-gaudi's check
    `isinstance(model, HpuLlama4ForConditionalGeneration)` is False for every other model, as it is
    with the real one. Likewise for Qwen3-MoE models it imports vLLM's `qwen3_5` (-> `qwen3_vl` -> transformers'
    Qwen2-VL image processor -> torchvision) only to test `isinstance(inner_model, Qwen3_5Model)`.
    Returns the module names stood in for (none where torchvision imports).
    """
    try:
        import torchvision  # noqa: F401
        return []
    except Exception:  # missing, or built for another torch
        pass

    class Llama4ForConditionalGeneration(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            raise NotImplementedError("vLLM's Llama 4 vision model needs torchvision, which is not installed")

    class Qwen3_5Model(torch.nn.Module):  # noqa: N801 (vLLM's name)
        def __init__(self, *args, **kwargs):
            raise NotImplementedError("vLLM's Qwen3.5 models import its Qwen3-VL model, which needs torchvision")

    stand_ins = {"vllm.model_executor.models.mllama4": {"Llama4ForConditionalGeneration": Llama4ForConditionalGeneration},
                 "vllm.model_executor.models.qwen3_5": {"Qwen3_5Model": Qwen3_5Model}}
    for name, attrs in stand_ins.items():
        sys.modules[name] = _module(name, **attrs)
    return list(stand_ins)


def per_image_encoder_attention() -> None:
    """vllm-gaudi's vision-encoder attention (`HpuMMEncoderAttention`) as its FusedSDPA branch runs on Gaudi:
    each image's patches attend among themselves (`cu_seqlens`), output `[batch, seq, heads, head_dim]`.
    Without FusedSDPA (this stand-in has none) the class falls back to one SDPA over every patch of the batch
    (`cu_seqlens` unused: two images would attend to each other) and a `[batch, seq, heads * head_dim]` output
    that vLLM 0.32's Qwen2-VL cannot read. The stand-in gives the class vLLM's own per-image SDPA, which the
    FusedSDPA branch computes; call after `install()`. (Test only: the text model's attention is untouched.)"""
    from vllm.v1.attention.ops.vit_attn_wrappers import torch_sdpa_wrapper
    from vllm_gaudi.ops.hpu_mm_encoder_attention import HpuMMEncoderAttention

    def _forward_sdpa(self, query, key, value, cu_seqlens=None):
        bsz, q_len = query.shape[:2]
        q, k, v = self.view_qkv_to_4d(query, key, value, bsz, q_len, key.size(1))
        # vLLM's torch SDPA per image, called as a function (its custom op is registered for the HPU key here)
        out = torch_sdpa_wrapper(q, k, v, self.scale, cu_seqlens, enable_gqa=self.num_heads > self.num_kv_heads)
        return out if query.dim() == 4 else out.reshape(bsz, q_len, -1)

    HpuMMEncoderAttention._forward_sdpa = _forward_sdpa


def keep_float32() -> None:
    """Let vllm-gaudi run a float32 model in float32 on the CPU (test only; call after `install()`).

    Gaudi has no fast float32 path, so vllm-gaudi's `HpuPlatform.check_and_update_config` turns a
    float32 model into bfloat16, and its runner then names the cache dtype "float32", which vLLM
    0.32's backend selector does not accept ("auto" means the same: the model dtype). A comparison of
    attention against vLLM's CPU float32 run needs float32 everywhere else, so this keeps it: the
    platform's choice is undone for float32 models, and the runner's cache dtype name is "auto".
    Nothing of the attention path changes.
    """
    from vllm_gaudi.platform import HpuPlatform
    from vllm_gaudi.v1.worker import hpu_model_runner

    original = HpuPlatform.__dict__["check_and_update_config"].__func__
    if getattr(original, "_keeps_float32", False):
        return

    def check_and_update_config(cls, vllm_config):
        model = vllm_config.model_config
        dtype = None if model is None else model.dtype
        original(cls, vllm_config)
        if dtype == torch.float32:
            model.dtype = torch.float32

    check_and_update_config._keeps_float32 = True
    HpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    hpu_model_runner.HPU_TORCH_DTYPE_TO_STR_DTYPE[torch.float32] = "auto"


def state() -> StandIn | None:
    """The installed stand-in's state, or None."""
    return _STATE


@contextlib.contextmanager
def installed(**kwargs):
    """`install(**kwargs)` for the duration of a `with` block."""
    was_installed = _STATE is not None
    st = install(**kwargs)
    try:
        yield st
    finally:
        if not was_installed:
            uninstall()


def _to_cpu(value):
    if isinstance(value, torch.device) and value.type == "hpu":
        return torch.device("cpu")
    if isinstance(value, str) and value.split(":")[0] == "hpu":
        return "cpu"
    return value


class _HpuAsCpu(torch.overrides.TorchFunctionMode):
    """Every `device=` argument (and `.to("hpu")` target) naming the HPU runs on the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = {k: _to_cpu(v) for k, v in (kwargs or {}).items()}
        args = tuple(_to_cpu(a) for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def hpu_device_as_cpu():
    """Tensors asked for on `"hpu"` are made on the CPU while the block runs."""
    with _HpuAsCpu():
        yield
