"""``python -m horovod_quant.predict``: the predictor's command line, which lives in
:mod:`horovod_quant.tools.predict` (its ``main``; docs/will-it-pay.md)."""
import sys

from .tools.predict import main

if __name__ == "__main__":
    sys.exit(main())
