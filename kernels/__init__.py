"""CUDA sources (``*.cu``, ``*.cuh``), installed as the package ``horovod_quant.kernels``.

This file only makes the folder a regular package so that
``importlib.resources.files("horovod_quant.kernels")`` resolves in editable installs too
(setup.py maps ``horovod_quant.kernels`` to this folder). It contains no code.
"""
