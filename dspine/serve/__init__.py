"""The client side of serving: presets, server-flag rules, launch, SPS tuning. Imports nothing
from `dspine.sglang`: it runs where SGLang is not installed."""
