"""The benchmark: exactspec against plain decoding and Transformers, on the same models and prompts."""
