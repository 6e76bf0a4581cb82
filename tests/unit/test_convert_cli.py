"""roll-convert's command line: how many processes a layout needs, and help that shows the defaults."""

from __future__ import annotations

import argparse

import pytest

from backends.mca import convert_cli


@pytest.mark.parametrize("sizes, expected", [
    ({}, 1),
    ({"tp": 2}, 2),
    ({"tp": 2, "pp": 2}, 4),
    ({"ep": 2}, 2),  # the experts need dp 2 at tp 1
    ({"tp": 2, "ep": 4, "etp": 1}, 4),  # etp*ep = 4 must divide tp*dp: dp 2
    ({"tp": 4, "ep": 2, "etp": 2}, 4),  # 4 divides tp 4 already
    ({"tp": 2, "ep": 3}, 6),  # etp defaults to tp: 6 divides 2*dp first at dp 3
])
def test_processes_needed_is_the_smallest_valid_world(sizes, expected):
    args = argparse.Namespace(**{"tp": 1, "pp": 1, "ep": 1, "etp": None, **sizes})
    assert convert_cli.processes_needed(args) == expected
    # an independent check: the smallest world size roll's own layout accepts
    from roll.config.layout import ParallelLayout
    from roll.errors import ConfigError

    def valid(world: int) -> bool:
        try:
            ParallelLayout(world, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
        except ConfigError:
            return False
        return True

    assert expected == next(world for world in range(1, 65) if valid(world))


def test_subcommand_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        convert_cli._parser().parse_args(["mca2hf", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "tensor parallel size (default: 1)" in text and "(default: 2.0)" in text
    assert "source model directory (default" not in text  # required: no default to show


@pytest.mark.parametrize("argv", [["--help"], ["hf2mca", "-h"]])
def test_help_through_run_keeps_the_memory_epilog(argv, capsys):
    # run() builds the parser without the epilog (roll.plan's import) unless help is asked for
    with pytest.raises(SystemExit):
        convert_cli.run(argv)
    text = " ".join(capsys.readouterr().out.split())
    assert "hf2mca 31.6 GB" in text and "streams shard by shard" in text


_ENDING = """
import atexit, os, sys, threading, time
from roll.fast_exit import end_process
folder = sys.argv[1]
class Finalized:
    def __init__(self, path):
        self.path = path
    def __del__(self, open=open):  # runs in the interpreter finalization (builtins may be gone by then)
        open(self.path, "w").close()
kept = Finalized(os.path.join(folder, "finalized"))
atexit.register(lambda: open(os.path.join(folder, "atexit"), "w").close())
if sys.argv[2] == "thread":
    def late():
        time.sleep(0.3)
        open(os.path.join(folder, "thread"), "w").close()
    threading.Thread(target=late).start()
print("buffered", end="")
end_process(3)
"""


@pytest.mark.parametrize("thread", [False, True])
def test_end_process_skips_the_finalization_not_atexit_nor_a_running_thread(tmp_path, thread):
    """``roll.fast_exit.end_process`` (how roll-convert ends): the exit code, the atexit handlers (logging's flush)
    and buffered output kept, Python's finalization skipped (a module object's ``__del__`` never runs); while a
    non-daemon thread runs it exits as ``sys.exit`` does, after that thread."""
    import subprocess
    import sys

    from tests.helpers import REPO

    proc = subprocess.run([sys.executable, "-c", _ENDING, str(tmp_path), "thread" if thread else "none"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**__import__("os").environ,
                                                                            "PYTHONPATH": REPO})
    assert proc.returncode == 3 and proc.stdout == "buffered", proc.stderr
    made = sorted(path.name for path in tmp_path.iterdir())
    assert made == (["atexit", "finalized", "thread"] if thread else ["atexit"]), made


def test_the_commands_end_through_end_process_and_main_with_argv_raises(monkeypatch, tmp_path, capsys):
    """``roll-convert`` and ``roll-train`` (their entry points, ``command``) end with ``end_process``, here after
    a usage error (exit 2); ``main(argv)``, which tests and scripts call, raises SystemExit or returns as before."""
    import sys

    from roll import cli, fast_exit

    ended = []

    def end(code):
        ended.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(fast_exit, "end_process", end)
    argv = ["hf2mca", "--input", str(tmp_path / "missing"), "--output", str(tmp_path / "out")]
    monkeypatch.setattr(sys, "argv", ["roll-convert", *argv])
    with pytest.raises(SystemExit) as stop:
        convert_cli.command()
    assert stop.value.code == 2 and ended == [2]
    with pytest.raises(SystemExit) as stop:
        convert_cli.main(argv)
    assert stop.value.code == 2 and ended == [2]
    assert capsys.readouterr().err.count("roll-convert: error:") == 2
    monkeypatch.setattr(sys, "argv", ["roll-train"])  # bare: the usage, exit 2
    with pytest.raises(SystemExit) as stop:
        cli.command()
    assert stop.value.code == 2 and ended == [2, 2]
    assert cli.main([]) == 2 and ended == [2, 2]
