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


#: EAGLE3's target: vLLM's default auxiliary layers for L layers are (2, L // 2, L - 3), distinct from 7 on.
EAGLE3_TARGET_LAYERS = 7


def make_eagle3_pair(root: str, model_kwargs: dict, noise: float = 0.02, layer_scale: float = 0.05,
                     seed: int = 13) -> tuple[str, str]:
    """A 7-layer target whose last three layers barely change the residual stream (output projections
    scaled by `layer_scale`), and an EAGLE3 head (`Eagle3LlamaForCausalLM`) for it: `fc` picks the last
    auxiliary state (the stream before layer 4, so nearly the target's final one), its layer (input
    [embedding, hidden], 2H wide) scaled down the same way, its own norm and the target's LM head.
    Returns (target directory, head directory)."""
    import torch
    from safetensors.torch import load_file, save_file

    import vllm_helpers as H

    target = H.make_tiny_llama(os.path.join(root, "target3"), layers=EAGLE3_TARGET_LAYERS, **model_kwargs)
    weights = load_file(os.path.join(target, "model.safetensors"))
    for i in range(EAGLE3_TARGET_LAYERS - 3, EAGLE3_TARGET_LAYERS):
        for proj in ("self_attn.o_proj", "mlp.down_proj"):
            weights[f"model.layers.{i}.{proj}.weight"] *= layer_scale
    save_file(weights, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    hidden = config["hidden_size"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=noise):
        return torch.randn(*shape, generator=gen) * scale

    eye = torch.eye(hidden)
    layer = {name[len("model.layers.0."):]: w.clone() for name, w in weights.items() if name.startswith("model.layers.0.")}
    for proj in ("q_proj", "k_proj", "v_proj"):  # [embedding, hidden] in: the hidden half carries the weights
        w = layer.pop(f"self_attn.{proj}.weight")
        layer[f"self_attn.{proj}.weight"] = torch.cat([rand(*w.shape), w], dim=1)
    for proj in ("self_attn.o_proj", "mlp.down_proj"):
        layer[f"{proj}.weight"] *= layer_scale
    layer["hidden_norm.weight"] = torch.ones(hidden)
    head = {f"layers.0.{k}": v.contiguous() for k, v in layer.items()}
    head["fc.weight"] = torch.cat([rand(hidden, 2 * hidden), eye + rand(hidden, hidden)], dim=1)
    head["norm.weight"] = weights["model.norm.weight"].clone()
    head["lm_head.weight"] = weights["lm_head.weight"].clone()
    path = os.path.join(root, "eagle3")
    os.makedirs(path, exist_ok=True)
    save_file(head, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "num_hidden_layers": 1, "target_hidden_size": hidden}, f)
    return target, path
