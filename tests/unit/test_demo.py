"""roll.demo's pieces (the whole `make demo` is run by hand / in CI by `make demo`): the sample prompt
and a greedy reply from a trained-or-not HF model directory."""

from __future__ import annotations

import os

from roll.demo import first_example, generate_reply
from tests.helpers import REPO


def test_first_example_is_the_datas_first_prompt_and_answer():
    prompt, answer = first_example(os.path.join(REPO, "recipes", "demo", "data", "arithmetic_sft.json"))
    assert prompt == "What is 2 plus 3?" and answer == "2 plus 3 equals 5."


def test_generate_reply_is_greedy_and_repeatable(tiny_model_dir):
    a = generate_reply(tiny_model_dir, "What is 2 plus 3?", max_new_tokens=6)
    b = generate_reply(tiny_model_dir, "What is 2 plus 3?", max_new_tokens=6)
    assert isinstance(a, str) and a == b
