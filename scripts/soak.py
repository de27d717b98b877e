#!/usr/bin/env python3
"""Soak test of an SGLang server on this machine: mixed chat traffic for --minutes, then errors,
latency tail, stalls, /health and memory judged (see dspine.bench.soak)."""

from dspine.bench.soak import main

if __name__ == "__main__":
    raise SystemExit(main())
