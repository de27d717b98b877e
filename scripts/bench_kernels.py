#!/usr/bin/env python
"""Time DSpine's Triton kernels, the draft round and a verify against the PyTorch references
(see dspine/bench/kernels.py).

GPU host:  python scripts/bench_kernels.py --out-dir OUT
CPU check: TRITON_INTERPRET=1 python scripts/bench_kernels.py --cpu-smoke
"""

import sys

from dspine.bench.kernels import main

if __name__ == "__main__":
    sys.exit(main())
