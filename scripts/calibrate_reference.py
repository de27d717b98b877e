#!/usr/bin/env python3
"""Calibrate the drafter's confidence head on traces with the reference engine (see
dspine.bench.calibrate_reference)."""

from dspine.bench.calibrate_reference import main

if __name__ == "__main__":
    raise SystemExit(main())
