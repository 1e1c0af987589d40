"""Draw docs/img/layout.svg: how a global batch and the ranks are laid out for S stages,
R replicas and M microbatches (the figure of docs/concepts.md).

    python scripts/draw_layout.py [--output docs/img/layout.svg]

The SVG is reproducible (no date, fixed ids), so tests/house/test_docs.py can check that the
checked-in file is what this script draws.
"""

import argparse
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

S, R, M = 2, 2, 4
COLORS = ["#4c72b0", "#dd8452"]          # one per replica
STAGE_FILL = ["#e8eef7", "#fbeee4"]


def arrow(ax, start, end, text=None, style="-|>", color="black", dashed=False, offset=(0, 0.12)):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=12, color=color,
                                 linestyle="--" if dashed else "-", linewidth=1.2))
    if text:
        ax.text((start[0] + end[0]) / 2 + offset[0], (start[1] + end[1]) / 2 + offset[1], text,
                ha="center", va="bottom", fontsize=8, color=color)


def draw(path):
    plt.rcParams["svg.hashsalt"] = "hyparflow-layout"
    plt.rcParams["svg.fonttype"] = "none"     # text stays text: smaller, searchable
    fig, ax = plt.subplots(figsize=(9, 5.2))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 6.4)
    ax.axis("off")

    # The global batch: R contiguous slices, each cut into M contiguous microbatches.
    left, width, top = 0.5, 9.0, 5.6
    ax.text(5, 6.15, f"global batch (batch_size samples, as in model.fit): R = {R} slices x "
            f"M = {M} microbatches", ha="center", fontsize=10)
    cell = width / (R * M)
    for r in range(R):
        for m in range(M):
            x = left + (r * M + m) * cell
            ax.add_patch(Rectangle((x, top), cell, 0.35, facecolor=COLORS[r], alpha=0.35 + 0.15 * m,
                                   edgecolor="white"))
            ax.text(x + cell / 2, top + 0.17, f"mb {m}", ha="center", va="center", fontsize=8)
        ax.text(left + (r + 0.5) * M * cell, top - 0.22, f"replica {r}'s slice (its ranks are "
                f"framed in this colour)", ha="center", fontsize=9, color=COLORS[r])

    # The ranks: rank = replica * S + stage; each replica is a pipeline of S stages.
    box_w, box_h = 2.6, 0.9
    xs = [1.2, 6.2]
    ys = [3.5, 1.3]
    for r in range(R):
        y = ys[r]
        for s in range(S):
            x = xs[s]
            ax.add_patch(Rectangle((x, y), box_w, box_h, facecolor=STAGE_FILL[s],
                                   edgecolor=COLORS[r], linewidth=2))
            ax.text(x + box_w / 2, y + box_h / 2 + 0.15, f"rank {r * S + s}", ha="center",
                    va="center", fontsize=10, weight="bold")
            ax.text(x + box_w / 2, y + box_h / 2 - 0.2, f"stage {s} of replica {r}",
                    ha="center", va="center", fontsize=8)
        arrow(ax, (xs[0] + box_w, y + 0.62), (xs[1], y + 0.62), "activations, per microbatch")
        arrow(ax, (xs[1], y + 0.28), (xs[0] + box_w, y + 0.28), "gradients", offset=(0, -0.3))
    for s in range(S):
        x = xs[s] + box_w / 2
        arrow(ax, (x, ys[0] - 0.05), (x, ys[1] + box_h + 0.05), style="<|-|>", dashed=True,
              color="#55a868")
        ax.text(x + 0.1, (ys[0] + ys[1] + box_h) / 2, f"allreduce of stage {s}'s\n"
                "gradients, once per step", fontsize=8, color="#55a868", va="center")
    ax.text(5, 0.55, "S = 2 stages x R = 2 replicas = 4 ranks (mpiexec -n 4); with T tensor "
            "ranks per stage, S x T x R", ha="center", fontsize=9)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--output", default=os.path.join(here, "docs", "img", "layout.svg"))
    draw(parser.parse_args().output)
