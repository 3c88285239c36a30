"""The unconditional EDM objective the step benchmarks train with (train/main.py's prepare and
loss_fn without labels): EDM's σ draw and preconditioning, EDM's weighted MSE.

Shared by bench_train.py, bench_train_vs_flaxdiff.py and bench_remat_memory.py, so they time
and measure one and the same step.
"""

from eqxdiff.diffusion import EDMPreconditioning, EDMSchedule, denoising_loss_at, draw_sigma_and_noise


def unconditional_edm():
    """(prepare, loss_fn) for `eqxdiff.training.make_train_step`; batches are {"images": [b, h, w, c]}."""
    schedule, parameterization = EDMSchedule(), EDMPreconditioning()

    def prepare(batch, key):
        sigma, noise = draw_sigma_and_noise(schedule, batch["images"], key)
        return dict(batch, sigma=sigma, noise=noise)

    def loss_fn(model, batch, key):
        return denoising_loss_at(
            model, schedule, parameterization, batch["images"], batch["sigma"], batch["noise"], None, key=key
        )

    return prepare, loss_fn
