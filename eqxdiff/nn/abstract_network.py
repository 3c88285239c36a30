"""A network's structure without its weights, traced once per constructor and configuration.

Every loader of a published format (`from_diffusers`, `from_transformers`, `from_pytorch_fid`, `load_dit`, ...)
reads the file's tensors into the network's abstract module, `eqx.filter_eval_shape(cls, config, key=...)`.
That traces the whole constructor (every layer's init: BENCHMARKS.md "Test suite" has its cost), and one process
often loads the same folder again (a notebook, sampling after training, the tests); `abstract_network` traces it
once and hands back the same abstract module after that. `remembered_structure` is the same memory for a
structure another function traces (eqxdiff/run/rebuild.py's run network: its constructor around a condition).
"""

import json
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

MAX_ENTRIES = 64  # abstract modules are small (a ShapeDtypeStruct per leaf); the oldest goes first past this
_CACHE: OrderedDict[tuple, Any] = OrderedDict()


def abstract_network(constructor: Callable, *args: Any, **kwargs: Any) -> Any:
    """`eqx.filter_eval_shape(constructor, *args, key=jax.random.key(0), **kwargs)`, remembered per (constructor,
    the arguments' canonical JSON, the jax flags that change dtypes or key shapes). Shared between callers: safe,
    since an abstract module is immutable (frozen fields, ShapeDtypeStruct leaves). Arguments that are not plain
    JSON values (None, bool, int, float, str, lists, tuples, dicts with str keys) are traced every call."""
    described = canonical_json((args, kwargs))
    trace = lambda: eqx.filter_eval_shape(constructor, *args, key=jax.random.key(0), **kwargs)  # noqa: E731
    return trace() if described is None else remembered_structure((constructor, described), trace)


def remembered_structure(key: tuple, trace: Callable[[], Any]) -> Any:
    """`trace()` (an abstract module), remembered per (`key`, the jax flags that change dtypes or key shapes).
    `key` must name everything the structure depends on: hashable values compared by equality (a canonical JSON
    string, `canonical_json`) or by identity (a constructor)."""
    cache_key = (key, jax.config.jax_enable_x64, str(jax.config.jax_default_prng_impl))
    if cache_key in _CACHE:
        _CACHE.move_to_end(cache_key)
        return _CACHE[cache_key]
    abstract = trace()
    _CACHE[cache_key] = abstract
    while len(_CACHE) > MAX_ENTRIES:
        _CACHE.popitem(last=False)
    return abstract


def canonical_json(value: Any) -> str | None:
    """`value` as JSON with its types kept (a tuple is not a list, True not 1: a constructor may tell them apart)
    and dict keys sorted; None for a value that is not plain JSON data."""
    try:
        return json.dumps(_tagged(value), allow_nan=True)
    except TypeError:
        return None


def _tagged(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return [type(value).__name__, value]
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_tagged(v) for v in value]]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return ["dict", [[k, _tagged(value[k])] for k in sorted(value)]]
    raise TypeError(f"not plain JSON data: {type(value).__name__}")
