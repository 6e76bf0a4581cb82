"""Regenerate docs/keys.md, the table of what every recipe key does on each backend, from
roll/config/coverage.py. Rerun it after changing a row or adding a key.

usage: python scripts/update_key_table.py [--check]
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "docs", "keys.md")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/keys.md is out of date")
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    from roll.config.key_table import render_markdown

    text = render_markdown()
    current = open(TARGET, encoding="utf-8").read() if os.path.exists(TARGET) else ""
    if args.check:
        if current != text:
            sys.stderr.write(f"{TARGET} is out of date: run python scripts/update_key_table.py\n")
            return 1
        return 0
    with open(TARGET, "w", encoding="utf-8") as fh:
        fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
