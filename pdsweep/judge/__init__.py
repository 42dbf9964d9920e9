"""After a run: one cell's judged view (``facts``), the gate (``gate``), run-vs-run comparison
(``compare``), JUnit / summary / compare tables (``render``) and the report with plots
(``report``)."""
