"""What a benchmark does with its result once measured: the JSON file, and the PNG beside it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable


def parse(ap, default_out: Path | Callable, plot: Callable[[dict, Path], None]):
    """``ap``'s arguments with ``--out`` (default ``default_out``, or ``default_out(args)``) and
    ``--plot-only`` added: (args, out), or None when ``--plot-only`` redrew the PNG of the saved
    JSON (nothing to run)."""
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    out = Path(args.out) if args.out else Path(default_out(args) if callable(default_out) else default_out)
    if args.plot_only:
        plot(json.loads(out.read_text()), out.with_suffix(".png"))
        return None
    return args, out


def save(result: dict, out: Path, plot: Callable[[dict, Path], None]) -> None:
    """Write ``result`` to ``out`` (JSON), then draw ``plot(result, out.with_suffix(".png"))``.
    Where matplotlib is missing (a bare GPU machine) the measured JSON is kept and the line says
    how to redraw the plot (the bench's ``--plot-only``) instead of failing after the run."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    try:
        plot(result, out.with_suffix(".png"))
    except ImportError as exc:
        print(f"no plot ({exc}); redraw with --plot-only where matplotlib is installed")


def bars(path: Path, sides, values, ylabel: str, title: str) -> None:
    """Two (or more) sides of a comparison as bars, the new side first in green."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(list(sides), list(values), color=["tab:green", *["tab:gray"] * (len(values) - 1)])
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def setting_bars(ax, cases: list, settings: list, value: Callable) -> None:
    """Bars of ``value(setting, case)``, one per setting side by side over each case (x = case index)."""
    width = 0.8 / len(settings)
    for i, s in enumerate(settings):
        ax.bar([c + (i - (len(settings) - 1) / 2) * width for c in range(len(cases))],
               [value(s, case) for case in cases], width, label=s)


def finish_cpu_plot(fig, ax, result: dict, title: str, path: Path) -> None:
    """A CPU bench's plot finished: ``title``, the run's label, the CPU model and the kernel's
    threads above it, the legend, saved to ``path``."""
    hw = result["hardware"]
    ax.set_title(f"{title}: {result['label']}\n{hw['cpu_model']}, {result['threads']} threads", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(ap, default_out: Path | Callable, run: Callable, plot: Callable[[dict, Path], None]) -> None:
    """A bench's command line: ``ap``'s arguments (``parse``), then ``run(args)``'s result saved
    (``save``) and its path printed; with ``--plot-only`` the saved result's plot redrawn."""
    parsed = parse(ap, default_out, plot)
    if parsed is None:
        return
    args, out = parsed
    save(run(args), out, plot)
    print(f"wrote {out}")
