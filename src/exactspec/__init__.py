"""exactspec: speculative decoding that keeps the target model's output distribution exactly."""
from exactspec import costmodel

__version__ = "0.1.0"
