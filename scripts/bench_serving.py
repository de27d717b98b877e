#!/usr/bin/env python3
"""Serving benchmark: AR vs DSPINE vs DSPINE-ablation SGLang servers over HTTP (see
dspine.bench.serving)."""

from dspine.bench.serving import main

if __name__ == "__main__":
    raise SystemExit(main())
