"""``python -m nbdist.forecast``: the forecast's own process (see nbdist.forecast.fake)."""

from .fake import main

main()
