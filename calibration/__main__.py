"""``python -m calibration``: fit the cost model, write ``conf/cost/*.yaml`` and the fidelity report."""

from __future__ import annotations

import argparse

from calibration.files import write_cost_files
from calibration.pipeline import HARDWARE, MODELS, TENSOR_PARALLEL, calibrate
from calibration.report import markdown, plot, summary
from chunkgym import data_root, resolve_path
from envs.serving.cost_model import COST_DIR

DEFAULT_REPORT_DIR = "reports/calibration"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m calibration", description=__doc__)
    parser.add_argument(
        "--data-root", default=None, help="data folder (default: $CHUNKGYM_DATA or ../shared/data)"
    )
    parser.add_argument(
        "--out-dir", default=str(COST_DIR), help="where coefficient files go (default: conf/cost)"
    )
    parser.add_argument("--report-dir", default=DEFAULT_REPORT_DIR, help="fidelity.md and the plot go here")
    parser.add_argument("--no-report", action="store_true", help="write coefficient files only")
    parser.add_argument("--hardware", nargs="+", default=list(HARDWARE), help="conf/hardware names")
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="conf/model names")
    parser.add_argument(
        "--tp", nargs="+", type=int, default=list(TENSOR_PARALLEL), help="tensor-parallel degrees"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    root = data_root(args.data_root)
    cal = calibrate(root, args.hardware, args.models, args.tp)
    written = write_cost_files(cal.files, resolve_path(args.out_dir))
    print(f"wrote {len(written)} coefficient files to {resolve_path(args.out_dir)}")
    if not args.no_report:
        report_dir = resolve_path(args.report_dir)
        report_dir.mkdir(parents=True, exist_ok=True)
        (report_dir / "fidelity.md").write_text(markdown(cal))
        plot(cal, report_dir / "predicted_vs_measured.png")
        print(f"wrote {report_dir / 'fidelity.md'} and {report_dir / 'predicted_vs_measured.png'}")
    for key, value in summary(cal).items():
        print(f"  {key}: {value:.4f}" if isinstance(value, float) else f"  {key}: {value}")


if __name__ == "__main__":
    main()
