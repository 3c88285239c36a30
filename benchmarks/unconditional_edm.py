"""train/main.py's `prepare` and `loss_fn` bound to EDM without labels: the objective the step
benchmarks train with (bench_train.py, bench_train_vs_flaxdiff.py, bench_remat_memory.py), so
they time and measure exactly what the script trains. Batches are {"image": uint8 [b, h, w, c]}.
"""

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "train"))
import main as train_main  # noqa: E402  (train/main.py)

from eqxdiff.run.conditions import NoCondition  # noqa: E402
from eqxdiff.diffusion import EDMPreconditioning, EDMSchedule  # noqa: E402


def unconditional_edm():
    """(prepare, loss_fn) for `eqxdiff.training.make_train_step`."""
    schedule = EDMSchedule()
    prepare = functools.partial(train_main.prepare, condition=NoCondition(), schedule=schedule, cond_dropout=0.0)
    loss_fn = functools.partial(train_main.loss_fn, schedule=schedule, parameterization=EDMPreconditioning())
    return prepare, loss_fn
