"""Pictures of bucket plans: the buckets over a scatter of a trace's steps, and waste-vs-graphs curves."""
from __future__ import annotations

import os

import numpy as np

from vllm_gaudi_unified.bucket_plans.cost import DIMS, SHORT
from vllm_gaudi_unified.files import atomic_write

#: The three panels of `plot_plan`: (x, y) dimensions.
PANELS = (("query_len", "num_unique_blocks"), ("query_len", "num_shared_blocks"), ("query_len", "num_causal_tiles"))


def plot_plan(plan, shapes, path: str, title: str = "") -> None:
    """PNG: for three pairs of dimensions, every step as a dot (colour = phase) and every bucket
    the step pads to as the corner of its rectangle; both axes symlog so decodes and prefills show."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    sizes = np.asarray(shapes.sizes)
    idx = plan.find_all(sizes)
    used = np.unique(idx[idx >= 0])
    fig, axes = plt.subplots(1, len(PANELS), figsize=(6 * len(PANELS), 5.2))
    codes = shapes.codes
    from vllm_gaudi_unified.bucket import PHASES

    colours = plt.get_cmap("tab10")
    for ax, (xd, yd) in zip(axes, PANELS):
        xi, yi = DIMS.index(xd), DIMS.index(yd)
        for code in np.unique(codes):
            m = codes == code
            ax.scatter(sizes[m, xi] + 0.5, sizes[m, yi] + 0.5, s=4, alpha=0.35, color=colours(int(code)),
                       label=f"{PHASES[code]} ({m.sum()} steps)")
        for i, b in enumerate(plan.sizes):
            lw, alpha = (1.2, 0.9) if i in used else (0.6, 0.3)
            ax.add_patch(Rectangle((0.5, 0.5), b[xi], b[yi], fill=False, lw=lw, alpha=alpha, color="black"))
        ax.set_xscale("symlog", linthresh=1)
        ax.set_yscale("symlog", linthresh=1)
        ax.set_xlabel(SHORT[xd] + f" ({xd})")
        ax.set_ylabel(SHORT[yd] + f" ({yd})")
        ax.grid(alpha=0.2)
    axes[0].legend(fontsize=7, markerscale=3, loc="upper left")
    fig.suptitle(title or f"{plan.strategy} plan: {len(plan)} buckets ({len(used)} used by this trace); "
                 "dots: steps, boxes: buckets (bold: used)", fontsize=10)
    fig.tight_layout()
    with atomic_write(path, binary=True) as f:  # whole or not at all
        fig.savefig(f, dpi=110, format=_format(fig, path))
    plt.close(fig)


def plot_curves(curves: dict, path: str, title: str = "", styles: dict | None = None,
                hlines: dict | None = None, zoom: tuple | None = None) -> None:
    """PNG: padding waste against number of graphs, one line per (strategy, trace).

    `curves`: label -> list of (graphs, waste); `styles`: label -> matplotlib keyword arguments
    (default: circles for labels with 'trace', squares otherwise); `hlines`: label -> waste of a
    dotted reference line (e.g. a goal); `zoom`: (low, high) waste of a second, linear panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    panels = 2 if zoom else 1
    fig, axes = plt.subplots(1, panels, figsize=(8.5 if panels == 1 else 14, 5.5), squeeze=False)
    top = max((p[1] for pts in curves.values() for p in pts), default=2.0)
    for i, ax in enumerate(axes[0]):
        for label, pts in curves.items():
            pts = sorted(pts)
            if i == 1:
                pts = [p for p in pts if p[1] <= zoom[1] * 1.2]
            style = (styles or {}).get(label) or {"marker": "o" if "trace" in label else "s",
                                                  "ls": "-" if "trace" in label else "--"}
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, ms=4, **style)
        for label, y in (hlines or {}).items():
            ax.axhline(y, color="grey", ls=":", lw=1)
            ax.annotate(label, (1, y), xycoords=("axes fraction", "data"), ha="right", va="bottom", fontsize=8,
                        color="grey")
        ax.set_xscale("log")
        if i == 0:
            ax.set_yscale("log")  # waste runs from ~1.1 to ~6: keep the low end readable
            ticks = [t for t in (1.0, 1.1, 1.2, 1.3, 1.5, 2, 3, 4, 6, 8) if t <= top * 1.05]
            ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.legend(fontsize=7)
        else:
            ax.set_ylim(*zoom)
            ax.set_title(f"zoom: waste {zoom[0]:g} to {zoom[1]:g}", fontsize=9)
        ax.set_xlabel("graphs (buckets) to warm up")
        ax.set_ylabel("padding waste (padded work / real work)")
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with atomic_write(path, binary=True) as f:
        fig.savefig(f, dpi=100, format=_format(fig, path))
    plt.close(fig)


def _format(fig, path: str) -> str:
    """The image format the file name asks for (its extension), PNG when it names none matplotlib knows."""
    ext = os.path.splitext(path)[1][1:].lower()
    return ext if ext in fig.canvas.get_supported_filetypes() else "png"
