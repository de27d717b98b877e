"""The reference engine: target loading and runners (dense and hybrid Gated-DeltaNet with
ReplaySSM), the proposer, lossless acceptance, and `generate`."""
