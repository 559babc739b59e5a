"""One training step's machinery: the hooks and lazy init (state), a fully_shard
call's parameters and lifecycle verbs (param_group), one parameter's life (param), the
per-root communication context (comm_context), streams, the collectives, and the
gradient reduction."""
