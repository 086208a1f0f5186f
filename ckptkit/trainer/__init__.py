"""The reference trainer: a Llama-style model trained with TP x PP x DP (ZeRO 0-3) through ckptkit.

It is a user of the public ckptkit API like any other trainer, and the source of real sharded
checkpoints for the end-to-end tests.
"""
