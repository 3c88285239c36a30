"""Fixtures for tests/core/test_meanflow.py: the official MeanFlow loss and its gradient (Gsunshine/meanflow's own
`MeanFlow.forward`, flax.linen on JAX), on random weights, a fixed batch and the draws it made, written to
tests/data/meanflow/official_loss.npz.

The official loss calls its network `net(x, t, h, y, train=, key=)`; here that network is `TinyNet`, a small MLP of
(z, t, h = t − r, label) whose math is the pure function `tiny_u` (tests/core/test_meanflow.py has the same function
as an Equinox module), so the fixture tests the objective, not a network. The official module itself runs
unchanged: its `sample_tr` and `cond_drop` are wrapped only to record what they drew (t, r, the dropped examples),
and jax.random.normal to record the noise ε.

    git clone https://github.com/Gsunshine/meanflow /tmp/meanflow && git -C /tmp/meanflow checkout d70cb55
    python3 -m venv tools/.venv-meanflow && tools/.venv-meanflow/bin/pip install -r tools/requirements-meanflow.txt
    tools/.venv-meanflow/bin/python tools/make_meanflow_fixtures.py --meanflow /tmp/meanflow
"""

import argparse
import sys
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "meanflow" / "official_loss.npz"
SHAPE = (8, 4, 4, 2)  # batch, h, w, c: 6 examples with r = t, 2 with r < t (the official 75%)
NUM_CLASSES, HIDDEN, FREQS = 3, 16, 4
# Each case: MeanFlow's hyperparameters (the official names) and the draws' seed. "guided" is the full guidance
# (κ > 0), "kappa0" the κ = 0 branch with a guidance interval in t and another adaptive-weight power.
CASES = {
    "guided": dict(
        omega=0.6, kappa=0.3, t_start=0.0, t_end=1.0, norm_p=1.0, norm_eps=0.01, class_dropout_prob=0.3, seed=3
    ),
    "kappa0": dict(
        omega=2.0, kappa=0.0, t_start=0.3, t_end=0.8, norm_p=0.5, norm_eps=0.05, class_dropout_prob=0.3, seed=5
    ),
}


def tiny_u(p, z, t, h, y):
    """The shared network: u = W_out·tanh(W_z·z + W_t·f(t) + W_h·f(h) + E[y]) + b, f(s) = [sin(s·ω), cos(s·ω)]."""
    import jax.numpy as jnp

    b = z.shape[0]
    feats = lambda s: jnp.concatenate([jnp.sin(s[:, None] * p["freq"]), jnp.cos(s[:, None] * p["freq"])], -1)  # noqa: E731
    hid = jnp.tanh(z.reshape(b, -1) @ p["w_z"] + feats(t) @ p["w_t"] + feats(h) @ p["w_h"] + p["embed"][y])
    return (hid @ p["w_out"] + p["b_out"]).reshape(z.shape)


def random_params(rng: np.random.Generator) -> dict:
    dim = int(np.prod(SHAPE[1:]))
    shapes = dict(
        freq=(FREQS,),
        w_z=(dim, HIDDEN),
        w_t=(2 * FREQS, HIDDEN),
        w_h=(2 * FREQS, HIDDEN),
        embed=(NUM_CLASSES + 1, HIDDEN),
        w_out=(HIDDEN, dim),
        b_out=(dim,),
    )
    scale = dict(freq=3.0, w_z=0.3, w_t=0.8, w_h=0.8, embed=0.8, w_out=0.5, b_out=0.1)
    return {k: (scale[k] * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--meanflow", required=True, help="a checkout of github.com/Gsunshine/meanflow")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    sys.path.insert(0, args.meanflow)

    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    import meanflow as official  # Gsunshine/meanflow/meanflow.py
    from models import models_dit

    class TinyNet(nn.Module):
        """`tiny_u` as the official loss calls its network; its parameters are `random_params`' arrays."""

        @nn.compact
        def __call__(self, x, t, h, y, train=False, key=None):
            del train, key  # the tiny network has no dropout
            p = {k: self.param(k, lambda _, a=a: jnp.asarray(a)) for k, a in PARAMS.items()}
            return tiny_u(p, x, t, h, y)

    # MeanFlow.setup builds getattr(models_dit, model_str)(name="net", class_dropout_prob=0.0).
    models_dit.TinyNet = lambda name, class_dropout_prob: TinyNet(name=name)
    record: dict = {}
    normal = jax.random.normal

    def recording_normal(key, shape=(), dtype=jnp.float32):
        out = normal(key, shape, dtype)
        if tuple(shape) == SHAPE:  # ε; t and r are drawn as [b, 1, 1, 1]
            record["noise"] = out
        return out

    class Recorded(official.MeanFlow):
        """The official module, its draws recorded on their way out."""

        def sample_tr(self, bz):
            t, r = super().sample_tr(bz)
            record.update(t=t, r=r)
            return t, r

        def cond_drop(self, v_t, v_g, labels):
            y_inp, v_g = super().cond_drop(v_t, v_g, labels)
            record["y_inp"] = y_inp
            return y_inp, v_g

    jax.random.normal = recording_normal
    rng = np.random.default_rng(0)
    PARAMS = random_params(rng)
    x = (0.7 * rng.standard_normal(SHAPE)).astype(np.float32)
    labels = rng.integers(0, NUM_CLASSES, SHAPE[0]).astype(np.int32)
    out = {"x": x, "labels": labels, **{f"param_{k}": v for k, v in PARAMS.items()}}
    for case, hp in CASES.items():
        module = Recorded(
            model_str="TinyNet",
            model_config={},
            num_classes=NUM_CLASSES,
            guidance_eq="cfg",
            **{k: v for k, v in hp.items() if k != "seed"},
        )
        variables = module.init(
            {"params": jax.random.PRNGKey(0), "gen": jax.random.PRNGKey(1)}, x, jnp.zeros(SHAPE[0]), labels
        )
        rngs = {"gen": jax.random.PRNGKey(hp["seed"])}

        def loss_of(params):
            return module.apply({"params": params}, x, labels, method=module.forward, rngs=rngs)

        (loss, parts), grads = jax.value_and_grad(loss_of, has_aux=True)(variables["params"])
        drop = np.asarray(record["y_inp"]) == NUM_CLASSES
        if not (drop.any() and not drop.all()):
            raise SystemExit(
                f"case {case}: seed {hp['seed']} dropped {drop.sum()} of {drop.size}; pick one that drops some, not all"
            )
        out |= {
            f"{case}_t": np.asarray(record["t"]).reshape(-1),
            f"{case}_r": np.asarray(record["r"]).reshape(-1),
            f"{case}_noise": np.asarray(record["noise"]),
            f"{case}_drop": drop,
            f"{case}_loss": np.asarray(loss),
            f"{case}_v_loss": np.asarray(parts["v_loss"]),
            **{f"{case}_grad_{k}": np.asarray(g) for k, g in grads["net"].items()},
            f"{case}_hparams": np.array(
                [hp[k] for k in ("omega", "kappa", "t_start", "t_end", "norm_p", "norm_eps")], np.float64
            ),
        }
        print(
            f"{case}: loss {float(loss):.6g}, r<t on {int(np.sum(out[f'{case}_r'] < out[f'{case}_t']))}, "
            f"dropped {int(drop.sum())}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
