"""Nightly history: every run's judged figures kept in one SQLite file (``store``), the
series per cell and metric with the first run of each sustained change and the build
difference behind it (``trends``), and a static dashboard page (``dashboard``)."""
