"""The timeline of one pipeline step (pp_simulate.PipelineStep) as a PNG: one row per stage
with each micro-batch's forward (F) and backward (B) box, coloured by micro-batch and labelled
with its number, the idle time before an action as a hatched bubble or, where the input was
computed but still in flight, a red exposed wait; gather_once's gather as a purple box before
the stage's first forward, and the deferred policies' reductions as strips under the row (they
run on the data-parallel link beside compute). Below, each stage's memory over the step.

The micro-batches cycle through colours that none of those marks uses (no red, orange, purple
or pink), so a reader never takes a wait for work."""
from __future__ import annotations

_IDLE = {"bubble": dict(facecolor="none", edgecolor="0.6", hatch="///"),
         "wait": dict(facecolor="tab:red", edgecolor="none"),
         "G": dict(facecolor="tab:purple", edgecolor="none"),
         "R": dict(facecolor="tab:orange", edgecolor="none")}
_NAMES = ["bubble", "exposed p2p wait", "gather (gather_once)", "reduction (dp link)"]
_LANE = ("R",)  # on the dp link beside compute: a thin strip under the row
# tab10's blue, green, brown, grey, olive and cyan: apart from every _IDLE colour
MICROBATCH_COLOURS = ("tab:blue", "tab:green", "tab:brown", "tab:gray", "tab:olive", "tab:cyan")


def microbatch_colour(i: int) -> str:
    return MICROBATCH_COLOURS[i % len(MICROBATCH_COLOURS)]


def draw_pipeline(path: str | None, step, title: str):
    """Draw ``step``; save to ``path`` (None: return the figure, for tests)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--timeline needs matplotlib: pip install matplotlib") from e
    stages = sorted(step.memory)
    rank_of = {s: r for r, ss in enumerate(step.by_rank_stages) for s in ss}
    fig, (ax, mem) = plt.subplots(2, 1, sharex=True, figsize=(14, 2 + 0.5 * len(stages) + 2.5),
                                  gridspec_kw={"height_ratios": [max(2, len(stages)), 3]})
    row = {s: len(stages) - 1 - i for i, s in enumerate(stages)}  # stage 0 on top
    for b in step.boxes:
        y, x, w = row[b.stage], 1e3 * b.start, 1e3 * (b.end - b.start)
        if b.kind in ("F", "B"):
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=microbatch_colour(b.microbatch),
                           edgecolor="k" if b.kind == "B" else "white", linewidth=0.5,
                           alpha=0.55 if b.kind == "F" else 1.0)
            ax.text(x + w / 2, y, f"{b.kind}{b.microbatch}", ha="center", va="center",
                    fontsize=6, clip_on=True)
        elif b.kind in _LANE:
            ax.broken_barh([(x, w)], (y - 0.48, 0.12), linewidth=0, **_IDLE[b.kind])
        else:
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), linewidth=0.5, **_IDLE[b.kind])
    ax.set_yticks([row[s] for s in stages], [f"stage {s} (rank {rank_of[s]})" for s in stages])
    ax.set_title(f"{title}: step {1e3 * step.step_s:.4g} ms, bubble "
                 f"{step.bubble_fraction:.0%}")
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=microbatch_colour(0), alpha=0.55),
               plt.Rectangle((0, 0), 1, 1, facecolor=microbatch_colour(0), edgecolor="k")]
    handles += [plt.Rectangle((0, 0), 1, 1, **style) for style in _IDLE.values()]
    ax.legend(handles, ["forward", "backward"] + _NAMES, loc="upper right", fontsize=7,
              ncol=7)
    for s in stages:
        times, levels = zip(*step.memory[s], (step.step_s, step.memory[s][-1][1]))
        mem.step([1e3 * t for t in times], [b / 2**30 for b in levels], where="post",
                 label=f"stage {s}")
    mem.set_ylabel("GiB")
    mem.set_xlabel("ms")
    mem.legend(fontsize=6, ncol=min(8, len(stages)), loc="lower center")
    fig.tight_layout()
    if path is None:
        return fig
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
