"""Dynamic verification: per-position acceptance calibration, cost tables, the verify-budget
planner and the draft-or-plain speculation switch."""
