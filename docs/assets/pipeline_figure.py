"""Draw docs/assets/pipeline.png, the picture of what oal does (README and the site's home page).

    .venv/bin/python docs/assets/pipeline_figure.py
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from oal.rundir.files import atomic_save_figure

STAGES = [
    ("pretrained\ncausal LM", "softmax attention,\nO(N) KV cache"),
    ("analyze", "contribution scores\n(Eq. 2), stable-gap\ngroups (App. B)"),
    ("calibrate", "factor L per head\nby output matching\n(Eq. 20)"),
    ("convert", "swap the chosen\nlayers' attention\n(oal, oal-swa)"),
    ("adapt", "LoRA and the\nkernel jointly\n(App. F.2)"),
    ("linear-time\nmodel", "O(1) state per layer;\nsaves and reloads\nwith transformers"),
]
KERNEL = r"$\kappa(q,k) = \epsilon + \| L^\top [1, s_1, \dots, s_G] \|^2,\quad s_g = \sum_{r \in g} q_r k_r / \sqrt{d}$"


def main(path: Path = Path(__file__).with_name("pipeline.png")) -> None:
    fig, ax = plt.subplots(figsize=(12, 3.0))
    ax.set_xlim(0, len(STAGES) * 2)
    ax.set_ylim(0, 2.9)
    ax.axis("off")
    for i, (title, body) in enumerate(STAGES):
        x = i * 2 + 0.1
        ends = i in (0, len(STAGES) - 1)
        color = "#e8eaf6" if ends else "#e0f2f1"
        ax.add_patch(FancyBboxPatch((x, 0.95), 1.7, 1.75, boxstyle="round,pad=0.02,rounding_size=0.12",
                                    fc=color, ec="#37474f", lw=1.2))
        ax.text(x + 0.85, 2.3, title, ha="center", va="center", fontsize=11, weight="bold")
        ax.text(x + 0.85, 1.45, body, ha="center", va="center", fontsize=8.2)
        if i < len(STAGES) - 1:
            ax.add_patch(FancyArrowPatch((x + 1.72, 1.82), (x + 2.08, 1.82), arrowstyle="-|>", mutation_scale=14,
                                         lw=1.3, color="#37474f"))
    ax.text(len(STAGES), 0.45, "OAL's kernel, positive by construction, evaluated exactly through prefix states: "
            + KERNEL, ha="center", va="center", fontsize=10)
    atomic_save_figure(fig, path, dpi=110, bbox_inches="tight")  # temp name + rename, and closed


if __name__ == "__main__":
    main()
