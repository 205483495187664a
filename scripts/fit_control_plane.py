"""Fit the simulator's control-plane costs to the control-plane scale bench's result.

Reads ``bench/results/control_scale.json`` (``python bench/control_scale.py``), fits the
consensus and the heartbeat's store work with :func:`meshpact.core.control_plane.fit_control_plane`,
prints the fit against every measured point (and a line for each cost the fit misses by more than
``--tolerance`` somewhere), and writes it to ``scenarios/control_plane_fit.json``, the file the
cost model's defaults come from. ``--check`` writes nothing and exits 1 when that file is not the
fit of the result now (a rerun of the bench not yet fitted).

Usage: ``python scripts/fit_control_plane.py [--result FILE] [--out FILE] [--check]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshpact.core.control_plane import ControlPlaneFit, Growth, fit_control_plane

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "bench" / "results" / "control_scale.json"
OUT = ROOT / "scenarios" / "control_plane_fit.json"
TOLERANCE = 0.20  # a fit missing a measured point by more is reported


def text(fit: ControlPlaneFit) -> str:
    """The file's bytes: sorted keys, two-space indents, one newline at the end."""
    return json.dumps(fit.to_dict(), indent=2, sort_keys=True) + "\n"


def table(fit: ControlPlaneFit) -> str:
    lines = ["| cost | form | a | b | ranks | measured | fit | error |", "|---|---|---|---|---|---|---|---|"]
    for name, f in fit.fits().items():
        for p, err in zip(f.points, f.errors()):
            lines.append(
                f"| {name} | {f.growth.formula()} | {f.intercept:.4g} | {f.slope:.4g} | {p.ranks} | "
                f"{p.value:.4g} | {f.at(p.ranks):.4g} | {err:+.1%} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument(
        "--result", type=Path, default=RESULT, help="a bench/control_scale.py result (default: %(default)s)"
    )
    ap.add_argument("--out", type=Path, default=OUT, help="where the fit goes (default: %(default)s)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if --out is not the fit of --result")
    ap.add_argument(
        "--tolerance",
        type=float,
        default=TOLERANCE,
        help="largest relative error allowed at a measured point (default: %(default)s)",
    )
    a = ap.parse_args(argv)
    try:
        doc = json.loads(a.result.read_text())
        name = str(a.result.relative_to(ROOT)) if a.result.is_relative_to(ROOT) else str(a.result)
        fit = fit_control_plane(doc, name)
    except OSError as exc:
        print(
            f"fit_control_plane: cannot read {a.result} ({exc.strerror}); run python bench/control_scale.py",
            file=sys.stderr,
        )
        return 2
    except json.JSONDecodeError as exc:
        print(f"fit_control_plane: {a.result}: not JSON ({exc.msg} at line {exc.lineno})", file=sys.stderr)
        return 2
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        print(
            f"fit_control_plane: {a.result}: not a bench/control_scale.py result ({type(exc).__name__}: {exc})",
            file=sys.stderr,
        )
        return 2
    except ValueError as exc:
        print(f"fit_control_plane: {a.result}: {exc}", file=sys.stderr)
        return 2
    print(table(fit))
    for name, f in fit.fits().items():
        if f.worst_error() > a.tolerance:
            print(
                f"fit_control_plane: {name} misses a measured point by {f.worst_error():.0%} (over "
                f"{a.tolerance:.0%}): no {' or '.join(g.formula() for g in Growth)} follows these points",
                file=sys.stderr,
            )
    if a.check:
        if not a.out.is_file() or a.out.read_text() != text(fit):
            print(
                f"fit_control_plane: {a.out} is not the fit of {a.result}: run python scripts/fit_control_plane.py",
                file=sys.stderr,
            )
            return 1
        return 0
    a.out.write_text(text(fit))
    print(f"wrote {a.out} from {fit.source.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
