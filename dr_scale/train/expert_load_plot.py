"""expert_load.png: a mixture of experts' load by layer over the logged steps, from
metrics.jsonl's `expert_load` (per layer, the busiest expert's assignments over the mean: 1 is
balanced, the number of experts is one expert taking everything)."""
from dr_scale.train.plot import plot_records


def plot_expert_load(run_dir):
    """The picture beside metrics.jsonl, or None for a run without experts."""
    return plot_records(run_dir, "expert_load.png", draw_expert_load)


def draw_expert_load(recs, title=""):
    """A heat map, layers down and logged steps across (its image's array: layers x steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    logged = [r for r in recs if "expert_load" in r]
    if not logged:
        return None
    load = np.array([r["expert_load"] for r in logged]).T  # layers x steps
    steps = [r["step"] for r in logged]
    fig, ax = plt.subplots(figsize=(min(14, 4 + 0.15 * len(steps)), 1.5 + 0.3 * len(load)))
    image = ax.imshow(load, aspect="auto", cmap="magma", interpolation="nearest", vmin=1.0,
                      extent=(steps[0] - 0.5, steps[-1] + 0.5, len(load) - 0.5, -0.5))
    ax.set(xlabel="step", ylabel="layer", title="Expert load: busiest expert / mean")
    fig.colorbar(image, ax=ax)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
