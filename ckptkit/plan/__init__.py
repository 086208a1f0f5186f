"""Plans (pure, no I/O, no torch): which source bytes fill which target boxes (``load``), who writes
which box in which file (``save``), and the files another topology would have saved (``reshard``)."""
