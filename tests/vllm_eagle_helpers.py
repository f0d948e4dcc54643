"""Tiny EAGLE draft heads built offline for a `vllm_helpers.make_tiny_llama` target.

vLLM loads a directory whose config is a one-layer `LlamaForCausalLM` as an EAGLE head
(`EagleLlamaForCausalLM`: `fc` over [token embedding, target hidden state], one decoder
layer without its input norm, the target's embeddings and LM head shared). Random weights
would never agree with the target, so the head is built to nearly pass the target's last
hidden state through: `fc` = [0 | I] plus noise, the layer's output projections scaled down.
Its draft is then close to "the target's last prediction again", which a random-weight
target's greedy continuation (it soon repeats tokens) accepts at some positions and rejects
at others: drafts are both accepted and rolled back.
"""
from __future__ import annotations

import json
import os


def make_eagle_head(target: str, path: str, noise: float = 0.02, layer_scale: float = 0.05, seed: int = 11) -> str:
    """Save an EAGLE head for `target` (a float32 Llama directory) to `path`; returns `path`."""
    import torch
    from safetensors.torch import load_file, save_file

    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    weights = load_file(os.path.join(target, "model.safetensors"))
    hidden = config["hidden_size"]
    last = config["num_hidden_layers"] - 1
    gen = torch.Generator().manual_seed(seed)
    head = {"fc.weight": torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
            + torch.randn(hidden, 2 * hidden, generator=gen) * noise}
    prefix = f"model.layers.{last}."
    for name, w in weights.items():
        if not name.startswith(prefix) or "input_layernorm" in name:  # vLLM's EAGLE layer 0 has no input norm
            continue
        w = w.clone()
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w *= layer_scale
        head["layers.0." + name[len(prefix):]] = w.contiguous()
    os.makedirs(path, exist_ok=True)
    save_file(head, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "num_hidden_layers": 1}, f)
    return path
