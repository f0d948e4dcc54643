"""vllm-gaudi's worker, building the unified model runner.

`HPUWorker.init_device` constructs `HPUModelRunner` by name, with no hook to
choose another class, so `init_device` is the one method redone here (the same
steps, with `UnifiedHpuModelRunner`). Everything else (memory profiling with
the backend's KV-cache shape, cache allocation, execute/sample, sleep) is
vllm-gaudi's.
"""
from __future__ import annotations

import torch
from vllm.config import set_current_vllm_config
from vllm.utils.torch_utils import set_random_seed
from vllm_gaudi.v1.worker.hpu_worker import _QUANT_CONFIG_UNCHANGED, HPUWorker, init_worker_distributed_environment

from vllm_gaudi_unified.vllm_plugin.hpu_runner import UnifiedHpuModelRunner


class UnifiedHpuWorker(HPUWorker):
    def init_device(self):
        self.device = torch.device("hpu")
        init_worker_distributed_environment(self.vllm_config, self.rank, self.distributed_init_method, self.local_rank)
        set_random_seed(self.model_config.seed)
        with set_current_vllm_config(self.vllm_config):
            self.model_runner = UnifiedHpuModelRunner(vllm_config=self.vllm_config,
                                                      is_driver_worker=self.is_driver_worker)
        self.init_profiler()

    def load_model(self, vllm_config=None, quant_config_path=_QUANT_CONFIG_UNCHANGED) -> None:
        if vllm_config is not None:
            # vllm-gaudi's multi-model reconfiguration builds a plain HPUModelRunner by name.
            raise NotImplementedError("reloading another model into a running worker (vllm-gaudi's multi-model "
                                      "mode) is not supported with unified attention")
        super().load_model(quant_config_path=quant_config_path)
