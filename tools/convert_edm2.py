"""Convert one of NVlabs/edm2's published network pickles (network-snapshot-*.pkl, e.g.
edm2-img512-xs-2147483-0.135.pkl) into what `eqxdiff.pretrained.load_edm2` reads: OUT.safetensors, the
Precond's state_dict as stored (float16 in the published files), and OUT.json, its constructor arguments.

EDM2's pickles embed their network code (torch_utils/persistence.py): unpickling runs it. So this runs
only in the torch venv, with a clone of https://github.com/NVlabs/edm2 on sys.path (`--edm2`; written
against commit 4bf8162), and only on files you trust. The JAX side never unpickles them.

    tools/.venv/bin/python tools/convert_edm2.py --edm2 PATH/TO/edm2 --pkl edm2-img512-xs-...pkl --out OUT

OUT.json: {"network": {"class_name": "Precond", **the Precond's init_kwargs}, "encoder": {"class_name", **init_kwargs}
(EDM2's pixel or latent encoder, its constants), "source": the pickle's file name}.
"""

import argparse
import json
import pickle
import sys
from pathlib import Path

from safetensors.torch import save_file


def persisted(obj) -> dict:
    """A persistent-class object's class name and constructor keywords, as EDM2's persistence records them (an
    unpickled class lives in a module persistence made from the embedded source: its name is not EDM2's)."""
    return {"class_name": type(obj).__name__, **dict(obj.init_kwargs)}


def convert(pkl: Path, out: Path) -> None:
    """Writes out.safetensors and out.json from the pickle's "ema" network (EDM2's reference code must import)."""
    with open(pkl, "rb") as f:
        data = pickle.load(f)
    net = data["ema"]
    if type(net).__name__ != "Precond":
        raise SystemExit(f"{pkl}: its 'ema' is a {type(net).__name__}, not networks_edm2.Precond: not an EDM2 network")
    state = {k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}
    save_file(state, str(out.with_suffix(".safetensors")))
    config = {"network": persisted(net), "source": pkl.name}
    if data.get("encoder") is not None:
        config["encoder"] = persisted(data["encoder"])
    out.with_suffix(".json").write_text(json.dumps(config, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edm2", type=Path, required=True, help="a clone of github.com/NVlabs/edm2")
    parser.add_argument("--pkl", type=Path, required=True, help="an EDM2 network pickle")
    parser.add_argument("--out", type=Path, required=True, help="OUT: writes OUT.safetensors and OUT.json")
    args = parser.parse_args()
    if not (args.edm2 / "training" / "networks_edm2.py").is_file():
        raise SystemExit(f"--edm2 {args.edm2}: no training/networks_edm2.py there; pass a clone of NVlabs/edm2")
    sys.path.insert(0, str(args.edm2.resolve()))
    convert(args.pkl, args.out)


if __name__ == "__main__":
    main()
