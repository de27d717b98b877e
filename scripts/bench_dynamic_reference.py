#!/usr/bin/env python3
"""Dynamic verification on the reference engine, tuned on traces (see dspine.bench.dynamic_reference)."""

from dspine.bench.dynamic_reference import main

if __name__ == "__main__":
    raise SystemExit(main())
