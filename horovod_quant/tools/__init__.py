"""Applications of the package, outside its layers (docs/dev/architecture.md): they may import
any layer, and no layer imports them.

* :mod:`.predict`: will compression pay on a cluster? (``python -m horovod_quant.predict``,
  docs/will-it-pay.md).
"""
