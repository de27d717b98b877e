#!/usr/bin/env python3
"""The published presets at their shapes: join a run's round-cost file, soak files and server logs into
benchmarks/results/real_shapes_h200.json (see dspine.bench.real_shapes_report; `--help`)."""

from dspine.bench.real_shapes_report import main

if __name__ == "__main__":
    raise SystemExit(main())
