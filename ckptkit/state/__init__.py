"""The state a trainer hands over: nested dicts (``tree``), ShardedTensor boxes (``sharded``) and
the torch side of them (``torch_io``: dtypes, zero-copy byte views). Only ``torch_io`` imports torch."""
