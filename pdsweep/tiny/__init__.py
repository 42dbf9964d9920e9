"""pdsweep's own tiny checkpoints (``checkpoints``: generated, no download), their training
(``train``) and the offline task they are trained and judged on (``arith``: ``pdsweep_arith``)."""
