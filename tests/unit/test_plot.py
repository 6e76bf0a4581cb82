"""roll.plot: loss.png from a literal train_log.jsonl; a missing matplotlib skips the plot, never the run."""

from __future__ import annotations

import sys

import pytest

from roll.plot import LOSS_PLOT_FILE, Curve, parse_curve, plot_losses, write_loss_plot

LOG = """\
{"step": 1, "loss": 11.9, "grad_norm": 3.2, "learning_rate": 0.003}
{"step": 2, "loss": 9.5, "grad_norm": 2.9, "learning_rate": 0.003}
{"step": 3, "loss": 7.25, "grad_norm": 2.1, "learning_rate": 0.003}
{"step": 3, "eval_loss": 7.5}
{"step": 3, "train_runtime": 4.2, "train_loss": 9.55}
"""
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_parse_curve_keeps_training_losses_and_eval_points():
    curve = parse_curve(LOG.splitlines())
    assert curve.train == [(1, 11.9), (2, 9.5), (3, 7.25)]
    assert curve.eval == [(3, 7.5)]


def test_write_loss_plot_makes_a_valid_png(tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "train_log.jsonl").write_text(LOG)
    path = write_loss_plot(str(tmp_path), "sft (full), standard backend, 1 process")
    assert path == str(tmp_path / LOSS_PLOT_FILE)
    data = (tmp_path / LOSS_PLOT_FILE).read_bytes()
    assert data[:8] == PNG_MAGIC
    from PIL import Image  # matplotlib depends on pillow

    with Image.open(tmp_path / LOSS_PLOT_FILE) as image:
        image.verify()
        assert image.size == (700, 420)


def test_two_curves_on_one_plot(tmp_path):
    pytest.importorskip("matplotlib")
    a = Curve(train=[(1, 3.0), (2, 2.0)])
    b = Curve(train=[(1, 3.0), (2, 2.1)])
    path = plot_losses({"standard": a, "mca": b}, str(tmp_path / "both.png"), "both")
    assert open(path, "rb").read(8) == PNG_MAGIC


def test_no_log_no_plot(tmp_path):
    assert write_loss_plot(str(tmp_path), "t") is None
    assert not (tmp_path / LOSS_PLOT_FILE).exists()


def test_missing_matplotlib_warns_and_skips(tmp_path, monkeypatch, roll_warnings):
    (tmp_path / "train_log.jsonl").write_text(LOG)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert write_loss_plot(str(tmp_path), "t") is None
    assert write_loss_plot(str(tmp_path), "t") is None
    assert not (tmp_path / LOSS_PLOT_FILE).exists()
    warnings = [r.getMessage() for r in roll_warnings.records if "matplotlib" in r.getMessage()]
    assert len(warnings) == 1 and "pip install matplotlib" in warnings[0]
