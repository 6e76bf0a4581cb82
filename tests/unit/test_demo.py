"""roll.demo.quick's pieces (the whole `make demo` is run by hand / in CI by `make demo`): the sample prompt
and a greedy reply from a trained-or-not HF model directory."""

from __future__ import annotations

import os

from roll.demo.quick import first_example, generate_reply
from tests.helpers import REPO


def test_first_example_is_the_datas_first_prompt_and_answer():
    prompt, answer = first_example(os.path.join(REPO, "recipes", "demo", "data", "arithmetic_sft.json"))
    assert prompt == "What is 2 plus 3?" and answer == "2 plus 3 equals 5."


def _greedy_by_hand(model_dir: str, prompt: str, max_new_tokens: int, text: str | None = None) -> str:
    """Greedy decoding without ``generate``: the argmax token appended until an end-of-turn token (from ``text``
    when given, else the template's generation prompt)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    text = text or tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tok(text)["input_ids"]
    stop = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    reply = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(input_ids=torch.tensor([ids + reply])).logits[0, -1].argmax())
            if token in stop:
                break
            reply.append(token)
    return tok.decode(reply, skip_special_tokens=True).strip()


def test_generate_reply_is_the_greedy_reply(tiny_model_factory):
    # Untied embeddings: the tied tiny model's greedy reply repeats the prompt's last token ('\n') and
    # strips to '', which an empty or a sampled reply could not be told from.
    model_dir = tiny_model_factory("qwen2", tie_word_embeddings=False)
    expected = _greedy_by_hand(model_dir, "What is 2 plus 3?", max_new_tokens=6)
    assert len(expected) >= 5, expected
    assert generate_reply(model_dir, "What is 2 plus 3?", max_new_tokens=6) == expected
    assert generate_reply(model_dir, "What is 2 plus 3?", max_new_tokens=6) == expected  # repeatable


def test_an_older_demo_model_is_rebuilt(tmp_path, monkeypatch):
    """`make demo` keeps a demo model it built but rebuilds one with another init (an older roll's: 0.02 gave a
    model that had not learned the additions after the demo's steps)."""
    import json

    from roll.demo import quick, tiny_model

    built = []
    monkeypatch.setattr(tiny_model, "make_demo_model", lambda path: built.append(path) or (
        (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "qwen2", **tiny_model.DEMO_MODEL}))))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "qwen2", "initializer_range": 0.02}))
    said = []
    quick.ensure_tiny_model(str(tmp_path / "m"), said.append)
    assert built == [str(tmp_path / "m")] and said[0].startswith("tiny model: rebuilt")
    quick.ensure_tiny_model(str(tmp_path / "m"), said.append)
    assert built == [str(tmp_path / "m")] and said[1].endswith("(already built)\n")
    assert not tiny_model.is_demo_model(str(tmp_path / "missing"))


THINK_TEMPLATE = (  # Qwen3's shape: an empty think block before the reply, not in the generation prompt
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{ m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def test_generate_reply_asks_with_the_prompt_training_saw(tiny_model_factory, tmp_path):
    """With a template that puts an empty think block before the reply (the Qwen2.5 tokenizer files' own), the
    reply is generated after that block, as in training, not after the bare generation prompt."""
    import shutil

    from transformers import AutoTokenizer

    model_dir = str(tmp_path / "think")
    shutil.copytree(tiny_model_factory("qwen2", tie_word_embeddings=False), model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = THINK_TEMPLATE
    tok.save_pretrained(model_dir)
    trained = "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    expected = _greedy_by_hand(model_dir, "", max_new_tokens=6, text=trained)
    assert expected != _greedy_by_hand(model_dir, "What is 2 plus 3?", max_new_tokens=6)  # the case matters
    assert generate_reply(model_dir, "What is 2 plus 3?", max_new_tokens=6) == expected


def test_the_demo_trains_its_recipes_max_steps_unless_told(monkeypatch, tmp_path):
    """`make demo` without DEMO_STEPS trains recipes/demo/quick_sft.yaml's max_steps (the number its header
    sizes for 2 CPU minutes); DEMO_STEPS=10 (CI) trains 10, on TP2 with the demo's tolerance either way."""
    import yaml

    from roll.demo import quick

    calls = []
    monkeypatch.setattr(quick, "ensure_tiny_model", lambda model_dir, out: None)
    monkeypatch.setattr(quick.parity, "main", lambda argv, out: calls.append(argv) or 2)  # 2: stop after the runs
    with open(os.path.join(REPO, quick.DEMO_RECIPE), encoding="utf-8") as fh:
        max_steps = yaml.safe_load(fh)["max_steps"]
    recipe = os.path.join(REPO, quick.DEMO_RECIPE)
    assert quick.run_demo(str(tmp_path), recipe=recipe, out=lambda text: None) == 2
    assert quick.run_demo(str(tmp_path), 10, recipe=recipe, out=lambda text: None) == 2
    assert [argv[argv.index("--steps") + 1] for argv in calls] == [str(max_steps), "10"]
    assert all(argv[argv.index("--tolerance") + 1] == str(quick.LOSS_TOLERANCE) and
               "tensor_model_parallel_size=2" in argv for argv in calls)
