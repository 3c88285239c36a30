"""`--model sd_tiny` (eqxdiff/run/models.py): diffusers' UNet2DConditionModel as an eqxdiff SDUNet for a text run, its
cross_attention_dim the run's text width, so that `save_pipeline` writes it as a pipeline's unet/ (the run exported
and sampled by diffusers: tools/check_sd_scratch.py); what it cannot take is refused by name."""

import json

import equinox as eqx
import jax
import pytest
from eqxdiff.run.models import CONSTRUCTORS, MODELS

from eqxdiff.sd import SDUNet


def test_sd_tiny_is_a_diffusers_unet_for_the_runs_text():
    constructor, kwargs = MODELS["sd_tiny"]((8, 16, 1), context_dim=64, pooled_dim=0)
    net = eqx.filter_eval_shape(CONSTRUCTORS[constructor], **kwargs, remat=False, key=jax.random.key(0))  # shapes
    config = json.loads(net.config)
    assert isinstance(net, SDUNet) and net.context_dim == 64 and config["cross_attention_dim"] == 64
    assert (config["in_channels"], config["out_channels"], config["sample_size"]) == (1, 1, 8)
    assert CONSTRUCTORS[constructor](**kwargs, remat=True, key=jax.random.key(0)).remat
    for wrong in (dict(num_classes=10), dict(context_dim=32)):
        with pytest.raises(ValueError, match="SDUNet takes a text context of width 64"):
            CONSTRUCTORS[constructor](config=kwargs["config"], **{"remat": False, **wrong}, key=jax.random.key(0))
