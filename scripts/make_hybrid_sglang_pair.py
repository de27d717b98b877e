#!/usr/bin/env python3
"""Write a random hybrid Gated-DeltaNet target and a DSpine drafter for it (see
dspine.bench.hybrid_pair)."""

from dspine.bench.hybrid_pair import main

if __name__ == "__main__":
    raise SystemExit(main())
