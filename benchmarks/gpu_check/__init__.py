"""The GPU check: in one command, everything about dtensor_fsdp that only a GPU shows.

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check --out $OUT

``check.py`` holds the table of rows and the command line (see its docstring); a row is
a function in one of:

- ``rows.py``: ours against torch's ``fully_shard`` and the plain model, per layout;
- ``probes.py``: one mechanism each (memory across steps, quantized comm, ``plan()``);
- ``frameworks.py``, ``post_training.py``, ``graph.py``: accelerate, post-training's
  phase offload and weight stream, graph mode's targets;
- ``jobs.py``: the repo's own commands (``train.py``, ``bench_train.py``) under torchrun;

built from ``training.py`` (one rank's training runs and peak meter), ``compare.py``
(bitwise and tolerance comparisons), ``launch.py`` (ranks and commands under a
deadline) and ``report.py`` (outcomes, the table, the exit status).
"""
