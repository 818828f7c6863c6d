"""Event ledger, goodput accounting, metrics and the run report."""
