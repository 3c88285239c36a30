"""Post-hoc EMA (eqxdiff/training/phema.py, the step's power-function EMAs, train/posthoc_ema.py): the math
against NVlabs/edm2's training/phema.py (transcribed below as the reference) and against closed forms, the
step's EMAs against EDM2's update over the weights the step made, and a reconstruction against an EMA that
was tracked directly."""

import json
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from scipy.integrate import quad

from runs import TINY, assert_bitwise_equal, saved_arrays, train_here

from eqxdiff.checkpoint import CheckpointError
from eqxdiff.ema_snapshots import EmaSnapshots
from eqxdiff.sharding import batch_sharding, make_mesh
from eqxdiff.training import adamw_cosine, create_train_state, make_train_step
from eqxdiff.training.phema import (
    gamma_to_sigma_rel,
    one_minus_beta,
    posthoc_coefficients,
    profile_inner_products,
    sigma_rel_to_gamma,
    update_power_emas,
)
import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts


# ---- The reference: NVlabs/edm2, training/phema.py (Karras et al., "Analyzing and Improving the Training
# Dynamics of Diffusion Models", CVPR 2024), transcribed for this test only.
# Copyright (c) 2024, NVIDIA CORPORATION & AFFILIATES. All rights reserved. Licensed under Creative Commons
# Attribution-NonCommercial-ShareAlike 4.0 (http://creativecommons.org/licenses/by-nc-sa/4.0/).
def edm2_exp_to_std(exp):
    exp = np.float64(exp)
    return np.sqrt((exp + 1) / (exp + 2) ** 2 / (exp + 3))


def edm2_std_to_exp(std):
    std = np.float64(std)
    tmp = std.flatten() ** -2
    exp = [np.roots([1, 7, 16 - t, 12 - t]).real.max() for t in tmp]
    return np.float64(exp).reshape(std.shape)


def edm2_power_function_correlation(a_ofs, a_std, b_ofs, b_std):
    a_exp = edm2_std_to_exp(a_std)
    b_exp = edm2_std_to_exp(b_std)
    t_ratio = a_ofs / b_ofs
    t_exp = np.where(a_ofs < b_ofs, b_exp, -a_exp)
    t_max = np.maximum(a_ofs, b_ofs)
    num = (a_exp + 1) * (b_exp + 1) * t_ratio**t_exp
    den = (a_exp + b_exp + 1) * t_max
    return num / den


def edm2_power_function_beta(std, t_next, t_delta):
    return (1 - t_delta / t_next) ** (edm2_std_to_exp(std) + 1)


def edm2_solve_posthoc_coefficients(in_ofs, in_std, out_ofs, out_std):  # => [in, out]
    in_ofs, in_std = np.broadcast_arrays(in_ofs, in_std)
    out_ofs, out_std = np.broadcast_arrays(out_ofs, out_std)
    rv = lambda x: np.float64(x).reshape(-1, 1)  # noqa: E731
    cv = lambda x: np.float64(x).reshape(1, -1)  # noqa: E731
    A = edm2_power_function_correlation(rv(in_ofs), rv(in_std), cv(in_ofs), cv(in_std))
    B = edm2_power_function_correlation(rv(in_ofs), rv(in_std), cv(out_ofs), cv(out_std))
    X = np.linalg.solve(A, B)
    return X / np.sum(X, axis=0)


def edm2_power_function_emas(thetas, std):
    """PowerFunctionEMA.update after each of the weights `thetas` [T, ...] (float64): cur_nimg = t images
    seen after step t, batch_size = 1 (p_ema.lerp_(p_net, 1 - beta)); the EMA after every step, [T, ...]."""
    ema, out = np.array(thetas[0], np.float64), []  # the copy of the net it starts from; β_1 = 0 forgets it
    betas = edm2_power_function_beta(std, t_next=np.arange(1, len(thetas) + 1), t_delta=1)
    for beta, theta in zip(betas, thetas):
        ema = ema + (1 - beta) * (theta - ema)
        out.append(ema)
    return np.stack(out)


def edm2_power_function_ema(thetas, std):
    return edm2_power_function_emas(thetas, std)[-1]


# ---- end of the reference

SIGMA_RELS = [0.005, 0.01, 0.02, 0.05, 0.07, 0.1, 0.15, 0.2, 0.28]


def test_gamma_is_edm2s_and_the_papers():
    for s in SIGMA_RELS:
        gamma = sigma_rel_to_gamma(s)
        assert gamma == pytest.approx(float(edm2_std_to_exp(s)), rel=1e-12)
        assert gamma_to_sigma_rel(gamma) == pytest.approx(s, rel=1e-12)
        assert gamma_to_sigma_rel(gamma) == pytest.approx(float(edm2_exp_to_std(gamma)), rel=1e-12)
    # The paper's §3.1: σ_rel 0.05 and 0.10 are γ = 16.97 and 6.94.
    assert round(sigma_rel_to_gamma(0.05), 2) == 16.97 and round(sigma_rel_to_gamma(0.10), 2) == 6.94
    for bad in (0.0, -0.1, 0.29, 1.0):
        with pytest.raises(ValueError, match="sigma_rel must be in"):
            sigma_rel_to_gamma(bad)


def test_profile_inner_products_are_the_integrals_and_edm2s():
    def profile(t, gamma):
        return lambda tau: (gamma + 1) * tau**gamma / t ** (gamma + 1) if tau <= t else 0.0

    for (t_a, s_a), (t_b, s_b) in [
        ((40, 0.05), (40, 0.1)),
        ((12, 0.1), (40, 0.05)),
        ((36, 0.2), (8, 0.02)),
        ((20, 0.07), (20, 0.07)),
    ]:
        g_a, g_b = sigma_rel_to_gamma(s_a), sigma_rel_to_gamma(s_b)
        pa, pb = profile(t_a, g_a), profile(t_b, g_b)
        integral = quad(lambda tau: pa(tau) * pb(tau), 0, min(t_a, t_b), epsabs=0, epsrel=1e-12, limit=200)[0]
        ours = float(profile_inner_products(t_a, g_a, t_b, g_b))
        assert ours == pytest.approx(integral, rel=1e-9)
        assert ours == pytest.approx(float(edm2_power_function_correlation(t_a, s_a, t_b, s_b)), rel=1e-12)
    # Large t and γ: no overflow (t^γ alone is inf in float64).
    big = profile_inner_products(4e6, sigma_rel_to_gamma(0.005), 3e6, sigma_rel_to_gamma(0.01))
    assert np.isfinite(big) and big > 0


@pytest.mark.parametrize("step", [40, 20])
def test_coefficients_are_edm2s_on_the_same_snapshot_schedule(step):
    """The tiny job's schedule (profiles 0.05 and 0.10 every 4 steps), any σ_rel, at the last snapshot and a
    middle one; EDM2 counts images (ofs = step × batch): the solve does not depend on the unit."""
    steps = [s for s in range(4, 41, 4) if s <= step for _ in (0, 1)]
    stds = [0.05, 0.10] * (len(steps) // 2)
    out = [0.02, 0.05, 0.07, 0.1, 0.2]
    ours = posthoc_coefficients(steps, stds, step, out)
    assert ours.shape == (len(steps), len(out))
    theirs = edm2_solve_posthoc_coefficients(np.array(steps) * 16, stds, step * 16, out)
    np.testing.assert_allclose(ours, theirs, rtol=1e-8, atol=1e-8 * np.abs(theirs).max())
    np.testing.assert_allclose(ours.sum(axis=0), 1.0, rtol=1e-12)
    # A profile that was tracked, at a snapshot's step: that snapshot alone.
    np.testing.assert_allclose(ours[:, 1], np.eye(len(steps))[len(steps) - 2], atol=1e-9)


def test_one_minus_beta_is_edm2s_and_keeps_its_digits_at_large_t():
    for s in (0.05, 0.1):
        gamma = sigma_rel_to_gamma(s)
        for t in (1, 2, 3, 10, 1000, 10**6, 10**7):
            want = 1 - edm2_power_function_beta(s, t_next=t, t_delta=1)
            assert float(one_minus_beta(gamma, jnp.int32(t))) == pytest.approx(float(want), rel=2e-6), t


def test_update_is_edm2s_power_function_ema_and_its_closed_form():
    """eqxdiff's update over T given weight vectors equals EDM2's (float64) and Σ_t w_t θ_t with
    w_t = (t/T)^(γ+1) - ((t-1)/T)^(γ+1) (the power profile integrated over each step)."""
    T, rng = 50, np.random.default_rng(0)
    thetas = np.cumsum(rng.normal(size=(T, 6)), axis=0).astype(np.float32)
    sigma_rels = (0.05, 0.1)
    gammas = tuple(sigma_rel_to_gamma(s) for s in sigma_rels)
    model = eqx.nn.Linear(3, 1, key=jax.random.key(0))  # 3 + 1 parameters ... weight [1, 3] and bias [1]

    def as_model(theta):
        return eqx.tree_at(lambda m: (m.weight, m.bias), model, (jnp.asarray(theta[:3])[None], jnp.asarray(theta[3:4])))

    emas = (model, model)
    update = jax.jit(lambda emas, m, t: update_power_emas(emas, m, gammas, t))
    for t in range(1, T + 1):
        emas = update(emas, as_model(thetas[t - 1]), jnp.int32(t))
    for ema, s, gamma in zip(emas, sigma_rels, gammas):
        got = np.concatenate([np.asarray(ema.weight)[0], np.asarray(ema.bias)])
        ref = edm2_power_function_ema(thetas[:, :4].astype(np.float64), s)
        t = np.arange(1, T + 1)
        closed = ((t / T) ** (gamma + 1) - ((t - 1) / T) ** (gamma + 1)) @ thetas[:, :4].astype(np.float64)
        np.testing.assert_allclose(ref, closed, rtol=1e-10)
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


def test_a_reconstruction_equals_the_ema_tracked_directly():
    """A random walk of weights over 4000 steps, snapshots of 0.05 and 0.10 every 100 (EDM2's setting in
    small): σ_rel 0.07 rebuilt from them equals the 0.07 EMA tracked step by step, to 1e-3 of how far that
    EMA is from the last weights (measured: 3e-5); 0.05 itself is its last snapshot."""
    T, every, rng = 4000, 100, np.random.default_rng(1)
    thetas = np.cumsum(rng.normal(size=(T, 64)), axis=0)
    emas = {r: edm2_power_function_emas(thetas, r) for r in (0.05, 0.07, 0.1)}  # [T, 64] each: after each step
    inputs = [(s, r) for s in range(every, T + 1, every) for r in (0.05, 0.1)]
    snapshots = np.stack([emas[r][s - 1] for s, r in inputs])
    weights = posthoc_coefficients([s for s, _ in inputs], [r for _, r in inputs], T, [0.05, 0.07])
    rebuilt = weights.T @ snapshots
    for k, s in enumerate((0.05, 0.07)):
        direct = emas[s][-1]
        error = np.linalg.norm(rebuilt[k] - direct) / np.linalg.norm(direct - thetas[-1])
        assert error < (1e-12 if s == 0.05 else 1e-3), (s, error)


def test_posthoc_sums_every_profile_of_each_snapshot(tmp_path):
    """train/posthoc_ema.py's reconstruct: snapshots of two profiles at steps 100, 200, 300, each profile's model
    its own numbers; σ_rel 0.07 and 0.2 are Σ_i w_i · snapshot_i over all six (w: posthoc_coefficients of their
    steps and profiles), the sum written out here in float64 — each snapshot's first profile summed twice differs."""
    from posthoc_ema import reconstruct  # train/posthoc_ema.py

    rng = np.random.default_rng(0)
    like = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    inputs, arrays = [(s, r) for s in (100, 200, 300) for r in (0.05, 0.1)], []
    with EmaSnapshots(tmp_path / "phema", async_save=False) as snapshots:
        for step in (100, 200, 300):
            emas = []
            for _ in range(2):
                w, b = rng.normal(size=(2, 3)).astype(np.float32), rng.normal(size=2).astype(np.float32)
                emas.append(eqx.tree_at(lambda m: (m.weight, m.bias), like, (jnp.asarray(w), jnp.asarray(b))))
                arrays.append(np.concatenate([b, w.ravel()]).astype(np.float64))  # bias, then weight, as compared below
            snapshots.save(step, tuple(emas), {"sigma_rels": [0.05, 0.1]})
        abstract = eqx.filter_eval_shape(lambda: like)
        models, weights, got_inputs = reconstruct(snapshots, 300, (0.07, 0.2), abstract, None)
    expected_weights = posthoc_coefficients([s for s, _ in inputs], [r for _, r in inputs], 300, [0.07, 0.2])
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-12)
    assert [(s, r) for s, _, r in got_inputs] == inputs and [k for _, k, _ in got_inputs] == [0, 1] * 3
    for k, model in enumerate(models):
        expected = sum(expected_weights[i, k] * arrays[i] for i in range(len(inputs)))
        ours = np.concatenate([np.asarray(model.bias, np.float64), np.asarray(model.weight, np.float64).ravel()])
        np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())


@pytest.mark.parametrize("layout", [True, False], ids=["layout", "written_before_layouts"])
def test_a_snapshot_that_does_not_fit_the_model_is_named_before_its_arrays_are_read(tmp_path, layout):
    """EmaSnapshots.restore checks the target against the step's layout item, or orbax's metadata for a snapshot
    written without one (which still restores); a mismatch names the leaf, the step and the folder."""
    emas = (eqx.nn.Linear(4, 3, key=jax.random.key(0)), eqx.nn.Linear(4, 3, key=jax.random.key(1)))
    with EmaSnapshots(tmp_path) as snapshots:
        snapshots.save(5, emas, {"sigma_rels": [0.05, 0.1]})
        snapshots.wait()
        assert (tmp_path / "5" / "layout").is_dir()
        if not layout:
            shutil.rmtree(tmp_path / "5" / "layout")
        restored = snapshots.restore(5, eqx.filter_eval_shape(lambda: emas), None)
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(emas), strict=True))
        wider = eqx.filter_eval_shape(lambda: (emas[0], eqx.nn.Linear(5, 3, key=jax.random.key(1))))
        says = r"step 5 .* does not fit this run's model: 1\.weight: saved \(\(3, 4\), 'float32'\), "
        says += r"this run has \(\(3, 5\), 'float32'\)"
        with pytest.raises(CheckpointError, match=says):
            snapshots.restore(5, wider, None)
        if layout:  # a torn layout item: a CheckpointError naming the step, as for checkpoints
            (tmp_path / "5" / "layout" / "metadata").write_text("{not json")
            with pytest.raises(CheckpointError, match=r"Step 5 in .*: cannot read the layout of its emas"):
                snapshots.restore(5, eqx.filter_eval_shape(lambda: emas), None)


def fit_loss(model, batch, key):
    """Finite, but a NaN gradient where p = 0 (tests/core/test_train_step.py's sqrt_term_loss)."""
    fit = jnp.mean((jax.vmap(model)(batch["x"]) - 1.0) ** 2)
    return fit + 0.0 * jnp.sum(jnp.sqrt(jnp.abs(model.weight[0, 0]) * batch["p"]))


def test_the_step_tracks_edm2s_power_function_emas_sharded_like_the_params():
    """8 steps of a one-matmul step on (data=2, fsdp=4), the 4th skipped (a NaN gradient): each EMA equals
    EDM2's update over the weights after each step (the skipped step's: the kept ones), laid out as the
    parameters are."""
    mesh, sigma_rels = make_mesh(-1, 4), (0.05, 0.1)
    make_model = lambda key: eqx.nn.Linear(4, 4, key=key)  # noqa: E731 — a quick compile
    optimizer, schedule = adamw_cosine(1e-1, 100, 2)
    state, shardings = create_train_state(make_model, optimizer, jax.random.key(0), mesh, 8, num_phema=2)
    assert len(state.phema) == 2 and len(shardings.phema) == 2
    assert state.phema[0].weight.sharding == state.model.weight.sharding
    assert not state.model.weight.sharding.is_fully_replicated  # FSDP: the check above is not trivially true
    step = make_train_step(
        prepare=lambda batch, key: batch,
        loss_fn=fit_loss,
        optimizer=optimizer,
        lr_schedule=schedule,
        ema_decay=0.9,
        state_shardings=shardings,
        batch_sharding=batch_sharding(mesh),
        seed=0,
        phema_gammas=tuple(sigma_rel_to_gamma(s) for s in sigma_rels),
    )
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    history = []
    for i in range(8):
        batch = {"x": x, "p": np.full(8, 0.0 if i == 3 else 1.0, np.float32)}
        state, metrics = step(state, jax.tree.map(lambda a: jax.device_put(a, batch_sharding(mesh)), batch))
        assert bool(metrics["finite"]) == (i != 3)
        history.append(np.concatenate([np.asarray(state.model.weight).ravel(), np.asarray(state.model.bias)]))
    np.testing.assert_array_equal(history[3], history[2])
    for ema, s in zip(state.phema, sigma_rels):
        got = np.concatenate([np.asarray(ema.weight).ravel(), np.asarray(ema.bias)])
        ref = edm2_power_function_ema(np.stack(history).astype(np.float64), s)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
        assert ema.weight.sharding == state.model.weight.sharding


def orbax_restore_args(path):
    """Restore arguments reading every array of the orbax PyTree item at `path` as host numpy (from its metadata)."""
    tree = ocp.PyTreeCheckpointer().metadata(path).item_metadata.tree
    return jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)


def orbax_arrays(path, restore_args=None) -> dict[str, np.ndarray]:
    """Every array of an orbax PyTree item, by path, as host numpy (tests/runs.py's saved_arrays, any item).
    `restore_args`: `orbax_restore_args` of an item of the same layout (its metadata not read again; orbax refuses
    an item whose tree differs from them)."""
    restore_args = orbax_restore_args(path) if restore_args is None else restore_args
    restored = ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(restored)[0]}


def flat(arrays: dict[str, np.ndarray], prefix: str, keys: list[str]) -> np.ndarray:
    return np.concatenate([arrays[prefix + k].ravel() for k in keys]).astype(np.float64)


@pytest.mark.slow  # three short runs of the tiny job, a snapshot after every step
def test_a_real_run_rebuilds_its_tracked_ema_and_resumes_bitwise(tmp_path, capsys, monkeypatch):
    """The tiny job tracking σ_rel 0.05, 0.07, 0.10: (1) 0.07 rebuilt from the snapshots of 0.05 and 0.10 alone
    equals the tracked 0.07 to 1e-3 of its distance from the last weights (relative to the weights
    themselves, the issue's measure, far less), and 0.05 rebuilt from all equals the tracked one; (2) sample.py's
    --ema loads the rebuilt model; (3) stopped at step 6 and resumed, the run's checkpoint and every snapshot
    equal the uninterrupted run's bitwise."""
    import posthoc_ema  # train/posthoc_ema.py
    from eqxdiff.run.rebuild import load_run

    steps, half = 12, 6  # 0.07's rebuild measured 3.7e-4 of its bar's distance; 8 steps: 1.4e-3, over the 1e-3 bar
    flags = [*TINY, "--phema_sigma_rels", "0.05,0.07,0.10", "--phema_every", 1, "--ckpt_every", half]
    whole, split = tmp_path / "whole", tmp_path / "split"
    train_here("--run_dir", whole, *flags, "--steps", steps)
    shutil.copytree(whole, split)  # as if it had stopped after step half's checkpoint and snapshot
    shutil.rmtree(split / "checkpoints" / str(steps))
    for s in range(half + 1, steps + 1):
        shutil.rmtree(split / "phema" / str(s))
    train_here("--run_dir", split, *flags, "--steps", steps)  # resumes from step half

    state = saved_arrays(whole, steps)  # also the tracked EMAs and the weights the rebuilt ones are measured against
    assert_bitwise_equal(saved_arrays(split, steps), state)
    assert sorted(int(p.name) for p in (whole / "phema").iterdir()) == list(range(1, steps + 1))
    like = orbax_restore_args(whole / "phema" / str(steps) / "emas")  # one layout for all: one that differs fails
    for s in range(half + 1, steps + 1):  # 1..half were copied; the resumed run wrote these
        snapshot = lambda run: orbax_arrays(run / "phema" / str(s) / "emas", like)  # noqa: E731
        assert_bitwise_equal(snapshot(split), snapshot(whole))

    def posthoc(*argv):
        posthoc_ema.main(posthoc_ema.parse_args(["--run_dir", str(whole), *argv]))

    reads = []  # each snapshot's meta is read once (a request per read on a bucket)
    meta = EmaSnapshots.meta
    monkeypatch.setattr(EmaSnapshots, "meta", lambda self, s: reads.append((str(self.directory), s)) or meta(self, s))
    posthoc("--sigma_rel", "0.07", "--from_sigma_rels", "0.05,0.1")
    phema = sorted(s for d, s in reads if d == str(whole / "phema"))
    assert phema == list(range(1, steps + 1)), phema
    monkeypatch.undo()
    # 16 samples: the scorecard's sampler program at the run's guidance is the FID sweep's below (chunks of 16)
    posthoc("--sigma_rel", "0.05,0.2", "--sweep", "--num", "16", "--steps", "2")
    table = capsys.readouterr().out.split("sweep: 16 samples each")[1].splitlines()
    assert [line.split()[0] for line in table[2:4]] == ["0.05", "0.2"] and "lowest fd: sigma_rel" in table[4]
    unguided = posthoc_ema.parse_args(
        ["--run_dir", str(whole), "--sigma_rel", "0.05", "--sweep", "--num", "16", "--steps", "2", "--guidance", "1"]
    )
    posthoc_ema.sweep(unguided, whole, steps)  # main's, minus the solve made above: other samples, unguided
    unguided = capsys.readouterr().out.split("sweep: 16 samples each")[1].splitlines()
    assert "guidance 1" in unguided[0] and unguided[2].split()[0] == "0.05" and unguided[2] != table[2]
    assert_sweep_fid_is_sample_fid(whole, steps, tmp_path, capsys)
    for index, sigma_rel in ((1, "0.07"), (0, "0.05")):
        rebuilt = orbax_arrays(whole / "posthoc_ema" / sigma_rel / str(steps) / "emas")
        keys = sorted(k.removeprefix("[0]") for k in rebuilt)
        got, tracked = flat(rebuilt, "[0]", keys), flat(state, f"['phema'][{index}]", keys)
        last = flat(state, "['model']", keys)
        error = np.linalg.norm(got - tracked)
        assert error <= 1e-3 * np.linalg.norm(tracked - last), (sigma_rel, error / np.linalg.norm(tracked - last))
        assert error <= 1e-3 * np.linalg.norm(tracked)

    run = load_run(whole, mesh=make_mesh(-1, 1), ema=0.07)
    assert run.step == steps
    loaded = jax.tree.leaves(eqx.filter(run.ema, eqx.is_inexact_array))
    rebuilt = orbax_arrays(whole / "posthoc_ema" / "0.07" / str(steps) / "emas")
    assert len(loaded) == len(rebuilt)
    assert sorted(np.asarray(x).tobytes() for x in loaded) == sorted(x.tobytes() for x in rebuilt.values())


def assert_sweep_fid_is_sample_fid(run_dir, step, tmp_path, capsys):
    """posthoc_ema.py --sweep --fid on the reconstructions of σ_rel 0.05 and 0.2 at `step` (made above): each one's
    printed and recorded FID is train/sample.py --ema sigma_rel=S --fid's, the same samples through the same stand-in
    network; the lowest is marked."""
    import posthoc_ema  # train/posthoc_ema.py
    import sample  # train/sample.py
    from tests.eval.test_fid import projection, stand_in_reference

    ref = stand_in_reference(tmp_path / "ref.npz", dataset="digits", image_shape=(8, 8, 1))
    # 12 samples in one chunk of 16 (the last 4 rows padding): the scorecard sweep's program above
    fid = ["--fid", ref, "--inception", "unused", "--num", "12", "--batch_size", "16", "--steps", "2", "--seed", "3"]
    swept_out, alone_out = tmp_path / "swept.jsonl", tmp_path / "alone.jsonl"
    argv = ["--run_dir", str(run_dir), "--sigma_rel", "0.05,0.2", "--sweep", *fid, "--fid_out", str(swept_out)]
    posthoc_ema.fid_sweep(posthoc_ema.parse_args(argv), run_dir, step, projection)  # main's, minus the solve done above
    table = capsys.readouterr().out.split("sweep: FID of 12 samples each")[1].splitlines()[2:4]
    swept = [json.loads(line) for line in swept_out.read_text().splitlines()]
    assert [r["ema"] for r in swept] == ["sigma_rel=0.05", "sigma_rel=0.2"]
    assert swept[0]["fid"] != swept[1]["fid"]  # the two reconstructions differ: the check below can tell them apart
    lowest = min(range(2), key=lambda i: swept[i]["fid"])
    for i, (line, record) in enumerate(zip(table, swept)):
        assert line.split()[:2] == [record["ema"].removeprefix("sigma_rel="), f"{record['fid']:.4f}"]
        assert line.endswith("<- lowest fid") == (i == lowest)
    record = swept[1]  # the second row (one σ_rel suffices: a swapped or the run's own EMA fails here or above)
    argv = ["--run_dir", str(run_dir), "--ema", record["ema"], *fid, "--fid_out", str(alone_out)]
    sample.main(sample.parse_args(argv), features_fn=projection)
    (alone,) = [json.loads(line) for line in alone_out.read_text().splitlines()]
    keys = ("fid", "precision", "recall", "ema", "seed", "method", "guidance")
    assert {k: alone[k] for k in keys} == {k: record[k] for k in keys}


def test_posthoc_and_sample_refuse_bad_input_in_one_line(tmp_path, capsys):
    import posthoc_ema  # train/posthoc_ema.py
    import sample  # train/sample.py

    for argv, says in (
        (["--sigma_rel", "0.3"], "sigma_rel must be in (0, 0.2887)"),
        (["--sigma_rel", ""], "give at least one relative width"),
        (["--sigma_rel", "0.05", "--from_sigma_rels", "x"], "--from_sigma_rels"),
    ):
        with pytest.raises(SystemExit):
            posthoc_ema.parse_args(["--run_dir", str(tmp_path), *argv])
        assert says in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        posthoc_ema.main(posthoc_ema.parse_args(["--run_dir", str(tmp_path), "--sigma_rel", "0.05"]))
    assert refused.value.code == (
        f"{tmp_path / 'phema'} does not exist: train the run with --phema_sigma_rels "
        "0.05,0.10 (train/main.py) to write post-hoc EMA's snapshots."
    )
    with pytest.raises(SystemExit):  # --fid without --inception (or without --sweep): before anything loads
        posthoc_ema.parse_args(["--run_dir", str(tmp_path), "--sigma_rel", "0.05", "--sweep", "--fid", "r.npz"])
    assert "--fid goes with --sweep and needs --inception FILE" in capsys.readouterr().err
    swept = posthoc_ema.parse_args(["--run_dir", str(tmp_path), "--sigma_rel", "0.05", "--sweep"])
    posthoc_ema.check_sweep(swept, {"dataset": "digits", "num_classes": 10})  # the scorecard's: no --fid needed
    for stored in ({"dataset": "folder:~/pets", "num_classes": 3}, {"dataset": "digits", "num_classes": 0}):
        with pytest.raises(SystemExit, match="on (folder:~/pets|digits): pass --fid STATS.npz .* to sweep by FID"):
            posthoc_ema.check_sweep(swept, stored)
    for bad in ("0.05", "sigma=0.05", "sigma_rel=x"):
        with pytest.raises(SystemExit):
            sample.parse_args(["--run_dir", str(tmp_path), "--ema", bad])
        assert "argument --ema: takes sigma_rel=S" in capsys.readouterr().err
    assert sample.parse_args(["--run_dir", str(tmp_path), "--ema", "sigma_rel=0.05"]).ema == 0.05
    import main as train_main  # train/main.py

    with pytest.raises(SystemExit):
        train_main.parse_config(["--run_dir", str(tmp_path / "new"), "--phema_sigma_rels", "0.05,0.5"])
    assert "--phema_sigma_rels takes comma-separated relative widths" in capsys.readouterr().err
