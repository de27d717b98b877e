#!/usr/bin/env python3
"""Train the DSpine drafter and its ablation with the same data, steps and seed (see
dspine.train.pair)."""

from dspine.train.pair import main

if __name__ == "__main__":
    raise SystemExit(main())
