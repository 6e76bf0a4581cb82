"""The mutation gate (``make mutation``): every bug of tests/mutants.py must make one of its tests fail.

usage: python scripts/mutation.py [--fast] [--only NAME ...] [--timeout SECONDS] [--no-baseline] [--list]

The tree is copied once to a temporary directory (the real one is never edited); the listed tests first run
there unmutated (they must pass, or "caught" would mean nothing), then once per mutant with it applied.
Prints a table (bug, tests run, caught by, seconds) and exits 1 when a mutant survives, an anchor is stale,
a run times out or the unmutated tree fails its tests.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.mutants import MUTANTS, Mutant  # noqa: E402
from tests.mutation_gate import (Outcome, StaleAnchor, baseline, check_anchor, copy_tree, run_mutant,  # noqa: E402
                                 temporary_copy)


def _short(test: str) -> str:
    return test.split("/")[-1]


def table(rows: list[tuple[Mutant, Outcome]]) -> str:
    lines = ["| bug | tests run | result | caught by | s |", "|---|---|---|---|---|"]
    for mutant, outcome in rows:
        caught = ", ".join(_short(t) for t in outcome.caught_by) or "-"
        tests = "<br>".join(_short(t) for t in mutant.tests)
        lines.append(f"| `{mutant.name}`: {mutant.bug} | {tests} | {outcome.status} | {caught} | "
                     f"{outcome.seconds:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="only the mutants that also run in `make test`")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="only these mutants")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per pytest run (default 900)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the tests")
    parser.add_argument("--list", action="store_true", help="print the mutants and their tests, run nothing")
    args = parser.parse_args(argv)
    mutants = [m for m in MUTANTS if (not args.fast or m.fast) and (not args.only or m.name in args.only)]
    unknown = set(args.only or ()) - {m.name for m in MUTANTS}
    if unknown or not mutants:
        parser.error(f"no such mutant: {', '.join(sorted(unknown))}; --list shows them" if unknown
                     else "no mutant selected")
    if args.list:
        for mutant in mutants:
            print(f"{mutant.name}{' (fast)' if mutant.fast else ''}: {mutant.bug}\n  {mutant.file}\n  "
                  + "\n  ".join(mutant.tests))
        return 0
    stale = []
    for mutant in mutants:  # before any test runs: a stale list fails in seconds
        try:
            check_anchor(mutant)
        except (StaleAnchor, OSError) as exc:  # OSError: the file no longer exists
            stale.append(f"{mutant.name}: {exc}")
    if stale:
        print("STALE ANCHORS (update tests/mutants.py with the code):\n" + "\n".join(stale), file=sys.stderr)
        return 1
    start = time.monotonic()
    with temporary_copy() as tmp:
        root = copy_tree(Path(tmp))
        if not args.no_baseline:
            print(f"unmutated tree: running the {len({t for m in mutants for t in m.tests})} listed tests ...",
                  flush=True)
            base = baseline(root, mutants, args.timeout)
            if base.status != "passed":
                print(f"the unmutated tree fails its listed tests ({base.status}: {base.caught_by}); fix that "
                      f"first, or every mutant would look caught.\n{base.output}", file=sys.stderr)
                return 1
            print(f"unmutated tree: passed in {base.seconds:.0f} s", flush=True)
        rows = []
        for mutant in mutants:
            outcome = run_mutant(root, mutant, args.timeout)
            rows.append((mutant, outcome))
            print(f"{mutant.name}: {outcome.status} ({outcome.seconds:.0f} s)"
                  + (f" by {', '.join(outcome.caught_by)}" if outcome.caught_by else ""), flush=True)
            if outcome.status in ("broken", "timeout"):
                print(outcome.output, file=sys.stderr)
    print("\n" + table(rows))
    failed = [mutant.name for mutant, outcome in rows if not outcome.ok]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} mutants caught in {time.monotonic() - start:.0f} s"
          + (f"; NOT caught: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
