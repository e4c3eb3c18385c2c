"""exactspec: speculative decoding that keeps the target model's output distribution exactly."""
from exactspec import costmodel, sampling
from exactspec.sampling import BlockResult, probs_from_logits, verify_block, verify_token

__version__ = "0.1.0"

__all__ = [
    "BlockResult", "costmodel", "probs_from_logits", "sampling", "verify_block", "verify_token",
]
