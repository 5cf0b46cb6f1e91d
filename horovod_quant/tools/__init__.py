"""Applications of the package, outside its layers (docs/dev/architecture.md): they may import
any layer, and no layer imports them.

* :mod:`.predict`: will compression pay on a cluster? (``python -m horovod_quant.predict``,
  docs/will-it-pay.md).
* :mod:`.simulated`: n workers' gradient averaging in one process, as the optimizer does it
  (accuracy at 8 to 64 workers on one machine).
"""
