#!/usr/bin/env python3
"""``llamafactory-cli`` for Qwen-VL models in a LLaMA-Factory environment without torchvision (the one
``scripts/llamafactory_venv.sh`` makes: PyPI's torchvision wheels for Linux are CUDA builds).

There, transformers' ``AutoProcessor`` fails on a Qwen-VL model's video processor (its class needs torchvision),
LLaMA-Factory goes on without a processor and then refuses every image ("Processor was not found"). This launcher
builds the processor LLaMA-Factory asked for from the model's image processor (``Qwen2VLImageProcessorPil``, the
class transformers itself falls back to without torchvision) and a stand-in video processor that nothing calls
(no videos), then runs LLaMA-Factory's own command line: images still go through LLaMA-Factory's own code
(``mm_plugin.py``: its resize, its processor call, its collator). docs/llamafactory-parity.md, "Vision-language".

usage: python scripts/llamafactory_parity.py RECIPE.yaml ... --llamafactory-cli scripts/llamafactory_vl_cli.py
Run by any python: it restarts itself under LLaMA-Factory's ($LLAMAFACTORY_PYTHON, else lf/bin/python).
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}
VIDEO_INPUTS = ["pixel_values_videos", "video_grid_thw"]


def patch_auto_processor() -> None:
    """``AutoProcessor.from_pretrained``: on a Qwen-VL model whose video processor cannot load (ImportError), the
    model's processor class with its PIL image processor, its tokenizer and a stand-in video processor."""
    import transformers
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class NoVideoProcessor(transformers.BaseVideoProcessor):  # transformers' placeholder class without torchvision
        def __init__(self):
            self.model_input_names = list(VIDEO_INPUTS)

    load = AutoProcessor.from_pretrained.__func__

    def from_pretrained(cls, path, *args, **kwargs):
        try:
            return load(cls, path, *args, **kwargs)
        except ImportError:
            model_type = AutoConfig.from_pretrained(path, trust_remote_code=kwargs.get("trust_remote_code", False))
            if model_type.model_type not in PROCESSORS:
                raise
            tokenizer = AutoTokenizer.from_pretrained(path)
            image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
            processor = getattr(transformers, PROCESSORS[model_type.model_type])(
                image_processor=image_processor, tokenizer=tokenizer, video_processor=NoVideoProcessor(),
                chat_template=tokenizer.chat_template)

            def save_pretrained(save_directory, **_):  # at the end of training: the stand-in has nothing to save
                image_processor.save_pretrained(save_directory)
                tokenizer.save_pretrained(save_directory)

            processor.save_pretrained = save_pretrained
            return processor

    AutoProcessor.from_pretrained = classmethod(from_pretrained)


def main() -> int:
    try:
        import llamafactory  # noqa: F401
    except ImportError:  # started by roll's python (or another): LLaMA-Factory's environment runs it
        python = os.environ.get("LLAMAFACTORY_PYTHON") or os.path.join(ROOT, "lf", "bin", "python")
        if not os.path.isfile(python):
            sys.stderr.write(f"llamafactory_vl_cli: no LLaMA-Factory python at {python} (set LLAMAFACTORY_PYTHON, or "
                             "bash scripts/llamafactory_venv.sh lf)\n")
            return 2
        os.execv(python, [python, os.path.abspath(__file__), *sys.argv[1:]])
    patch_auto_processor()
    from llamafactory.cli import main as llamafactory_main

    sys.argv[0] = "llamafactory-cli"
    return llamafactory_main() or 0


if __name__ == "__main__":
    sys.exit(main())
