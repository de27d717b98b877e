#!/usr/bin/env python3
"""Write head-padded copies of a target and its drafter for tensor parallelism (see
dspine.bench.tp_padded_pair)."""

from dspine.bench.tp_padded_pair import main

if __name__ == "__main__":
    raise SystemExit(main())
