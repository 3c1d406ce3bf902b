"""The contract layer, at the bottom of the package: what the lifecycle core and every engine
backend share and neither owns.

Operations (``ops``), outcomes (``outcome``), the exceptions, the values every layer speaks and
their checks (``values``: tags, pause modes), engine URLs (``urls``), incarnations and the
disagreement of records and engine (``identity``), the logger (``events``), and the engine seam
(``seam``, over the barrier's wait in ``gather``) that backends register their transports with.
It imports no other layer of the package, nor Ray, nor httpx.
"""
