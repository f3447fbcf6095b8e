"""B6: the communication model of one accumulation window
(``tools/comm_model.py``), projected for each hardware.

Run: ``python benchmarks/comm_model.py`` prints the projected tables; with
``make bench`` (``run_all.py``) it also writes ``docs/comm_model_table.md``,
``docs/comm_exposed_table.md`` and ``docs/_static/comm_exposed.png``. The
model's bytes are checked against the HLO census of compiled steps on 8 CPU
devices by ``tests/repo/test_comm_model.py``.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from tools.comm_model import (  # noqa: E402
    DECODERS,
    EXPOSED_SETTINGS,
    EXPOSED_WINDOWS,
    HARDWARE,
    SCHEDULES,
    SIZES,
    exposed,
    exposed_markdown,
    markdown,
    slice_mesh,
    table,
    window_cost,
)


def exposed_plot(path: str) -> None:
    """Bars of the exposed share of the step per schedule, one group per
    decoder, setting and k, written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, shares = [], {s: [] for s in SCHEDULES}
    for size in DECODERS:
        for _, per_node, nodes in EXPOSED_SETTINGS:
            for k in EXPOSED_WINDOWS:
                e = exposed(size, per_node, nodes, k)
                labels.append(f"{size}, {per_node * nodes} GPUs, k={k}")
                for s in SCHEDULES:
                    shares[s].append(100 * e[s] / (e["compute"] + e[s]))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.27
    for i, s in enumerate(SCHEDULES):
        xs = [j + (i - 1) * width for j in range(len(labels))]
        ax.bar(xs, shares[s], width, label=s)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_ylabel("exposed collectives, % of step")
    ax.set_title("FSDP collectives left exposed per step (modelled)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(tiny: bool = False) -> dict:
    """Writes ``docs/comm_model_table.md`` (not with ``tiny``: a smoke run
    leaves the docs alone); returns the TPU v5p table."""
    if not tiny:
        docs = os.path.join(HERE, "..", "docs")
        with open(os.path.join(docs, "comm_model_table.md"), "w") as f:
            f.write(markdown())
        with open(os.path.join(docs, "comm_exposed_table.md"), "w") as f:
            f.write(exposed_markdown())
        exposed_plot(os.path.join(docs, "_static", "comm_exposed.png"))
    hw = HARDWARE["tpu-v5p"]
    headers, rows = table(hw)
    n, mesh = SIZES["8B"], slice_mesh(16, hw)
    naive = window_cost(n, mesh, 8, "naive", hw)
    deferred = window_cost(n, mesh, 8, "deferred", hw)
    shard = window_cost(n, mesh, 8, "shard_update", hw)
    return {
        "name": "B6",
        "title": "B6: communication model, projected per window (TPU v5p)",
        "headers": headers,
        "rows": rows,
        "ratios": {},
        "targets": [],
        "notes": [
            "8B params, 16 slices of 256 v5p chips, k=8: DCN bytes per "
            f"window {naive['slow_bytes'] / deferred['slow_bytes']:.0f}x "
            "less deferred than naive; optimizer state per device "
            f"{naive['optimizer'] / shard['optimizer']:.0f}x less with "
            "shard_update.",
            "All tables: docs/comm_model_table.md; assumptions: "
            "docs/scaling.md, 'Communication model'.",
        ],
    }


if __name__ == "__main__":
    print(markdown())
