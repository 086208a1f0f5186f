"""The operations, each a library function first (the CLI renders them): save, load, verify,
inspect, diff, reshard, listing; with the collective helpers and the code provenance they use."""
