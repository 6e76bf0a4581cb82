"""make demo and make demo-real, and the models they train."""
