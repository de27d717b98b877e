#!/usr/bin/env python3
"""Dynamic verification served: AR vs DSPINE-static vs DSPINE-dynamic on held-out traces (see
dspine.bench.dynamic)."""

from dspine.bench.dynamic import main

if __name__ == "__main__":
    raise SystemExit(main())
