"""curves.png: train/held-out loss, and throughput, against step (from metrics.jsonl)."""
from pathlib import Path

from dr_scale.train.metrics import read_metrics


def plot_curves(run_dir) -> Path:
    return plot_records(run_dir, "curves.png", draw_curves)


def plot_records(run_dir, file_name: str, draw):
    """`draw(records, title)`'s figure of the run's metrics.jsonl saved as `file_name` in the run
    folder; None where `draw` has nothing to show."""
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    fig = draw(read_metrics(run_dir / "metrics.jsonl"), title=run_dir.name)
    if fig is None:
        return None
    out = run_dir / file_name
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def draw_curves(recs, title=""):
    """The figure: axes[0] train loss (line 0) and held-out loss (line 1), axes[1] tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "eval_loss" in r]
    fig, (ax_loss, ax_tput) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-",
                     label="held-out")
    ax_loss.set(xlabel="step", ylabel="loss", title="Loss")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    if train:
        ax_tput.plot([r["step"] for r in train], [r["tokens_per_s"] for r in train])
    ax_tput.set(xlabel="step", ylabel="tokens/s (all ranks)", title="Throughput")
    ax_tput.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
