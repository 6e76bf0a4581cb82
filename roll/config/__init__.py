"""Typed run configuration: argument groups, YAML recipe + command-line parsing, validation."""

from roll.config.data import DataArguments
from roll.config.finetuning import FinetuningArguments
from roll.config.layout import ParallelLayout
from roll.config.megatron import MegatronArguments
from roll.config.model import ModelArguments
from roll.config.parser import CliOptions, parse_args
from roll.config.run import GROUPS, RunConfig
from roll.config.training import TrainingArguments

__all__ = ["CliOptions", "DataArguments", "FinetuningArguments", "GROUPS", "MegatronArguments",
           "ModelArguments", "ParallelLayout", "RunConfig", "TrainingArguments", "parse_args"]
