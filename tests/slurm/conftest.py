"""The session's SLURM test cluster (``tests/slurm/cluster.py``): started once, torn down after the last test,
every daemon and job process killed even when a test failed."""

from __future__ import annotations

import pytest

from tests.conftest import under_ci
from tests.slurm.cluster import ClusterUnavailable, missing_requirements, start_cluster


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A running loopback SLURM cluster of two nodes. Skipped where SLURM is not installed or the tests do not
    run as root, a failure under CI=true (CI installs the packages: .ci/run); a cluster that is installed but
    does not start is always a failure, with the daemons' logs."""
    reason = missing_requirements()
    if reason:
        if under_ci():
            pytest.fail(f"CI=true: the SLURM tests need a cluster: {reason}", pytrace=False)
        pytest.skip(f"no SLURM test cluster: {reason}")
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    except ClusterUnavailable as exc:
        pytest.fail(f"the SLURM test cluster did not start: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()
