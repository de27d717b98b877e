#!/usr/bin/env python3
"""The official `openai` client against an OpenAI-compatible server (see dspine.serve.openai_demo)."""

from dspine.serve.openai_demo import main

if __name__ == "__main__":
    raise SystemExit(main())
