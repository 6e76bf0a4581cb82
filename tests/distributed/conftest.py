"""Runs that tests of several files here read, trained once per session for the tests selected."""

from __future__ import annotations

import pytest

_PREFERENCE_READERS = {"test_dpo_layouts_and_backend_parity": "dpo",
                       "test_orpo_and_simpo_match_across_backends_and_layouts": "pref"}
"""The tests that read ``preference_runs_of_the_session``, and which of its groups each reads."""


@pytest.fixture(scope="session")
def preference_runs_of_the_session(request, tiny_model_factory, tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """{group: ({name: standard log}, {name: Megatron run})} of DPO's runs ("dpo", test_mca_dpo.py) and orpo /
    simpo's ("pref", test_mca_pref_losses_dist.py): both over one base, so the groups the session's selected
    tests read train together, every standard run in one process and every Megatron run in one 2-process
    torchrun job, not one of each per test (one test alone trains only its own group)."""
    pytest.importorskip("megatron.core")
    from tests.distributed.test_mca_dpo import dpo_specs, preference_runs
    from tests.distributed.test_mca_pref_losses_dist import pref_specs

    specs = {"dpo": dpo_specs, "pref": pref_specs}
    groups = sorted({_PREFERENCE_READERS[item.originalname] for item in request.session.items
                     if getattr(item, "originalname", None) in _PREFERENCE_READERS})
    results = preference_runs(tiny_model_factory, tmp_path_factory.mktemp("preference"),
                              [specs[group](tiny_model_factory) for group in groups])
    return dict(zip(groups, results))
