"""One process: a GLM-4.5 model directory loaded for bf16 training and wrapped (Float16Module + DDP) as the mca
trainer wraps it; prints ``RESULT {"exact": ..., "dtype": ...}`` for its routers' expert bias against the HF file.

    python bf16_expert_bias.py MODEL_DIR
"""

from __future__ import annotations

import glob
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    from safetensors.torch import load_file

    from backends.mca.convert import megatron_settings
    from backends.mca.initialize import initialize_megatron
    from backends.mca.models.auto import AutoModel
    from backends.mca.trainer.optim import wrap_ddp

    dist.init_process_group("gloo")
    megatron, layout = megatron_settings()
    initialize_megatron(layout)
    hf = {}
    for path in glob.glob(os.path.join(sys.argv[1], "*.safetensors")):
        hf.update(load_file(path))
    chunks = wrap_ddp(AutoModel.from_pretrained(sys.argv[1], megatron, bf16=True), megatron, fp16=False, bf16=True)
    biases = {int(name.split("decoder.layers.")[1].split(".")[0]): buffer  # global = local layer at PP1
              for name, buffer in chunks[0].named_buffers() if name.endswith("router.expert_bias")}
    exact = all(torch.equal(b.cpu(), hf[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"])
                for layer, b in biases.items())
    layers = sorted(biases)
    print("RESULT " + json.dumps({"exact": exact, "layers": layers,
                                  "dtypes": sorted({str(b.dtype) for b in biases.values()})}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
