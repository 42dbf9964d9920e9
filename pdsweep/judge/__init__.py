"""After a run, the rules; each verdict topic in one module holding its checks:
``accuracy``, ``consistency``, ``transfer`` (counters, READ pattern, UCX transports), ``load``,
``flaky``, and ``agreement`` (the run's records agree). ``gate`` is the registry: the verdict
types, the ordered checks (:func:`~pdsweep.judge.gate.checks_for`) and ``gate_run``. ``facts``
is one cell's judged view, ``perf`` the A/B performance verdict, ``compare`` run against run.
Rendering them is :mod:`pdsweep.report`."""
