"""roll-bench: the speed ledger."""
