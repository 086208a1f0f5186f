"""Saving in the background: the CheckpointManager (host staging, a writer thread, its own process
group) and retention (what to keep, read leases)."""
