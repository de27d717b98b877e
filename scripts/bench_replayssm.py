#!/usr/bin/env python3
"""ReplaySSM vs per-token state snapshots: memory, commit time, kernel error (see
dspine.bench.replayssm)."""

from dspine.bench.replayssm import main

if __name__ == "__main__":
    raise SystemExit(main())
