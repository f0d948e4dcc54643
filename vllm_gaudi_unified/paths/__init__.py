"""The device side of a step (torch): partial softmax results per path, merged by `merge.py`.

- `tiles`: `attend` (a masked score tile -> `Partial`; `attend_heads`, the shared tiles' form), `slot_mask`,
  `compute_dtype`;
- `causal`: `self_partial` (each token with its own key) and the strict-causal tiles;
- `shared`: cache blocks several query tokens read, in (tokens x blocks) tiles;
- `unique`: cache blocks one query token reads, one row per block;
- `invariant`: the batch-invariant mode's run: the route choice, and the torch route (fixed shapes, slots
  folded in a fixed tree); `invariant_fast`: its CUDA route (flash per request, Triton with position-fixed splits);
  `mla_invariant`: its MLA decodes (`route`: the MLA kernel with position-fixed splits on CUDA, else
  `mla_invariant_torch`: the default's chunk layout over fixed chunks).
"""
