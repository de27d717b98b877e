#!/usr/bin/env python3
"""Block-verify attention: DSpine's split-KV kernel against SGLang's prefill kernel (see
dspine.bench.verify_attention)."""

from dspine.bench.verify_attention import main

if __name__ == "__main__":
    raise SystemExit(main())
