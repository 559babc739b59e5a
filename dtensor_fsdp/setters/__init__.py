"""FSDPModule's methods by job, as functions its class body binds (fsdp_module.py):
when a tree reshards, prefetches and syncs (schedule), what and how its collectives
communicate (comm), and what watches them (observe); groups reads a module's states and
groups for them. Defined apart so that ``FSDPModule`` keeps torch's class layout (no
bases of its own: ``FSDP<cls>.__mro__[2]`` is ``cls``)."""
