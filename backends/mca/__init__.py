"""The mca backend: Megatron-Core models converted on the fly from (and back to) HF checkpoints.

Importing this package must stay cheap and must not import megatron: config validation loads the
backend class to ask what it supports.
"""

import warnings

from backends.mca import lazy_jit
from backends.mca.backend import McaBackend

# megatron's jit_fuser is torch.compile, whose wrapper imports torch._dynamo / inductor (~3 s of CPU) in
# every process that imports megatron; backends.mca.lazy_jit defers it to a decorated function's first call.
lazy_jit.install()

# megatron-core warns at import, once per module (7 lines per process on a CPU run), that Transformer
# Engine and Apex are missing, and per model build that its own default cuda_graph_scope "full" is
# deprecated. This package is imported before any megatron module; backends.mca.platform says the first
# once, in its log line (the second is megatron's own default, nothing a user can change).
warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex are|Apex is) not installed",
                        category=UserWarning, module=r"megatron\.")
warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning,
                        module=r"megatron\.")

__all__ = ["McaBackend"]
