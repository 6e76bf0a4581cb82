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
