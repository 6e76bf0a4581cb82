"""The planner (roll-train --plan) and the model-shape reader it shares with the speed metrics."""
