"""The megatron wing: the `megatron` TrainBackend (backend.py) and what only it uses.

Importing the wing imports no megatron-core: every module imports it on use, so the package loads on a CPU box
without it.
"""
