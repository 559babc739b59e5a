"""``python3 benchmarks/gpu_check [--out DIR] [--only ROW,...] [--list] [--device cpu]``.

Python runs a folder's ``__main__.py`` with the folder itself first on ``sys.path``,
where its modules would shadow others by their bare names (``report``, ``graph``); the
rows import ``gpu_check.*`` and ``common.*`` (``benchmarks/``), ``dtensor_fsdp`` and
``tests._c10d`` (the repository: this checkout's package, not an installed one, as the
lent machines have none). Both replace it, for this process and the ranks it spawns
(spawn hands them ``sys.path``).
"""

import sys
from pathlib import Path

_FOLDER = Path(__file__).resolve().parent
_BENCHMARKS = _FOLDER.parent
if sys.path and Path(sys.path[0]).resolve() == _FOLDER:
    del sys.path[0]
sys.path[:0] = [str(_BENCHMARKS), str(_BENCHMARKS.parent)]

from gpu_check.check import main

sys.exit(main())
