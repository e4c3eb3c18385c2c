"""exactspec inside Transformers' `generate()`.

    import exactspec.hf
    model.generate(**inputs, custom_generate=exactspec.hf.generate, draft=draft, gamma=4)
    model.generate(**inputs, custom_generate=exactspec.hf.custom_generate_dir(),
                   trust_remote_code=True, draft=draft, streamer=streamer)

The callable form gets what Transformers prepares (config, processors, stopping criteria); the
folder form (`custom_generate/generate.py`, shipped with the package) receives every argument
and hands the call to the callable, moving `streamer=` to `exactspec_streamer=`. Importing this
package imports transformers; `import exactspec` does not import it.
"""
from __future__ import annotations

from pathlib import Path

from exactspec.hf.generation import ExactspecGenerateOutput, folder_generate, generate
from exactspec.hf.processing import Processing

__all__ = ["ExactspecGenerateOutput", "Processing", "custom_generate_dir", "folder_generate", "generate"]


def custom_generate_dir() -> str:
    """The folder to pass as `custom_generate=` (with trust_remote_code=True): it holds
    `custom_generate/generate.py`, which needs no network."""
    return str(Path(__file__).resolve().parent)
