"""Bytes in and out of checkpoints: checksums (whole files and blocks), the one engine that reads
planned boxes into byte buffers, and the one writer that streams a planned file while hashing."""
