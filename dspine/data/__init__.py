"""Prompts and traces: evaluation sets, training prompt sources and request traces."""
