"""``python -m calibration``: fit the cost model to published profiles, write ``conf/cost/*.yaml``,
``conf/engine_overhead/*.yaml`` and the fidelity report.

    python -m calibration                                  # every GPU x model x tp into conf/cost
    python -m calibration out=DIR report=null "hardware=[h100_80gb]" "models=[llama2_7b]" "tp=[1,2]"

``data_root`` defaults to :func:`chunkgym.data_root` (``$CHUNKGYM_DATA``, else the user cache);
``report=null`` writes the coefficient files only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from calibration.cost_files import write_cost_files, write_engine_overheads
from calibration.from_published import HARDWARE, MODELS, TENSOR_PARALLEL, calibrate
from calibration.report import markdown, plot, summary
from chunkgym import data_root, resolve_path
from chunkgym.cli import hydra_cli


@dataclass
class Options:
    """``python -m calibration``'s options."""

    data_root: str | None = None  # data folder; null: chunkgym.data_root()
    out: str = "conf/cost"  # where coefficient files go
    engine_overhead_out: str = "conf/engine_overhead"  # where engine overhead profiles go
    report: str | None = "reports/calibration"  # fidelity.md and the plot go here; null: none
    hardware: list[str] = field(default_factory=lambda: list(HARDWARE))  # conf/hardware names
    models: list[str] = field(default_factory=lambda: list(MODELS))  # conf/model names
    tp: list[int] = field(default_factory=lambda: list(TENSOR_PARALLEL))  # tensor-parallel degrees


def run(opts: Options) -> None:
    """Fit, write the coefficient files (and the report), print the headline numbers."""
    cal = calibrate(data_root(opts.data_root), opts.hardware, opts.models, opts.tp)
    out = resolve_path(opts.out)
    written = write_cost_files(cal.files, out)
    print(f"wrote {len(written)} coefficient files to {out}")
    profiles = write_engine_overheads(cal.overheads, resolve_path(opts.engine_overhead_out))
    print(
        f"wrote engine overhead profiles {', '.join(p.name for p in profiles)} to {opts.engine_overhead_out}"
    )
    if opts.report is not None:
        report_dir = resolve_path(opts.report)
        report_dir.mkdir(parents=True, exist_ok=True)
        (report_dir / "fidelity.md").write_text(markdown(cal))
        plot(cal, report_dir / "predicted_vs_measured.png")
        print(f"wrote {report_dir / 'fidelity.md'} and {report_dir / 'predicted_vs_measured.png'}")
    for key, value in summary(cal).items():
        print(f"  {key}: {value:.4f}" if isinstance(value, float) else f"  {key}: {value}")


main = hydra_cli(Options, name="calibration")(run)

if __name__ == "__main__":
    main()
