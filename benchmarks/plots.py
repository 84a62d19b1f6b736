"""PNG plots of a harness result: output throughput against concurrency, and latency CDFs."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _servers(result: dict) -> list[dict]:
    return [s for s in result["servers"] if not s.get("skip_reason") and s["scenarios"]]


def throughput_plot(result: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for server in _servers(result):
        points = sorted((s["concurrency"], s["output_throughput"]) for s in server["scenarios"]
                        if s["mode"] == "concurrency")
        if points:
            ax.plot(*zip(*points), marker="o", label=server["name"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (clients)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Output throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cdf_plot(result: dict, path: Path) -> None:
    """TTFT, ITL and end-to-end latency CDFs, one line per server and concurrency level."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    for i, server in enumerate(_servers(result)):  # a colour per server, a line style per level
        levels = [label for label in server.get("latencies", {}) if label.startswith("c=")]
        for j, label in enumerate(levels):
            lat = server["latencies"][label]
            for ax, key in zip(axes, ("ttft_ms", "itl_ms", "e2e_ms")):
                values = sorted(lat.get(key) or [])
                if values:
                    ax.step(values, [(k + 1) / len(values) for k in range(len(values))], where="post",
                            color=colors[i % len(colors)], linestyle=styles[j % len(styles)],
                            label=f"{server['name']} {label}")
    for ax, title in zip(axes, ("TTFT", "inter-token latency", "end-to-end latency")):
        ax.set_xscale("log")
        ax.set_xlabel("ms (log)")
        ax.set_ylabel("fraction of requests" if title != "inter-token latency" else "fraction of gaps")
        ax.set_title(f"{title} CDF")
        ax.grid(True, alpha=0.3)
    legend = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), fontsize=7, loc="center right")
    fig.subplots_adjust(left=0.05, right=0.86, wspace=0.25, bottom=0.12)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(result: dict, stem: Path) -> list[str]:
    """Writes <stem>-throughput.png and <stem>-latency-cdf.png; returns their paths."""
    paths = [Path(f"{stem}-throughput.png"), Path(f"{stem}-latency-cdf.png")]
    throughput_plot(result, paths[0])
    cdf_plot(result, paths[1])
    return [str(p) for p in paths]
