"""eqxdiff/run/sampling.py: `Sampling`, how a run is sampled decided once from flags, draws what eqxdiff.generate's
`generate` draws with that recipe spelled out; `run_sampling` reads a run's flags and a script's overrides."""

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff.diffusion import Denoiser, parameterization_by_name, schedule_by_name
from eqxdiff.generate import generate
from eqxdiff.run.codecs import Pixels
from eqxdiff.run.sampling import Sampling, parse_interval, run_sampling
from eqxdiff.sharding import make_mesh
from tests.core.test_generate_images import LabelledDrift

# A run's flags as train/main.py's Config (or a checkpoint's stored_flags) holds them.
RUN_FLAGS = SimpleNamespace(sample_method="euler", sample_steps=7, guidance=1.5, guidance_interval="0.5,10")


def stand_in_run(scale: float = 0.3) -> tuple:
    """(model, schedule, parameterization) of a stand-in pixel run: EDM's, σ_data 0.5."""
    return LabelledDrift(jnp.float32(scale)), schedule_by_name("edm"), parameterization_by_name("edm", 0.5)


def draw(sampling: Sampling, **kwargs) -> np.ndarray:
    """8 images of labels 0..7 (null label 10) of a stand-in network, in pixels, by `sampling`."""
    model, schedule, param = stand_in_run()
    images, drawn = sampling.images(
        model,
        Pixels(),
        schedule,
        param,
        (4, 4, 1),
        np.arange(8, dtype=np.int32),
        8,
        mesh=make_mesh(data=-1, fsdp=1),
        null_cond=np.array([10], np.int32),
        seed=5,
        **kwargs,
    )
    assert drawn is images  # pixels: nothing decoded
    return images


def spelled_out(**recipe) -> np.ndarray:
    """`draw`'s images from eqxdiff.generate's `generate`, the recipe given by hand."""
    return generate(
        *stand_in_run(),
        np.arange(8, dtype=np.int32),
        8,
        (4, 4, 1),
        mesh=make_mesh(data=-1, fsdp=1),
        null_cond=np.array([10], np.int32),
        seed=5,
        **recipe,
    )


def test_sampling_draws_what_its_recipe_spelled_out_draws():
    sampling = Sampling(method="euler", steps=3, guidance=2.5, guidance_interval=(0.5, 10.0))
    images = draw(sampling)
    np.testing.assert_array_equal(
        images, spelled_out(method="euler", steps=3, guidance=2.5, guidance_interval=(0.5, 10.0))
    )
    # Each field reaches the sampler: changing one changes the images.
    for other in (dict(method="heun"), dict(steps=4), dict(guidance=1.0), dict(guidance_interval=None)):
        changed = draw(Sampling(**{**sampling.__dict__, **other}))
        assert np.abs(changed - images).max() > 1e-4, other


def test_autoguidance_needs_both_the_weak_model_and_its_scale():
    weak = Denoiser(*stand_in_run(scale=0.1))
    images = draw(Sampling(method="euler", steps=3, guide_scale=2.0), weak_denoiser=weak)
    np.testing.assert_array_equal(images, spelled_out(method="euler", steps=3, weak_denoiser=weak, guide_scale=2.0))
    with pytest.raises(ValueError, match="needs both a weak_denoiser and Sampling.guide_scale"):
        draw(Sampling(steps=3, guide_scale=2.0))
    with pytest.raises(ValueError, match="needs both a weak_denoiser and Sampling.guide_scale"):
        draw(Sampling(steps=3), weak_denoiser=weak)


def test_run_sampling_is_the_runs_own_unless_a_flag_overrides_it():
    assert run_sampling(RUN_FLAGS) == Sampling(method="euler", steps=7, guidance=1.5, guidance_interval=(0.5, 10.0))
    assert run_sampling(RUN_FLAGS, method="heun", steps=3, guidance=4.0, interval="0.2,3", tiling="off") == Sampling(
        method="heun", steps=3, guidance=4.0, guidance_interval=(0.2, 3.0), tiling="off"
    )
    assert run_sampling(RUN_FLAGS, guidance=1.0).guidance == 1.0  # 1 (no guidance) is an override, not "unset"
    # Autoguidance replaces classifier-free guidance: unguided at every σ, whatever the run's grids used.
    assert run_sampling(RUN_FLAGS, guide_scale=2.0) == Sampling(method="euler", steps=7, guide_scale=2.0)
    with pytest.raises(ValueError, match="must be LO,HI"):
        run_sampling(RUN_FLAGS, interval="0.3")
    with pytest.raises(ValueError, match="needs 0 <= LO < HI"):
        parse_interval("3,1")


def test_the_record_names_what_decides_the_samples():
    assert Sampling().record() == {"method": "heun", "steps": 18, "guidance": 1.0}
    assert Sampling(guidance=2.0, guidance_interval=(0.28, 2.9)).record()["guidance_interval"] == "0.28,2.9"
    assert Sampling(guide_scale=3.0).record()["guide_scale"] == 3.0
