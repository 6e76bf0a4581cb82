"""roll-train answers --help, --print-config and config mistakes without importing the training stack.

The time it takes is measured by scripts/startup_time.py (not here: a timed test on shared cores is noise);
these tests pin down the cause of slowness instead: which modules a process imported.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import typing

from roll.config.coerce import describe
from tests.helpers import REPO, clean_env

HEAVY = ("torch", "transformers", "peft", "trl", "datasets", "accelerate", "deepspeed", "megatron")

_PROBE = """
import contextlib, io, json, sys
from roll.cli import main
codes = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        codes.append(main(argv))
heavy = sorted({name.split(".")[0] for name in sys.modules} & set(json.loads(sys.argv[2])))
print(json.dumps({"codes": codes, "heavy": heavy}))
"""


def test_help_print_config_and_mistakes_import_no_training_stack():
    cases = [
        (["--help"], 0),
        (["recipes/qwen_sft.yaml", "learning_rat=1e-5"], 2),  # unknown key
        (["recipes/qwen_sft.yaml", "stage=SFT"], 2),  # bad value
        (["recipes/qwen_sft.yaml", "--use-mca", "tensor_model_parallel_size=3"], 2),  # impossible layout
        (["recipes/qwen_sft.yaml", "--print-config"], 0),
        (["recipes/qwen_sft.yaml", "--use-mca", "--print-config"], 0),
        ([], 2),  # bare roll-train: usage
    ]
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps([argv for argv, _ in cases]),
                           json.dumps(HEAVY)], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["codes"] == [code for _, code in cases]
    assert result["heavy"] == [], f"imported {result['heavy']} to answer a question about the config"


def test_mistakes_preflight_finds_in_a_complete_model_dir_import_no_training_stack(tiny_model_dir, tmp_path):
    """roll.preflight's checks of files (data, resume, chat template) run before the one that imports
    transformers (is model_type one it knows): a newcomer's typo is answered in well under a second."""
    data = tmp_path / "rows.json"
    data.write_text('[{"instruction": "Hi", "output": "Yo."}]')
    (tmp_path / "rows.xml").write_text("<rows/>")
    base = [f"model_name_or_path={tiny_model_dir}", f"dataset={data}", "max_steps=1", "report_to=none"]
    cases = [
        [*base, f"output_dir={tmp_path / 'a'}", f"dataset={tmp_path / 'row.json'}"],  # a typo in the data file
        [*base, f"output_dir={tmp_path / 'b'}", f"dataset={tmp_path / 'rows.xml'}"],  # a type roll does not read
        [*base, f"output_dir={tmp_path / 'c'}", f"eval_dataset={tmp_path / 'evals.json'}"],
        [*base, f"output_dir={tmp_path / 'd'}", f"resume_from_checkpoint={tmp_path / 'checkpoint-3'}"],
        [*base, f"output_dir={tmp_path / 'e'}", "dataset="],
    ]
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(cases), json.dumps(HEAVY)], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["codes"] == [2] * len(cases)
    assert result["heavy"] == [], f"imported {result['heavy']} to find a mistake in the files"


def test_hf_training_snapshot_matches_installed_transformers():
    """roll/config/hf_training.py is the installed transformers' TrainingArguments: every field, with its
    default and the same accepted values (enums as Literal). Out of date: run scripts/update_hf_fields.py."""
    import transformers

    from roll.config.hf_training import TRANSFORMERS_VERSION, HFTrainingFields

    def table(cls) -> dict[str, tuple]:
        hints = typing.get_type_hints(cls)
        rows = {}
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            rows[f.name] = (describe(hints[f.name]), repr(default), " ".join(str(f.metadata.get("help")).split()))
        return rows

    hf, snapshot = table(transformers.TrainingArguments), table(HFTrainingFields)
    assert TRANSFORMERS_VERSION == transformers.__version__, "rerun python scripts/update_hf_fields.py"
    assert list(snapshot) == list(hf)
    assert snapshot == hf


def test_roll_training_arguments_hand_hf_every_field():
    """hf_kwargs gives HF's TrainingArguments each of its fields, from roll's parsed values."""
    import transformers

    from roll.config.parser import resolve

    config = resolve({"learning_rate": 3e-5, "lr_scheduler_type": "cosine", "save_strategy": "no"}, {}, None)
    kwargs = config.training.hf_kwargs()
    assert set(kwargs) == {f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init}
    assert (kwargs["learning_rate"], kwargs["lr_scheduler_type"], kwargs["save_strategy"]) == (3e-5, "cosine", "no")
    assert "use_mca" not in kwargs and "nproc_per_node" not in kwargs
