"""roll-bench from a checkout without installing: ``python scripts/bench.py [--quick] [options]``.

The speed ledger (docs/performance.md): the same model and data through a plain transformers.Trainer,
the standard backend and the mca backend (1 process, DP2, TP2), then conversion throughput. See
``roll-bench --help``; the library is roll/bench/cli.py.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from roll.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
