"""Fault injection: the injectors behind `--inject` and the test harnesses they need."""
