"""exactspec: speculative decoding that keeps the target model's output distribution exactly.

The public names below load on first use (PEP 562), so `import exactspec` imports neither
transformers nor scipy nor matplotlib.
"""
from __future__ import annotations

import importlib
import os
import sys

__version__ = "0.1.0"

# PyTorch's OpenMP workers spin after each operation (GNU OpenMP's default spin count) and take
# the cores a llama.cpp draft runs on next: on 2 cores a one-token draft took 18 ms with the
# default and 7.5 ms with this, and plain decoding took the same with both. It counts only when
# set before torch loads; a value the user set wins.
SPIN_COUNT = "20000"
if "torch" not in sys.modules:
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)

_NAMES = {  # public name → the module that defines it
    "probs_from_logits": "exactspec.sampling", "SamplingConfig": "exactspec.sampling",
    "BlockResult": "exactspec.verify", "verify_block": "exactspec.verify",
    "verify_token": "exactspec.verify",
    "DecodeStats": "exactspec.engine", "GenerateOutput": "exactspec.engine",
    "autoregressive_generate": "exactspec.engine", "speculative_generate": "exactspec.engine",
    "ModelDrafter": "exactspec.drafters", "NGramDrafter": "exactspec.drafters",
    "make_drafter": "exactspec.drafters", "Drafter": "exactspec.drafters",
    "Controller": "exactspec.policy", "GammaController": "exactspec.controller",
    "Choice": "exactspec.policy", "Situation": "exactspec.policy",
    "LoadedModel": "exactspec.models", "check_compatible": "exactspec.models",
    "load_model": "exactspec.models", "Constraint": "exactspec.constraints",
    "TokenLogprob": "exactspec.logprobs",
}
_MODULES = {"costmodel": "exactspec.costmodel", "rejection": "exactspec.lab.rejection",
            "sampling": "exactspec.sampling", "verify": "exactspec.verify",
            "models": "exactspec.models", "drafters": "exactspec.drafters"}

__all__ = sorted([*_NAMES, *_MODULES])


def __getattr__(name: str):
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    else:
        raise AttributeError(f"module 'exactspec' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
