"""Load-test plots: matplotlib PNGs (Agg backend) of a suite's results."""

from __future__ import annotations

import os

import numpy as np

from mox.bench.loadtest.results_schema import Suite

MiB = 2**20


def plot_suite(suite: Suite, out: str) -> list[str]:
    """TTFT and TPOT CDFs per policy; expert bytes read per second per policy; resident
    expert bytes and request rate per model over time (one panel per policy). PNGs with the
    Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [p for p in suite.policies if p.error is None]
    paths = []
    for field, label, name in (("ttft_s", "time to first token (s)", "ttft"),
                               ("tpot_s", "time per output token (s)", "tpot")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for p in ok:
            values = np.sort([v for r in p.requests if (v := getattr(r, field)) is not None])
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post",
                        label=p.policy)
        ax.set(xscale="log", xlabel=label, ylabel="share of requests",
               title=f"{name.upper()} CDF ({suite.name} routing)")
        ax.grid(alpha=0.3)
        ax.legend()
        paths.append(_save(fig, out, f"{suite.name}-{name}-cdf.png"))
    fig, ax = plt.subplots(figsize=(8, 4))
    for p in ok:
        t = np.array([point.t_s for point in p.timeline])
        read = np.array([point.bytes_read for point in p.timeline])
        if len(t) > 1:
            ax.plot(t[1:], np.diff(read) / np.maximum(np.diff(t), 1e-9) / MiB, label=p.policy,
                    linewidth=1)
    ax.set(xlabel="seconds since the replay started", ylabel="expert MiB read per second",
           title=f"expert bytes read per second ({suite.name} routing)")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out, f"{suite.name}-bytes-read.png"))
    for key, label, scale in (("resident_bytes", "resident expert MiB", MiB),
                              ("request_rate", "request rate (req/s)", 1.0)):
        fig, axes = plt.subplots(len(ok), 1, figsize=(8, 2.2 * max(1, len(ok))), sharex=True,
                                 squeeze=False)
        for ax, p in zip(axes[:, 0], ok):
            t = [point.t_s for point in p.timeline]
            for model in suite.models:
                ax.plot(t, [getattr(point, key)[model] / scale for point in p.timeline],
                        label=model, linewidth=1)
            ax.set(ylabel=label if len(ok) == 1 else "", title=p.policy)
            ax.grid(alpha=0.3)
        axes[-1, 0].set_xlabel("seconds since the replay started")
        axes[0, 0].legend(fontsize=6, ncol=4, loc="upper right")
        fig.suptitle(f"{label} per model ({suite.name} routing)")
        paths.append(_save(fig, out, f"{suite.name}-{key.replace('_', '-')}.png"))
    return paths


def _save(fig, out: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
