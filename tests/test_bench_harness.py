"""benchmarks/harness.py: the ratios BENCHMARKS.md quotes and the loop the step benchmarks time are
what their docstrings say (rates against hand-computed figures; the step loop's blocking order)."""

from runs import ROOT, script_module


def harness():
    return script_module("benchmarks/harness.py")


def test_rates_are_items_over_summed_seconds_and_paired_rounds():
    # eqxdiff: 8 items in 2 s then 4 s -> 16 / 6; torch: 4 s, 4 s -> 16 / 8; paired torch/eqxdiff 2, 1
    out = harness().rates({"eqxdiff": [2.0, 4.0], "torch": [4.0, 4.0]}, 8, "images")
    assert out["eqxdiff_images_per_s"] == 2.667 and out["torch_images_per_s"] == 2.0
    assert out["eqxdiff_round_images_per_s"] == [4.0, 2.0] and out["torch_round_images_per_s"] == [2.0, 2.0]
    assert out["ratio"] == round(2.667 / 2.0, 3)
    assert out["paired_ratio_median"] == 1.5
    alone = harness().rates({"eqxdiff": [2.0], "torch": []}, 8, "images")  # the peer not run: no ratio
    assert alone == {"eqxdiff_images_per_s": 4.0, "eqxdiff_round_images_per_s": [4.0]}


def test_alternate_runs_each_side_once_per_round_in_order():
    calls = []
    sides = {name: (lambda name=name: calls.append(name) or len(calls)) for name in ("a", "b")}
    assert harness().alternate(sides, 3) == {"a": [1, 3, 5], "b": [2, 4, 6]}
    assert calls == ["a", "b"] * 3
    calls.clear()  # rotated: round r starts at side r, each side's seconds still in round order
    sides = {name: (lambda name=name: calls.append(name) or len(calls)) for name in ("a", "b", "c")}
    assert harness().alternate(sides, 4, rotate=True) == {"a": [1, 6, 8, 10], "b": [2, 4, 9, 11], "c": [3, 5, 7, 12]}
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]


class Loss:
    """A step's loss that records when the loop blocks on it."""

    def __init__(self, step: int, log: list):
        self.step, self.log = step, log

    def block_until_ready(self):
        self.log.append(("block", self.step))
        return self


def test_steps_in_flight_keeps_at_most_two_steps_dispatched():
    log = []

    def step(state, batch):
        log.append(("dispatch", batch))
        return state + 1, {"loss": Loss(batch, log)}

    state, metrics = harness().steps_in_flight(step, 0, range(3))
    assert state == 3 and metrics["loss"].step == 2
    # step i is dispatched before step i-1 is waited for; the last is waited for at the end
    assert log == [("dispatch", 0), ("dispatch", 1), ("block", 0), ("dispatch", 2), ("block", 1), ("block", 2)]


def test_bench_xla_cpu_option_sides_add_typed_options_to_the_shipped_set(monkeypatch):
    import pytest

    from eqxdiff import xla_cpu

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its sibling modules, as when run as a script
    bench = script_module("benchmarks/bench_xla_cpu.py")
    side = "option:xla_cpu_enable_fast_math=true+xla_cpu_prefer_vector_width=512+xla_cpu_max_isa=AVX2"
    assert bench.side_options(side) == {
        "xla_cpu_enable_fast_math": True,
        "xla_cpu_prefer_vector_width": 512,
        "xla_cpu_max_isa": "AVX2",
    }
    assert bench.side_switches(side) == xla_cpu.DEFAULT and bench.side_switches("devices:1") == xla_cpu.DEFAULT
    assert bench.side_options("only:llvm_o1") == {} and bench.side_switches("only:llvm_o1") == {"llvm_o1"}
    assert bench.side_devices("shipped") == 1 and bench.side_devices("devices:1") == 1
    with pytest.raises(SystemExit, match="option:NAME=VALUE"):
        bench.side_options("option:xla_cpu_enable_fast_math")
    with pytest.raises(SystemExit, match="--cpu_devices"):
        bench.side_devices("devices:99")


def test_the_tpu_benchmarks_dit_flops_are_the_papers():
    """bench_tpu's model FLOPs: the DiT paper's Table 4 forward GFLOPs (multiply-adds) at 256² (32×32×4 latents,
    patch 2, 256 tokens): S/2 6.06, B/2 23.01, L/2 80.7, XL/2 118.6 — counted from the shapes."""
    bench = script_module("benchmarks/bench_tpu.py")
    for size, paper in (("S", 6.06), ("B", 23.01), ("L", 80.7), ("XL", 118.6)):
        hidden, depth, _ = bench.DIT_SIZES[size]
        assert abs(bench.dit_forward_macs(hidden, depth, 256) / 1e9 - paper) < 0.03, size


def test_the_tpu_benchmarks_vit_count_is_the_published_one():
    """bench_tpu's REPA tower count (`vit_forward_macs`) on ViT-B/16 at 224² (197 tokens): the 17.6 GMACs the ViT
    tables give (timm's vit_base_patch16_224); at /14 and 224² (DINOv2-B, REPA's tower) 257 tokens."""
    bench = script_module("benchmarks/bench_tpu.py")
    assert abs(bench.vit_forward_macs(768, 12, 197, patch=16) / 1e9 - 17.6) < 0.1
    assert bench.DINOV2_BASE["hidden_size"] == 768 and bench.DINOV2_BASE["patch_size"] == 14
