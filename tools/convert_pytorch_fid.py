"""pytorch-fid's FID Inception weights (a pickled state_dict, `pt_inception-2015-12-05-6726825d.pth`)
-> a safetensors file with the same keys, dtypes and values. eqxdiff does not need it: it reads the .pth
itself (eqxdiff.weights.torch_pickle, tensors only); this copy is for tools that want safetensors, and the
torch-side check of tools/make_fid_fixtures.py.

    tools/.venv/bin/python tools/convert_pytorch_fid.py \
        pt_inception-2015-12-05-6726825d.pth fid_inception.safetensors

The .pth is read with `torch.load(weights_only=True)`, which refuses anything but tensors and plain
containers. A file name carrying torch.hub's hash suffix (`-6726825d.pth`) must have a sha256 that
starts with it, as torch.hub checks on download. Every key is written, `fc.*` (the 1008-way logits)
and the int64 `*.bn.num_batches_tracked` counters included; the loader lists the ones it skips.

This machine cannot download the real file: the converter is exercised on the seeded random
state_dict that tools/make_fid_fixtures.py saves as a .pth (it converts that file and compares every
tensor of the result with the weights it gave pytorch-fid's network).
"""

import argparse
import hashlib
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HUB_HASH = re.compile(r"-([0-9a-f]{8,})\.pth$")  # torch.hub's naming: <name>-<sha256 prefix>.pth


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def convert(pth: Path, out: Path) -> dict[str, torch.Tensor]:
    """Write `pth`'s state_dict to `out` as safetensors; returns the state_dict."""
    match = HUB_HASH.search(pth.name)
    if match and not sha256(pth).startswith(match.group(1)):
        raise ValueError(
            f"{pth}: sha256 {sha256(pth)} does not start with the {match.group(1)} in its name "
            "(a partial or other download: fetch the file again)"
        )
    state = torch.load(pth, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{pth} is not a state_dict (a dict of tensors)")
    save_file({k: v.contiguous() for k, v in state.items()}, str(out))
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pth", type=Path, help="pytorch-fid's pt_inception-2015-12-05-6726825d.pth")
    parser.add_argument("out", type=Path, help="the .safetensors file to write")
    args = parser.parse_args()
    try:
        state = convert(args.pth, args.out)
    except (ValueError, FileNotFoundError) as e:  # a wrong or corrupt download: one line, argparse's status
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    params = sum(v.numel() for v in state.values() if v.is_floating_point())
    print(f"{args.out}: {len(state)} tensors, {params:,} float parameters")


if __name__ == "__main__":
    main()
