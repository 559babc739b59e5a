"""Post-training (RL) on fully-sharded models: the trainer's full weights streamed to an
inference engine, generation on the trainer, and the trainer's state moved off the
device between phases ([docs/post_training.md](../../docs/post_training.md)).

Built on the core's public seams (groups, their sharded buffers, one
`FSDPParamGroup.move_sharded_buffer`); the core never imports this package.

- `stream_weights(model, bucket_mb=..., dtype=..., name_map=..., rank=...)`: buckets of
  ``(name, full tensor)`` pairs, at most two buckets alive (stream.py); `Target`,
  `llama_to_hf`, `hf_llama_config` (names.py).
- `send_buckets`, `receive_buckets`, `load_weights`: the buckets across a process
  group, into an engine's model (transfer.py).
- `keep_unsharded(model)`: one all-gather per group for a whole ``generate()``
  (generation.py).
- `offload_states(model, optimizer)`, `reload_states(offloaded)`: parameters, gradients
  and optimizer state to pinned host memory and back (offload.py).
"""

from .generation import keep_unsharded
from .names import NameMap, Target, hf_llama_config, llama_to_hf, rope_pairs_to_halves, same_names
from .offload import OffloadedStates, offload_states, reload_states
from .plan import PARAM_DTYPE
from .stream import Bucket, stream_weights
from .transfer import load_weights, receive_buckets, send_buckets

__all__ = [
    "PARAM_DTYPE",
    "Bucket",
    "NameMap",
    "OffloadedStates",
    "Target",
    "hf_llama_config",
    "keep_unsharded",
    "llama_to_hf",
    "load_weights",
    "offload_states",
    "receive_buckets",
    "reload_states",
    "rope_pairs_to_halves",
    "same_names",
    "send_buckets",
    "stream_weights",
]
