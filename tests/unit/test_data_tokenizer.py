"""load_tokenizer: the model's tokenizer, a built-in template on request, a pad token when missing."""

from __future__ import annotations

import pytest

from roll.config.data import DataArguments
from roll.config.model import ModelArguments
from roll.data import load_tokenizer
from roll.data.named_templates import TEMPLATES
from roll.data.templates import DEFAULT
from roll.data.tokenizer import to_jinja
from roll.errors import ConfigError, ModelError


@pytest.fixture(scope="module")
def bare_tokenizer_dir(tmp_path_factory):
    """The test BPE tokenizer saved without a pad token and without a chat template."""
    from roll.demo.tiny_model import build_bpe_tokenizer

    tok = build_bpe_tokenizer()
    tok.pad_token = None
    tok.chat_template = None
    out = str(tmp_path_factory.mktemp("bare_tok"))
    tok.save_pretrained(out)
    return out


def test_tokenizer_from_model_dir_keeps_its_template(tiny_model_dir):
    tok = load_tokenizer(ModelArguments(model_name_or_path=tiny_model_dir), DataArguments())
    assert "<|im_start|>" in tok.chat_template and tok.pad_token == "<|endoftext|>"


def test_template_override(tiny_model_dir):
    tok = load_tokenizer(ModelArguments(model_name_or_path=tiny_model_dir), DataArguments(template="qwen"))
    assert tok.chat_template == to_jinja(TEMPLATES["qwen"])
    with pytest.raises(ConfigError, match="unknown template 'alpaca'"):
        load_tokenizer(ModelArguments(model_name_or_path=tiny_model_dir), DataArguments(template="alpaca"))


def test_missing_pad_token_and_template_get_defaults(bare_tokenizer_dir):
    tok = load_tokenizer(ModelArguments(tokenizer_name_or_path=bare_tokenizer_dir,
                                        model_name_or_path="unused"), DataArguments())
    assert tok.pad_token == tok.eos_token == "<|im_end|>"
    assert tok.chat_template == DEFAULT


def test_bad_paths_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="model_name_or_path"):
        load_tokenizer(ModelArguments(), DataArguments())
    with pytest.raises(ModelError, match="cannot load a tokenizer"):
        load_tokenizer(ModelArguments(model_name_or_path=str(tmp_path)), DataArguments())


@pytest.mark.parametrize("stage, refused", [("sft", True), ("dpo", True), ("kto", True), ("rm", True),
                                            ("pt", False)])
def test_roll_train_refuses_a_tokenizer_without_chat_template_for_conversation_stages(bare_tokenizer_dir,
                                                                                      stage, refused):
    from roll.config.parser import resolve
    from roll.preflight import check_chat_template

    config = resolve({"model_name_or_path": bare_tokenizer_dir, "stage": stage, "dataset": "x.json",
                      "per_device_train_batch_size": 2}, {}, None)
    if refused:
        with pytest.raises(ConfigError, match=f"has no chat template, which stage {stage} needs"):
            check_chat_template(config)
    else:
        check_chat_template(config)
    check_chat_template(resolve({"model_name_or_path": bare_tokenizer_dir, "stage": stage,
                                 "dataset": "x.json", "per_device_train_batch_size": 2,
                                 "template": "default"}, {}, None))
