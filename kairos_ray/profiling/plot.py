"""Predicted against measured step time, the picture behind a fit's MAPE (PNG)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kairos_ray.core import StepLatencyModel
from kairos_ray.profiling.fit import ProfileTable


def plot_fit(table: ProfileTable, model: StepLatencyModel, path: Path, mape: float) -> Path:
    """Scatter of every measured step against the model's prediction, coloured by chunk size."""
    predicted = table.design(model.tile_tokens) @ model.coefficients
    fig, ax = plt.subplots(figsize=(5, 5))
    points = ax.scatter(1000 * table.step_s, 1000 * predicted, c=table.chunk_tokens, cmap="viridis", s=14)
    top = 1000 * max(float(table.step_s.max()), float(predicted.max())) * 1.05
    ax.plot([0, top], [0, top], "k--", linewidth=1, label="predicted = measured")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("predicted step (ms)")
    ax.set_title(f"T_step fit: held-out MAPE {100 * mape:.1f} %", fontsize=10)
    fig.colorbar(points, ax=ax, label="chunk tokens")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
