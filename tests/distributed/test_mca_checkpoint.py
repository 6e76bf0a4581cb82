"""backends.mca.checkpoint: a model saved at one parallel layout loads at another with equal logits."""

from __future__ import annotations

import os

import pytest

from tests.helpers import REPO, output_of, results, torchrun

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.distributed, pytest.mark.mca]

WORKERS = os.path.join(REPO, "tests", "distributed", "_mca_workers")


def test_dist_checkpoint_reshards_tp1_tp2_pp2_vpp(tmp_path):
    """Chain TP1 -> TP2 -> PP2 -> PP2xVPP2 -> TP1, each phase built from another seed.

    Tolerance 1e-5 on fp32 logits (observed: 1.5e-7 at TP2, from the split row-parallel reduction;
    0.0 at PP/VPP/TP1, which compute in the same order as TP1). The TP2 checkpoint, written past the page
    cache (``direct``; the later phases load it), has the ``.distcp`` bytes of the same save written buffered. The
    same save written as ``save_async`` writes it (``checkpoint_background``, from the model's own memory) is the one
    PP2 loads.
    """
    proc = torchrun(os.path.join(WORKERS, "platform_checkpoint.py"), str(tmp_path), timeout=240)
    assert proc.returncode == 0, output_of(proc)
    rows = results(proc.stdout)
    assert len(rows) == 2, output_of(proc)
    res = rows[0]
    loads = {(phase, key): value for phase in ("tp2", "pp2", "vpp2", "back_to_tp1")
             for key, value in res[phase].items() if key.startswith("from_")}
    assert set(loads) == {("tp2", "from_tp1"), ("pp2", "from_tp1"), ("pp2", "from_tp2-background"), ("vpp2", "from_pp2"),
                          ("back_to_tp1", "from_vpp2"), ("back_to_tp1", "from_tp2")}
    for where, diff in loads.items():
        assert 0 <= diff <= 1e-5, (where, diff)
    for phase in ("tp2", "pp2", "vpp2", "back_to_tp1"):
        assert res[phase]["before_load"] > 0.1, phase  # freshly built models differ: loading did the work
    assert res["tp2"]["direct_differs"] == []  # roll.direct_write's files equal PyTorch's buffered ones
    # save_async's write (a thread writes the plan from the model's own memory on CPU): PP2 loads it, above
    assert res["tp2"]["background_live"] is True
    assert res["is_dist_checkpoint"] == [True, False]
    not_a_checkpoint, wrong_model = res["load_errors"]
    assert "is not a Megatron distributed checkpoint" in not_a_checkpoint
    assert "lacks 2 tensor(s)" in wrong_model and "q_layernorm.weight" in wrong_model, wrong_model
