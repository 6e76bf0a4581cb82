"""Training backends behind one interface (backends/base.py). Imports flow backends -> roll only."""
