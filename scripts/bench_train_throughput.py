#!/usr/bin/env python
"""Training throughput (label tokens/s, MFU, peak memory) of the baseline and the new trainer path
on the device present (see dspine/bench/train_throughput.py); runs from a checkout without install.

GPU host:  python scripts/bench_train_throughput.py            (~4 minutes on an H200)
CPU check: python scripts/bench_train_throughput.py --shapes smollm2 --max-len 64 --batch-size 2 --steps 1 --warmup 1
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspine.bench.train_throughput import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
