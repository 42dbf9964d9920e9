"""After a run, the rules: one cell's judged view (``facts``), the gate (``gate``) and its
checks, the A/B performance verdict (``perf``), run-vs-run comparison (``compare``).
Rendering them (tables, JUnit, summaries, the HTML report) is ``pdsweep.report``."""
