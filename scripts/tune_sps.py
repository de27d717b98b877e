#!/usr/bin/env python
"""Measure a DSPINE deployment's SPS table on your traces; same as `dspine tune-sps` (see dspine/sps_tuning.py).

Example: python scripts/tune_sps.py --url http://127.0.0.1:30000 --traces my.jsonl --out sps/
"""

import sys

from dspine.sps_tuning import main

if __name__ == "__main__":
    sys.exit(main())
