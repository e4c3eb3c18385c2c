"""exactspec: speculative decoding that keeps the target model's output distribution exactly."""
from exactspec import costmodel, rejection, sampling
from exactspec.decoding import (
    DecodeStats, GenerateOutput, autoregressive_generate, speculative_generate,
)
from exactspec.drafters import ModelDrafter, NGramDrafter
from exactspec.models import LoadedModel, check_compatible, load_model
from exactspec.sampling import BlockResult, probs_from_logits, verify_block, verify_token

__version__ = "0.1.0"

__all__ = [
    "BlockResult", "DecodeStats", "GenerateOutput", "LoadedModel", "ModelDrafter", "NGramDrafter",
    "autoregressive_generate", "check_compatible", "costmodel", "load_model", "probs_from_logits",
    "rejection", "sampling", "speculative_generate", "verify_block", "verify_token",
]
