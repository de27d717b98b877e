#!/usr/bin/env python3
"""Is a speculative server's sampling the target's? A chi-square test over HTTP (see
dspine.bench.served_sampling)."""

from dspine.bench.served_sampling import main

if __name__ == "__main__":
    raise SystemExit(main())
