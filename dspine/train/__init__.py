"""Drafter training: target-regenerated data, online training, acceptance benchmark."""
