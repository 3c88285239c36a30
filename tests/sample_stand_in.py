"""`python tests/sample_stand_in.py FLAGS`: train/sample.py with test_fid's stand-in feature network in
place of InceptionV3 (whose compile in every process would dominate a multi-process test); what
`train/launch_local.py --script tests/sample_stand_in.py` runs in each process."""

import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
sys.path[:0] = [str(ROOT / "train"), str(ROOT / "tests"), str(ROOT)]  # the last for tests.eval.test_fid

import sample  # noqa: E402 — train/sample.py, from the path set above
from tests.eval.test_fid import projection  # noqa: E402

sample.exit_on_user_error(lambda: sample.main(sample.parse_args(), features_fn=projection))
