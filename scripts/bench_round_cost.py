#!/usr/bin/env python3
"""Round-cost benchmark: T_step (AR) against T_round (DSPINE, DSPINE-eager, DFLASH, NGRAM) with host
time per step, for servers already running (see dspine.bench.round_cost; `--help` for an example)."""

from dspine.bench.round_cost import main

if __name__ == "__main__":
    raise SystemExit(main())
