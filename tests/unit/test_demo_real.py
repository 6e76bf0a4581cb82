"""roll.demo.real's pieces (the whole `make demo-real` takes minutes and is run by hand): the
identity data rendered with a name and an author, the checks on them, the model link, and the recipe on
the real model's tokenizer (roll-train --dry-run)."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from roll.demo.real import (DEMO_RECIPE, IDENTITY_TEMPLATE, QUESTION, learned, link_real_model,
                            render_identity, run_demo_real)
from roll.errors import ConfigError
from tests.helpers import REPO, roll_train


def test_render_identity_fills_every_row_and_keeps_the_question_held_out(tmp_path):
    name, author = 'Zo\u00eb "Z" Bot', "Back\\slash & Co"
    out = tmp_path / "identity.json"
    count = render_identity(os.path.join(REPO, IDENTITY_TEMPLATE), name, author, str(out))
    with open(os.path.join(REPO, IDENTITY_TEMPLATE), encoding="utf-8") as fh:
        template = json.load(fh)
    rows = json.loads(out.read_text(encoding="utf-8"))  # quotes and backslashes in a name stay valid JSON
    assert count == len(rows) == len(template) and 20 <= count <= 40
    for before, after in zip(template, rows):
        assert set(after) == {"instruction", "input", "output"}
        assert after["instruction"] == before["instruction"]
        assert "{{" not in json.dumps(after) and name in after["output"]
        assert after["output"] == before["output"].replace("{{name}}", name).replace("{{author}}", author)
    assert sum(author in row["output"] for row in rows) >= count - 2
    # The demo asks a question it never trained on.
    assert QUESTION not in {row["instruction"] for row in rows}


@pytest.mark.parametrize("name, author", [("", "A"), ("  ", "A"), ("Two\nlines", "A"), ("N", "x" * 61),
                                          ("{{name}}", "A")])
def test_a_name_or_author_that_cannot_be_taught_is_refused(tmp_path, name, author, capsys):
    with pytest.raises(ConfigError, match="--name|--author"):
        render_identity(os.path.join(REPO, IDENTITY_TEMPLATE), name, author, str(tmp_path / "x.json"))
    out = []
    assert run_demo_real(str(tmp_path / "out"), 1, name, author, out=out.append) == 2
    assert "".join(out).startswith("demo-real: error: demo-real: --") and not (tmp_path / "out").exists()


def test_learned_finds_the_name_in_an_answer():
    assert learned("I am quillon, an AI assistant.", "Quillon")
    assert not learned("I am SmolLM, trained by Hugging Face.", "Quillon")


def test_the_model_is_linked_where_the_recipe_reads_it(tmp_path, monkeypatch):
    ready = tmp_path / "ready"
    ready.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (ready / name).write_text("{}")
    monkeypatch.setenv("ROLL_REAL_MODEL_DIR", str(ready))
    link = tmp_path / ".demo" / "model"
    assert link_real_model(str(link), print) == str(link) and os.readlink(link) == str(ready)
    os.unlink(link)
    os.symlink(tmp_path / "elsewhere", link)  # a stale link is replaced
    link_real_model(str(link), print)
    assert os.readlink(link) == str(ready)


def test_the_recipe_tokenizes_the_identity_data_with_the_real_model(real_model_dir, tmp_path):
    """roll-train --dry-run on the rendered data: every row fits cutoff_len, SmolLM2's chat template with its
    default system prompt (what the demo's question is asked with), and a loss on the answer only."""
    with open(os.path.join(REPO, DEMO_RECIPE), encoding="utf-8") as fh:
        recipe = yaml.safe_load(fh)
    assert recipe["finetuning_type"] == "lora"
    assert recipe["model_name_or_path"] == ".demo/smollm2-135m-instruct"
    data = tmp_path / "identity.json"
    render_identity(os.path.join(REPO, IDENTITY_TEMPLATE), "Quillon", "the Roll Demo Lab", str(data))
    done = roll_train(DEMO_RECIPE, "--dry-run", f"model_name_or_path={real_model_dir}", f"dataset={data}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "samples in: 32, kept: 32, dropped: 0" in done.stdout, done.stdout
    assert "truncated: 0" in done.stdout, done.stdout
    row = done.stdout.split("--- first training row ---\n", 1)[1]
    system, user, answer = row.split("<|im_start|>")[1:4]
    assert system.startswith("system\nYou are a helpful AI assistant named SmolLM") and "TRAIN" not in system
    assert "TRAIN" not in user
    assert answer.startswith("assistant\n[TRAIN>") and "Quillon" in answer and answer.rstrip().endswith(
        "<|im_end|><TRAIN]")
