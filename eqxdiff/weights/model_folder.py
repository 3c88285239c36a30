"""One model folder as diffusers' and transformers' `save_pretrained` write it: `config.json` (JSON, 2-space
indent, sorted keys, a final newline: diffusers' `to_json_string`) and the weights as one safetensors file
with metadata `format: pt` (`diffusion_pytorch_model[.<variant>].safetensors`, `model[.<variant>].safetensors`).
A folder that already holds files is refused unless `overwrite=True`, so nothing already written is lost.
"""

import json
import os
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def check_writable(folder: str | Path, overwrite: bool) -> Path:
    """`folder` as a Path, after refusing an existing non-empty folder (or a file) unless `overwrite`."""
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"{folder} is a file, not a folder: give a folder path to write the model into")
    if folder.is_dir() and any(folder.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{folder} is not empty: give an empty or new folder, or overwrite=True to replace "
            "the files of the same names in it"
        )
    return folder


def write_json(path: Path, data: dict) -> None:
    """`data` as diffusers writes configs (`json.dumps(indent=2, sort_keys=True)` + newline), replacing atomically."""
    _replace(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


def write_model_folder(
    folder: Path, config: dict, state: dict[str, np.ndarray], weights_name: str, *, variant: str | None = None
) -> Path:
    """config.json and `weights_name` (with `.<variant>` before its suffix) in `folder` (made if needed; call
    `check_writable` first). Each file is written under a temporary name and renamed, so an interrupted write
    leaves no half file under the real name. Returns `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    if variant:
        stem, suffix = weights_name.rsplit(".", 1)
        weights_name = f"{stem}.{variant}.{suffix}"
    temporary = folder / f".{weights_name}.partial"
    save_file(state, str(temporary), metadata={"format": "pt"})
    os.replace(temporary, folder / weights_name)
    write_json(folder / "config.json", config)
    return folder


def _replace(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.partial")
    temporary.write_bytes(data)
    os.replace(temporary, path)
