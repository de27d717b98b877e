#!/usr/bin/env python
"""Measure a DSPINE deployment's SPS table on your traces; same as `dspine tune-sps` (see dspine/serve/tune_sps.py).

Example: python scripts/tune_sps.py --url http://127.0.0.1:30000 --traces my.jsonl --out sps/
"""

import sys

from dspine.serve.tune_sps_cli import main

if __name__ == "__main__":
    sys.exit(main())
