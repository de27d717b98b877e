#!/usr/bin/env python3
"""Served copy-candidates benchmark: AR vs NGRAM vs DSPINE vs DSPINE-copy SGLang servers on long
agentic traces and the evaluation sets (see dspine.bench.copy_candidates; `--help` for an example)."""

from dspine.bench.copy_candidates import main

if __name__ == "__main__":
    raise SystemExit(main())
