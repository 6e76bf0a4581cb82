"""roll-parity: the two backends side by side."""
