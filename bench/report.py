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


def main(ap, default_out: Path | Callable, run: Callable, plot: Callable[[dict, Path], None]) -> None:
    """A bench's command line: ``ap``'s arguments (``parse``), then ``run(args)``'s result saved
    (``save``) and its path printed; with ``--plot-only`` the saved result's plot redrawn."""
    parsed = parse(ap, default_out, plot)
    if parsed is None:
        return
    args, out = parsed
    save(run(args), out, plot)
    print(f"wrote {out}")
