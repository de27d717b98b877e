#!/usr/bin/env python3
"""Write dummy-weight serving folders of the published shapes: target, DSpine drafter and DFlash
drafter configs (see dspine.bench.real_shapes; `--help` for an example)."""

from dspine.bench.real_shapes import main

if __name__ == "__main__":
    raise SystemExit(main())
