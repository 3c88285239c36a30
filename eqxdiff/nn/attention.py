"""Scaled dot-product attention, softmax(q kᵀ / sqrt(d)) v, on `[b, n, heads, d]` tokens: the one entry point
of every network's attention, its form chosen here, by backend and shape (DESIGN.md, rule 6).

- `plain`: `jax.nn.dot_product_attention`, XLA's path: logits and softmax in float32 even for bf16 inputs.
  The reference the other forms are tested against, and the form wherever no other is chosen.
- `query_blocks` (XLA:CPU): the queries QUERY_BLOCK at a time, the blocks unrolled. One block's float32
  logits `[b, heads, QUERY_BLOCK, m]` stay in the CPU's cache where all n rows would not (SD's 64×64
  latents: n = m = 4096, 512 MiB of logits at batch 2), and XLA:CPU runs a rolled loop of the blocks several
  times slower than the same blocks unrolled (BENCHMARKS.md, "SD UNet forward"). Chosen on the CPU where one
  head's logits reach QUERY_BLOCKS_FROM elements.
- `flash` (TPU): Pallas flash attention (Dao et al. 2022; `jax.experimental.pallas.ops.tpu.flash_attention`):
  logits and probabilities live in the core's VMEM only, never in HBM, in the forward and the backward pass.
  On a TPU it runs where both lengths are whole blocks of 128 and the queries reach FLASH_FROM (BENCHMARKS.md
  "On a TPU v5e": faster than XLA's form at SD's 4096 tokens, slower at DiT's 256). GSPMD does not split a
  Pallas call: on several devices a Pallas form runs per device (`per_device`, a shard_map over the batch)
  where the traced program has a mesh in context that splits the batch evenly (the train step sets its mesh),
  else XLA's form. Its blocks: the largest whole number of 128 tokens dividing the sequence, up to FLASH_BLOCK in
  the forward pass and FLASH_BACKWARD_BLOCK in the backward. From FLASH_LANES_FROM queries, where the heads tile
  the 128 lanes (SD 2's and SDXL's heads of 64), its forward pass reads them side by side, all heads a grid step
  (`eqxdiff/nn/attention_flash_lanes.py`, blocks of FLASH_LANES_BLOCK); a gradient takes Pallas' kernel.
- `one_block` (TPU): a Pallas kernel per pass with each head's whole sequence in one block, for short sequences
  (`eqxdiff/nn/attention_one_block.py`: no online softmax, one backward kernel, nothing but q, k, v kept).
  A TPU takes it up to ONE_BLOCK_CHOSEN_UP_TO logits a head, whole blocks of 128, unmasked (BENCHMARKS.md "On a
  TPU v5e": faster than XLA's form and flash's at DiT's 256 tokens, where flash's grid of one (batch, head) pair a
  step is mostly overhead).

`attention_form(name)` forces one form while functions are traced (tests, benchmarks); a function already
traced keeps the form it was traced with. `forward_mode()` marks code that `jax.jvp` differentiates (MeanFlow's
target): the Pallas forms' gradient is a custom_vjp, which JAX cannot differentiate forward, so none is chosen there.
"""

import contextlib
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec
from jaxtyping import Array, Bool, Float

from eqxdiff.nn.attention_flash_lanes import block_size, flash_lanes
from eqxdiff.nn.attention_flash_lanes import takes as flash_lanes_takes
from eqxdiff.nn.attention_one_block import one_block

FORMS = ("plain", "query_blocks", "flash", "one_block")
QUERY_BLOCK = 128  # queries per block of `query_blocks`
QUERY_BLOCKS_FROM = 2**20  # n·m logits per head from which the CPU takes query blocks (SD's 32² and 64² levels)
FLASH_FROM = 1024  # queries from which a TPU takes flash attention
# Flash's largest query and key block in the forward pass and in the backward: the forward takes fewer, larger grid
# steps (BENCHMARKS.md "On a TPU v5e": 1024 faster than 512 at 1024 and 4096 tokens); the backward as trained with.
FLASH_BLOCK = 1024
FLASH_BACKWARD_BLOCK = 512
# Queries from which flash's forward reads heads that tile the lanes side by side (attention_flash_lanes.py): at
# 4096 tokens it saves the transposes and a grid step per head; at 1024 Pallas' kernel with one block is faster.
FLASH_LANES = True
FLASH_LANES_FROM = 4096
FLASH_LANES_BLOCK = 512  # its blocks: at 1024 SDXL's heads' scratch and logits overflow the core's VMEM
ONE_BLOCK_CHOSEN_UP_TO = 256 * 256  # logits a head up to which a TPU takes one_block: the shapes measured faster
# A remat policy can keep the attention's output under this name (eqxdiff/nn/remat.py, "attention").
ATTENTION_NAME = "attention"

_forced: list[str] = []
_forward_mode: list[bool] = []


@contextlib.contextmanager
def attention_form(name: str) -> Iterator[None]:
    """Every attention traced inside takes the form `name` (one of FORMS), whatever the backend. The Pallas forms
    (`flash`, `one_block`) off a TPU run in Pallas' interpreter (slow, for tests): trace, differentiate, compile
    and run inside the block."""
    if name not in FORMS:
        raise ValueError(f"Unknown attention form {name!r}; choose one of {FORMS}")
    with contextlib.ExitStack() as stack:
        if name in ("flash", "one_block") and platform() != "tpu":
            from jax.experimental.pallas import tpu as pltpu

            stack.enter_context(pltpu.force_tpu_interpret_mode())
        _forced.append(name)
        try:
            yield
        finally:
            _forced.pop()


@contextlib.contextmanager
def forward_mode() -> Iterator[None]:
    """Attention traced inside may be differentiated by `jax.jvp`: the chosen form is one of XLA's (a custom_vjp,
    the Pallas forms' gradient, has no forward-mode rule). A form forced by `attention_form` still wins."""
    _forward_mode.append(True)
    try:
        yield
    finally:
        _forward_mode.pop()


def platform() -> str:
    """Where arrays made now go: the device of a `jax.default_device(...)` block, else JAX's default backend."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend()
    return device if isinstance(device, str) else device.platform


def chosen_form(n: int, m: int, masked: bool, batch: int = 1) -> str:
    """The form `attention` takes for n queries and m keys (a batch of `batch`) on `platform()` (see the module's
    text)."""
    if _forced:
        return _forced[-1]
    backend = platform()
    if backend == "cpu" and n > QUERY_BLOCK and n * m >= QUERY_BLOCKS_FROM:
        return "query_blocks"
    if (
        backend == "tpu"
        and not _forward_mode
        and not masked
        and n % 128 == 0
        and m % 128 == 0
        and _kernel_takes(batch, backend)
    ):
        if n >= FLASH_FROM:
            return "flash"
        if n * m <= ONE_BLOCK_CHOSEN_UP_TO:
            return "one_block"
    return "plain"


def _kernel_takes(batch: int, backend: str) -> bool:
    """Whether a Pallas kernel can run: on one device, or on each device's share of the batch where the traced
    program has a mesh in context (the train step's) that splits the batch evenly (`per_device`)."""
    if jax.device_count(backend) == 1:
        return True
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and batch % mesh.size == 0


def per_device(kernel, *operands: Array) -> Array:
    """`kernel(*operands)`, on each device's share of the batch (the operands' first axis) where a mesh of several
    devices is in context: GSPMD does not split a Pallas call, `jax.shard_map` runs one per device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return kernel(*operands)
    spec = PartitionSpec(mesh.axis_names)
    return jax.shard_map(kernel, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)(*operands)


def attention(
    q: Float[Array, "b n h d"],
    k: Float[Array, "b m h d"],
    v: Float[Array, "b m h d"],
    mask: Bool[Array, "b 1 n m"] | None = None,
) -> Float[Array, "b n h d"]:
    """softmax(q kᵀ / sqrt(d) + log mask) v per head; `mask` False removes a key (every form but flash takes
    it; a masked call never takes flash). Output in v's dtype, named ATTENTION_NAME for remat policies."""
    form = chosen_form(q.shape[1], k.shape[1], mask is not None, q.shape[0])
    if form == "flash":
        if mask is not None:
            raise ValueError("attention: the flash form takes no mask; use the plain form for masked attention")
        out = per_device(flash, q, k, v)
    elif form == "one_block":
        if mask is not None:
            raise ValueError("attention: the one_block form takes no mask; use the plain form for masked attention")
        out = per_device(one_block, q, k, v)
    elif form == "query_blocks":
        out = query_blocks(q, k, v, mask)
    else:
        out = jax.nn.dot_product_attention(q, k, v, mask=mask)
    return checkpoint_name(out, ATTENTION_NAME)


def query_blocks(
    q: Float[Array, "b n h d"],
    k: Float[Array, "b m h d"],
    v: Float[Array, "b m h d"],
    mask: Bool[Array, "b 1 n m"] | None = None,
) -> Float[Array, "b n h d"]:
    """The plain form, the queries QUERY_BLOCK at a time (a Python loop: unrolled); every row's softmax runs
    over all m keys, so the rows are the plain form's."""
    n, block = q.shape[1], QUERY_BLOCK
    rows = lambda i: None if mask is None else mask[:, :, i : i + block]  # noqa: E731
    blocks = [jax.nn.dot_product_attention(q[:, i : i + block], k, v, mask=rows(i)) for i in range(0, n, block)]
    return jnp.concatenate(blocks, axis=1)


def flash(
    q: Float[Array, "b n h d"], k: Float[Array, "b m h d"], v: Float[Array, "b m h d"]
) -> Float[Array, "b n h d"]:
    """Flash attention on `[b, n, h, d]` tokens, n and m whole blocks of 128: Pallas' TPU kernel on the heads in
    front; with FLASH_LANES, from FLASH_LANES_FROM queries where the heads tile the 128 lanes, the forward pass
    reads them side by side (`eqxdiff/nn/attention_flash_lanes.py`) and a gradient still takes Pallas' kernel. Off a
    TPU it runs inside `attention_form("flash")` only, which turns Pallas' interpreter on."""
    n, m, heads, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    if FLASH_LANES and n >= FLASH_LANES_FROM and flash_lanes_takes(n, m, heads, d):
        return flash_lanes(q, k, v, heads_in_front_flash, FLASH_LANES_BLOCK)
    return heads_in_front_flash(q, k, v)


def heads_in_front_flash(
    q: Float[Array, "b n h d"], k: Float[Array, "b m h d"], v: Float[Array, "b m h d"]
) -> Float[Array, "b n h d"]:
    """Pallas' TPU flash attention (`[b, h, n, d]` operands: the heads moved in front and back), blocks of up to
    FLASH_BLOCK queries and keys forward and FLASH_BACKWARD_BLOCK backward, its own backward pass."""
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash

    n, m, d = q.shape[1], k.shape[1], q.shape[-1]
    if n % 128 or m % 128:
        raise ValueError(f"attention: flash takes whole blocks of 128 queries and keys; got n={n}, m={m}")
    bq, bk = block_size(n, FLASH_BLOCK), block_size(m, FLASH_BLOCK)
    bq_back, bk_back = block_size(n, FLASH_BACKWARD_BLOCK), block_size(m, FLASH_BACKWARD_BLOCK)
    sizes = pallas_flash.BlockSizes(
        block_q=bq,
        block_k_major=bk,
        block_k=bk,
        block_b=1,
        block_q_major_dkv=bq_back,
        block_k_major_dkv=bk_back,
        block_k_dkv=bk_back,
        block_q_dkv=bq_back,
        block_k_major_dq=bk_back,
        block_k_dq=bk_back,
        block_q_dq=bq_back,
    )
    heads_first = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
    out = pallas_flash.flash_attention(
        heads_first(q), heads_first(k), heads_first(v), sm_scale=d**-0.5, block_sizes=sizes
    )
    return heads_first(out)
