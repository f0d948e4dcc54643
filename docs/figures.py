"""Draw docs/img/seed_masks.png: which path computes each (query token, key) pair of the seed example.

Made from the planner's own arrays (not drawn by hand), so the picture is a check too:
    python docs/figures.py
"""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap

from vllm_gaudi_unified import PlanOptions, plan_step

QUERY_LENS, CONTEXT_LENS, BS = [8, 4, 1, 1], [0, 4, 6, 4], 4
TABLE = np.array([[1, 2, 3, -1], [4, 5, -1, -1], [6, 7, -1, -1], [4, 8, -1, -1]])
OPTIONS = PlanOptions(causal_tile=4, shared_rows=4, shared_tile_keys=8, unique_layout="slice")
NUM_CACHE_BLOCKS = 9


def path_grid(plan):
    """[tokens, cache slots + new tokens] with 0 unseen, 1 causal (2 self), 3 shared, 4 unique."""
    t = plan.num_tokens
    grid = np.zeros((t, NUM_CACHE_BLOCKS * BS + t), int)
    new = NUM_CACHE_BLOCKS * BS
    grid[np.arange(t), new + np.arange(t)] = 2
    for q0, k0 in zip(plan.causal_q_start, plan.causal_k_start):
        for r in range(q0, min(q0 + OPTIONS.causal_tile, t)):
            for k in range(k0, min(k0 + OPTIONS.causal_tile, t)):
                if plan.token_seg_start[r] <= k < r:
                    grid[r, new + k] = 1
    for rows, blocks, lo, hi in zip(plan.shared_rows, plan.shared_blocks, plan.shared_lo, plan.shared_hi):
        for i, r in enumerate(rows):
            for j, b in enumerate(blocks):
                if r < t:
                    grid[r, b * BS + lo[i, j]: b * BS + hi[i, j]] = 3
    for b, (r, lo, hi) in enumerate(zip(plan.unique_rows, plan.unique_lo, plan.unique_hi)):
        if r < t:
            grid[r, b * BS + lo: b * BS + hi] = 4
    return grid


def main():
    plan = plan_step(QUERY_LENS, CONTEXT_LENS, TABLE, BS, options=OPTIONS)
    grid = path_grid(plan)
    cmap = ListedColormap(["#f2f2f2", "#4c72b0", "#1f3d7a", "#dd8452", "#55a868"])
    fig, ax = plt.subplots(figsize=(11, 4.2))
    ax.imshow(grid, cmap=cmap, vmin=0, vmax=4, aspect="auto", interpolation="nearest")
    new = NUM_CACHE_BLOCKS * BS
    for x in range(0, new + 1, BS):
        ax.axvline(x - 0.5, color="white", lw=1.5)
    for y in np.cumsum(QUERY_LENS)[:-1]:
        ax.axhline(y - 0.5, color="black", lw=0.8)
        ax.axvline(new + y - 0.5, color="black", lw=0.8)
    ax.axvline(new - 0.5, color="black", lw=2)
    ax.set_xticks([b * BS + 1.5 for b in range(NUM_CACHE_BLOCKS)] + [new + t for t in range(plan.num_tokens)])
    ax.set_xticklabels([f"blk {b}" for b in range(NUM_CACHE_BLOCKS)] + [str(t) for t in range(plan.num_tokens)],
                       fontsize=7, rotation=90)
    ax.set_yticks(range(plan.num_tokens))
    ax.set_yticklabels([f"r{r} t{j}" for r, n in enumerate(QUERY_LENS) for j in range(n)], fontsize=7)
    ax.set_xlabel("keys: KV cache slots by physical block (left)  |  new tokens of the step (right)")
    ax.set_ylabel("query tokens")
    ax.set_title(f"Seed example, phase {plan.shape.phase}: query lens {QUERY_LENS}, context lens {CONTEXT_LENS}, "
                 f"block size {BS}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=cmap(i)) for i in range(1, 5)]
    ax.legend(handles, ["causal tile", "self (own key)", "shared tile", "unique block"], loc="lower left",
              fontsize=8, ncol=4, bbox_to_anchor=(0, -0.42))
    fig.tight_layout()
    out = Path(__file__).parent / "img" / "seed_masks.png"
    fig.savefig(out, dpi=130)
    print(out)


if __name__ == "__main__":
    main()
