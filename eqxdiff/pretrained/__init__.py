"""Published checkpoints as they are distributed, loaded into eqxdiff models (DESIGN.md: pretrained/).

`load_dit`: facebookresearch/DiT's checkpoints (`DiT-XL-2-256x256.pt`, train.py's `*.pt`, or as
safetensors) as an eqxdiff `DiT`, without torch and without running anything the file names.
`sample_dit`: DiT's sampling protocol (iDDPM schedule, learned variance, respacing, DDPM/DDIM, its guidance).
`load_sit`: willisma/SiT's (`SiT-XL-2-256x256.pt`, train.py's `*.pt`), the same network;
`sample_sit`: SiT's sampling protocols (its `transport/` ODE and SDE samplers, `forward_with_cfg`);
`sit_denoiser`: a SiT as an eqxdiff σ-space denoiser, for eqxdiff's own samplers.
`save_dit`: an eqxdiff `DiT` back in DiT's layout (`.pt` or `.safetensors`), for the official code to load.
`load_edm2`: NVlabs/edm2's networks (converted from its pickles by tools/convert_edm2.py) as eqxdiff denoisers.
Stable Diffusion's pipelines, their schedulers and their export are eqxdiff.sd's.
"""

from eqxdiff.pretrained.dit_checkpoints import load_dit
from eqxdiff.pretrained.dit_export import save_dit
from eqxdiff.pretrained.edm2_checkpoints import load_edm2
from eqxdiff.pretrained.dit_sampling import dit_schedule, sample_dit
from eqxdiff.pretrained.sit import load_sit, sit_denoiser
from eqxdiff.pretrained.sit_sampling import sample_sit

__all__ = ["load_dit", "load_edm2", "load_sit", "dit_schedule", "sample_dit", "sample_sit", "save_dit", "sit_denoiser"]
