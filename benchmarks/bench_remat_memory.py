"""Remat memory: the compiled training step's temp bytes with `remat=True` against `remat=False`.

Builds the real step (`make_train_step`, same prepare/loss as train/main.py, AdamW with
grad-norm clipping) for the same model with and without remat, compiles each from the abstract
state (nothing is allocated or run) and reads XLA's `compiled.memory_analysis()`:
`temp_size_in_bytes` is the step's scratch memory (activations kept for the backward pass
among it); arguments/outputs are the state and batch, equal on both sides. Also reported, for
reference, the same for the loss gradient alone (no optimizer), where remat's effect is not
mixed with how the optimizer's dependencies get scheduled. One device, the default backend.

On CPU the step compiles with XLA:CPU's memory-optimized scheduler (`eqxdiff.xla_cpu`, on here);
`--cpu_scheduler xla_default` drops that option to show XLA:CPU's default scheduler, under
which remat saves nothing (BENCHMARKS.md). Prints one JSON line.

    python benchmarks/bench_remat_memory.py                         # UNet (32, 64) x2, 32x32x3, batch 64
    python benchmarks/bench_remat_memory.py --model dit_s --batch 32
    python benchmarks/bench_remat_memory.py --cpu_scheduler xla_default
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp

from eqxdiff import xla_cpu
from eqxdiff.nn import DiT, UNet
from eqxdiff.sharding import batch_sharding, make_mesh
from eqxdiff.training import abstract_train_state, adamw_cosine, make_train_step
from harness import report  # benchmarks/ is on sys.path
from unconditional_edm import unconditional_edm

xla_cpu.enable()  # XLA:CPU workarounds on, as in train/main.py (eqxdiff/xla_cpu.py)

MODELS = {
    "unet": ("UNet(3, (32, 64), 2)", lambda remat, key: UNet(3, (32, 64), 2, remat=remat, key=key)),
    "unet_flaxdiff": ("UNet.flaxdiff_simple(3)", lambda remat, key: UNet.flaxdiff_simple(3, remat=remat, key=key)),
    "dit_s": ("DiT.small(32, 3, 2)", lambda remat, key: DiT.small(32, 3, 2, remat=remat, key=key)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="unet", choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--cpu_scheduler", default="step", choices=["step", "xla_default"])
    args = parser.parse_args()

    mesh = make_mesh(1, 1, jax.devices()[:1])
    optimizer, lr_schedule = adamw_cosine(1e-4, 1000, 10)
    images = jax.ShapeDtypeStruct((args.batch, args.image_size, args.image_size, 3), jnp.uint8)

    prepare, loss_fn = unconditional_edm()  # as train/main.py, without labels

    def temp_mib(compiled) -> float:
        return round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 1)

    result = {}
    for remat in (False, True):
        make_model = lambda key: MODELS[args.model][1](remat, key)  # noqa: E731
        abstract, shardings = abstract_train_state(make_model, optimizer, mesh, 2**12)
        step = make_train_step(
            prepare=prepare,
            loss_fn=loss_fn,
            optimizer=optimizer,
            lr_schedule=lr_schedule,
            ema_decay=0.999,
            state_shardings=shardings,
            batch_sharding=batch_sharding(mesh),
            seed=0,
        )
        if args.cpu_scheduler == "xla_default":
            step.compiler_options.pop("xla_cpu_scheduler_type", None)
        step_temp = temp_mib(step.compile(abstract, {"image": images}))

        params, static = eqx.partition(abstract.model, lambda x: isinstance(x, jax.ShapeDtypeStruct))

        def loss_of_params(params, images):
            batch = prepare({"image": images}, jax.random.key(0))
            return loss_fn(eqx.combine(params, static), batch, jax.random.key(1))

        grad_temp = temp_mib(jax.jit(jax.grad(loss_of_params)).lower(params, images).compile(step.compiler_options))
        result["remat" if remat else "no_remat"] = {"step_temp_mib": step_temp, "loss_grad_temp_mib": grad_temp}

    ratio = {k: round(result["remat"][k] / result["no_remat"][k], 3) for k in result["remat"]}
    report(
        "remat_memory",
        {
            "backend": jax.default_backend(),
            "model": MODELS[args.model][0],
            "batch": args.batch,
            "image_size": args.image_size,
            "cpu_scheduler": args.cpu_scheduler if jax.default_backend() == "cpu" else None,
            **result,
            "remat_over_no_remat": ratio,
        },
    )


if __name__ == "__main__":
    main()
