"""Draw LIT-011's Figure 3 view of a report into an image file.

    python -m fp16probe profile --out fp16probe-report.json     # the built-in demo model
    python docs/make_figure3.py fp16probe-report.json docs/figure3-demo.png

The recommendation drawn beside the measured histogram is the analyzer's for fp16.
"""

from __future__ import annotations

import argparse

from fp16probe.analysis.recommend import analyze
from fp16probe.presentation.figures import plot_distribution
from fp16probe.report import Report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="a report file written by fp16probe profile")
    parser.add_argument("image", help="the image to write (.png, .svg or .pdf)")
    parser.add_argument("--format", default="fp16", help="target format (default fp16)")
    args = parser.parse_args()
    report = Report.load(args.report)
    rec = analyze(report, args.format)
    ax = plot_distribution(report, args.format, recommendation=rec)
    ax.figure.savefig(args.image, dpi=110)


if __name__ == "__main__":
    main()
