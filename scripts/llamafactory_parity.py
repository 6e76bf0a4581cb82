"""A recipe under LLaMA-Factory and under roll (standard, then --use-mca): per-step losses, their relative
difference and a verdict (roll/parity/llamafactory.py; docs/llamafactory-parity.md).

usage: python scripts/llamafactory_parity.py RECIPE.yaml [key=value ...] [--steps 5] [--sequential]
           [--tolerance 1e-4] [--first-step-tolerance 1e-5] [--output-dir outputs/llamafactory_parity]
           [--backends standard,mca] [--lf key=value] [--roll key=value]
           [--llamafactory-cli lf/bin/llamafactory-cli]

LLaMA-Factory runs from a venv of its own (`bash scripts/llamafactory_venv.sh lf`); without one the script
says so and exits 2.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from roll.parity.llamafactory import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
