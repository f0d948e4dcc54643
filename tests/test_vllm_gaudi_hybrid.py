"""Hybrid models (attention beside Mamba2 layers) on the Gaudi path, through the unified runner.

vllm-gaudi's Mamba2 op (`ops/hpu_mamba_mixer2.py`) reads one batch metadata object of its runner's and takes
decodes together or exactly one prompt padded to whole Mamba chunks per call; the unified runner plans those
calls from its one flat step (`vllm_plugin/hpu_mamba.py`) while the attention layers read the unified batch.

- the planning of the calls (state indices, chunk-to-block map, conv offsets) against values worked out by
  hand from vllm-gaudi's rules, and the one case it cannot take (a chunk off the Mamba chunk grid crossing a
  block boundary: vLLM's 'align' mode never schedules one);
- a tiny random Granite-4.0-h (`GraniteMoeHybridForCausalLM`: Mamba2, attention, Mamba2; float32;
  `tests/vllm_hybrid_helpers.py`) with prefix caching (vLLM's Mamba 'align' mode) and chunked prefill (64-token
  budget), prompts past vllm-gaudi's 256-token hybrid block and prefix hits on cached states, and without prefix
  caching: tokens identical to vLLM's own CPU attention, logprobs within 1e-4;
- what stays refused: attention-free models, state layers other than Mamba2 (GatedDeltaNet), bucket plans and
  speculative decoding beside Mamba2 layers.
"""
from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest

from test_vllm_gaudi import GAUDI_PLUGINS, gaudi  # noqa: F401 (also: the module's skips)
from test_vllm_hybrid import LOGPROB_ATOL, _run

pytestmark = pytest.mark.vllm


def test_attention_free_models_are_refused_on_gaudi(gaudi):
    """An attention-free model stops the start-up naming it; a hybrid and an attention-only model pass."""
    from vllm_gaudi_unified.vllm_plugin.hpu_platform import refuse_unserved_models

    def config(**kw):
        model = SimpleNamespace(is_multimodal_model=False, use_mla=False, hf_text_config=SimpleNamespace(),
                                architecture="Mamba2ForCausalLM", **kw)
        return SimpleNamespace(model_config=model, lora_config=None)

    refuse_unserved_models(config(is_hybrid=False, is_attention_free=False))
    refuse_unserved_models(config(is_hybrid=True, is_attention_free=False))
    with pytest.raises(NotImplementedError, match=r"attention-free models \(Mamba2ForCausalLM"):
        refuse_unserved_models(config(is_hybrid=False, is_attention_free=True))


def _mamba_spec():
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=256, shapes=((3, 8),), dtypes=(torch.float32,))


def test_state_layers_other_than_mamba2_are_refused(gaudi):
    """A state layer that is not vllm-gaudi's Mamba2 (a GatedDeltaNet) stops the start-up naming the layer."""
    from vllm_gaudi_unified.vllm_plugin.hpu_mamba import state_layer_names

    class GatedDeltaNet:
        pass

    layers = {"model.layers.0.linear_attn": GatedDeltaNet(), "model.layers.1.self_attn.attn": object()}
    config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=layers))
    groups = [SimpleNamespace(kv_cache_spec=_mamba_spec(), layer_names=["model.layers.0.linear_attn"]),
              SimpleNamespace(kv_cache_spec=object(), layer_names=["model.layers.1.self_attn.attn"])]
    with pytest.raises(NotImplementedError, match=r"layer model\.layers\.0\.linear_attn \(GatedDeltaNet, .*Mamba2 "
                                                  "layers only"):
        state_layer_names(config, groups)
    assert state_layer_names(config, groups[1:], buckets="auto") == []  # attention only: nothing to check


def test_bucket_plans_and_drafts_beside_mamba2_layers_are_refused(gaudi):
    """A Mamba2 layer is served; with a bucket plan or speculative decoding the start-up stops, saying why."""
    from vllm_gaudi.ops.hpu_mamba_mixer2 import HPUMambaMixer2

    from vllm_gaudi_unified.vllm_plugin.hpu_mamba import state_layer_names

    layer = HPUMambaMixer2.__new__(HPUMambaMixer2)  # its type is what is checked
    config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={"m.mixer": layer}),
                             speculative_config=None)
    groups = [SimpleNamespace(kv_cache_spec=_mamba_spec(), layer_names=["m.mixer"])]
    assert state_layer_names(config, groups) == ["m.mixer"]
    with pytest.raises(NotImplementedError, match=r"a bucket plan \(plan\.json\) for a model with Mamba2 layers"):
        state_layer_names(config, groups, buckets="plan.json")
    config.speculative_config = SimpleNamespace(method="ngram")
    with pytest.raises(NotImplementedError, match="speculative decoding with Mamba2 layers"):
        state_layer_names(config, groups)


class _Table:
    """One KV cache group's block table as vllm-gaudi's input batch holds it."""

    def __init__(self, rows):
        self.array = np.asarray(rows, dtype=np.int32)

    def get_numpy_array(self):
        return self.array

    def get_cpu_tensor(self):
        import torch

        return torch.from_numpy(self.array)


class _BlockTables:
    """vllm-gaudi's per-group block tables (`input_batch.block_table`)."""

    def __init__(self, tables):
        self.block_tables = tables

    def __getitem__(self, g):
        return self.block_tables[g]


def _runner(tables, caching=True):
    """The runner attributes `mamba_step` reads, with vllm-gaudi's own `prepare_mamba_state_idxs`."""
    import torch
    from vllm_gaudi.v1.worker.hpu_model_runner import HPUModelRunner

    runner = SimpleNamespace(mamba_chunk_size=64, cache_config=SimpleNamespace(mamba_block_size=256),
                             use_prefix_caching=caching, device="cpu", dtype=torch.float32, _MAMBA_PAD_BLOCK_ID=99,
                             _compact_gdn_group_ids=set(),
                             input_batch=SimpleNamespace(block_table=_BlockTables([_Table(t) for t in tables])))
    runner.prepare_mamba_state_idxs = partial(HPUModelRunner.prepare_mamba_state_idxs, runner)
    return runner


def test_mamba_calls_follow_vllm_gaudis_split(gaudi):
    """A decode, a chunk continuing a prompt and a new prompt crossing a block boundary: the decodes in one
    call, each prompt in its own, padded to whole 64-token chunks, with the states vllm-gaudi's rules name."""
    from vllm_gaudi_unified.vllm_plugin.hpu_mamba import mamba_step

    # two state groups (two Mamba layers' groups), three requests, blocks of 256 tokens
    tables = [[[10, 11, 12], [20, 21, 22], [30, 31, 32]], [[40, 41, 42], [50, 51, 52], [60, 61, 62]]]
    query, context = np.array([64, 1, 300]), np.array([192, 300, 0])
    decode, chunk, fresh = mamba_step(_runner(tables), query, context).calls
    assert decode.rows.tolist() == [64] and decode.padded == 1 and not decode.metadata.is_prompt
    # the decode's state: loaded from block 1 (tokens 256..300 computed) and stored there
    assert decode.metadata.load_indices_tensor.tolist() == [[21], [51]]
    assert decode.metadata.store_indices_tensor.tolist() == [[21], [51]]
    assert chunk.rows.tolist() == list(range(64)) and chunk.padded == 64
    md = chunk.metadata
    assert md.is_prompt and md.prep_initial_states and md.has_initial_states_p.tolist() == [True]
    assert md.load_indices_tensor.tolist() == [[10], [40]] and md.store_indices_tensor.tolist() == [[10], [40]]
    assert md.query_start_loc_p.tolist() == [0, 64] and md.last_chunk_indices_p.tolist() == [0]
    assert md.mamba_chunks_to_block_mapping.tolist() == [[10], [40]]  # its one chunk ends block 0 (token 256)
    assert md.blocks_caching_range.tolist() == [[10, 99], [40, 99]] and md.seqlens_offsets_for_blocks.tolist() == [
        64, 64]
    assert fresh.rows.tolist() == list(range(65, 365)) and fresh.padded == 320
    md = fresh.metadata
    assert not md.prep_initial_states and md.has_initial_states_p.tolist() == [False]
    assert md.padding_mask_flat[:, 0].tolist() == [1.0] * 300 + [0.0] * 20
    assert md.last_chunk_indices_p.tolist() == [4] and md.store_indices_tensor.tolist() == [[31], [61]]
    # chunk 3 ends at token 256 (block 0's state), the last chunk holds block 1's (padding keeps the state)
    assert md.mamba_chunks_to_block_mapping.tolist() == [[99, 99, 99, 30, 31], [99, 99, 99, 60, 61]]
    assert md.blocks_caching_range.tolist() == [[30, 31, 99], [60, 61, 99]]
    assert md.seqlens_offsets_for_blocks.tolist() == [256, 300, 300]  # conv states at 256 and at the end

    no_cache = mamba_step(_runner(tables, caching=False), query, context).calls
    assert no_cache[2].metadata.mamba_chunks_to_block_mapping is None
    assert no_cache[1].metadata.load_indices_tensor.tolist() == [[10], [40]]  # block 0: the one state slot


def test_a_chunk_off_the_chunk_grid_across_a_block_is_refused(gaudi):
    from vllm_gaudi_unified.vllm_plugin.hpu_mamba import mamba_step

    runner = _runner([[[1, 2, 3]]])
    with pytest.raises(NotImplementedError, match="starting at token 200 .* crosses a 256-token block boundary"):
        mamba_step(runner, np.array([100]), np.array([200]))
    assert len(mamba_step(runner, np.array([56]), np.array([200])).calls) == 1  # up to the boundary: served


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    import vllm_hybrid_helpers as M

    root = tmp_path_factory.mktemp("gaudi_hybrid")
    return root, M.make_tiny_granite_hybrid(str(root / "granite"))


def _gaudi(model, out, *args, **env):
    return _run(model, out, "--gaudi-standin", *args, VLLM_PLUGINS=GAUDI_PLUGINS, VLLM_GAUDI_UNIFIED="1", **env)


@pytest.fixture(scope="module")
def engine_runs(granite):
    """Side by side: vLLM's own CPU attention on the long scenario (block 64, prefix caching on) as `ref`; the
    Gaudi path on it with and without prefix caching (`True`, `False`); and a start-up with a bucket plan
    (`"plan"`). Each run: its result (None when it failed) and its log."""
    import vllm_helpers as H

    root, model = granite
    runs = H.concurrently(lambda: _run(model, str(root / "ref.json"), "--block-size", "16", "--long"),
                          lambda: _gaudi(model, str(root / "gaudi_True.json"), "--block-size", "16", "--long"),
                          lambda: _gaudi(model, str(root / "gaudi_False.json"), "--block-size", "16", "--long",
                                         "--no-prefix-caching"),
                          lambda: _gaudi(model, str(root / "plan.json"), VLLM_GAUDI_UNIFIED_BUCKETS="auto"))
    return dict(zip(("ref", True, False, "plan"), runs))


@pytest.fixture(scope="module")
def reference(engine_runs):
    """vLLM's own CPU attention on the long scenario (block 64, prefix caching on)."""
    ref, log = engine_runs["ref"]
    assert ref is not None, log[-3000:]
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("caching", [True, False], ids=["prefix_caching", "no_prefix_caching"])
def test_granite_hybrid_on_gaudi_matches_vllm(engine_runs, reference, caching):
    """With prefix caching (vLLM's 'align' mode: block 256, states cached per block, two prefix hits) and
    without (vllm-gaudi's block 48, one state slot per request)."""
    import vllm_helpers as H

    got, log = engine_runs[caching]
    assert got is not None, log[-3000:]
    assert "2 Mamba2 layers run vllm-gaudi's op" in log and "GAUDI_UNIFIED_HPU_ATTN" in log
    assert "Hybrid model (standard Mamba2 + ATN)" in log  # vllm-gaudi's own hybrid set-up
    assert got["prefix_caching"] == caching and got["chunked_prefill"]
    assert got["block_size"] == (256 if caching else 48)
    worst = H.same_tokens_worst_logprob(got, reference, cases=9)
    assert worst <= LOGPROB_ATOL, worst
    print("granite hybrid, Gaudi path, block", got["block_size"], "max |dlogprob| vs vLLM's CPU attention", worst)


@pytest.mark.slow
def test_a_bucket_plan_for_a_hybrid_is_refused(engine_runs):
    got, log = engine_runs["plan"]
    assert got is None
    assert "a bucket plan (auto) for a model with Mamba2 layers" in log, log[-3000:]
