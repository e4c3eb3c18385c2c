"""exactspec's speculative decoding in Transformers' folder form of `custom_generate`:

    model.generate(**inputs, custom_generate=exactspec.hf.custom_generate_dir(),
                   trust_remote_code=True, draft="ngram", gamma=4, streamer=streamer)

Transformers hands this function every `generate()` argument; it hands the call back to
`generate()` with `exactspec.hf.generate` as the callable (see `exactspec.hf.folder_generate`),
so the output follows the processed target's law exactly. Needs the `exactspec` package.
"""
from exactspec.hf.generation import folder_generate as generate

__all__ = ["generate"]
