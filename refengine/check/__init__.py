"""Judging the engine: the schedule format and its one driver, the margin rule and its Verdict,
comparisons against a baseline run, calibrated tolerances, replay, repro files, golden files and
golden check, margin statistics."""
