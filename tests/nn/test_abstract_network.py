"""eqxdiff/nn/abstract_network.py: a network's structure is traced once per (constructor, configuration, dtype
flags), and a changed configuration never gets another's structure."""

import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from eqxdiff.nn import AutoencoderKL
from eqxdiff.nn import abstract_network as cache
from eqxdiff.nn.abstract_network import abstract_network, canonical_json

VAE = Path(__file__).parents[1] / "data" / "autoencoder_kl" / "sd_like"
TRACES = []  # one entry per trace of Counted's constructor


class Counted(eqx.Module):
    """A network whose constructor notes each time it runs (eval_shape runs it once per trace)."""

    weight: Float[Array, "i o"]

    def __init__(self, config: dict, *, key: PRNGKeyArray, scale: float = 1.0):
        TRACES.append(json.dumps(config))
        self.weight = scale * jax.random.normal(key, (config["width"], config["depth"]), jnp.zeros(()).dtype)


def test_one_trace_per_configuration_and_a_changed_one_gets_its_own_structure():
    TRACES.clear()
    first = abstract_network(Counted, {"width": 3, "depth": 5})
    again = abstract_network(Counted, json.loads('{"depth": 5, "width": 3}'))  # an equal config, read again
    assert len(TRACES) == 1 and again is first and first.weight.shape == (3, 5)
    wider = abstract_network(Counted, {"width": 4, "depth": 5})
    assert len(TRACES) == 2 and wider.weight.shape == (4, 5)
    abstract_network(Counted, {"width": 3, "depth": 5}, scale=2.0)  # a keyword is part of the configuration
    assert len(TRACES) == 3
    with jax.enable_x64(True):  # a flag that changes the dtypes is part of it too
        doubled = abstract_network(Counted, {"width": 3, "depth": 5})
    assert len(TRACES) == 4 and doubled.weight.dtype == jnp.float64 and first.weight.dtype == jnp.float32


def test_types_that_json_merges_stay_apart():
    assert canonical_json(({"a": (1, 2)},)) != canonical_json(({"a": [1, 2]},))
    assert canonical_json(({"a": True},)) != canonical_json(({"a": 1},))
    assert canonical_json(({"b": 1, "a": 2},)) == canonical_json(({"a": 2, "b": 1},))
    assert canonical_json(({"a": object()},)) is None  # not plain data: traced every call, never shared


def test_a_second_load_of_a_folder_does_not_trace_its_constructor(monkeypatch):
    traced = []
    eval_shape = eqx.filter_eval_shape
    monkeypatch.setattr(cache.eqx, "filter_eval_shape", lambda f, *a, **k: traced.append(f) or eval_shape(f, *a, **k))
    first = AutoencoderKL.from_diffusers(VAE)
    before = len(traced)
    second = AutoencoderKL.from_diffusers(VAE)
    assert len(traced) == before, "the second load traced the constructor again"
    assert eqx.tree_equal(first, second)
