"""Dynamic verification: per-position acceptance calibration (`calibration`, recorded by
`recording`), step-cost tables (`cost_tables`), the verify-budget planner and the reference
engine's verifier (`planner`), the draft-or-plain rule (`backoff`) and the SGLang worker's
speculation switch and its file (`switch`)."""
