"""Rendering judged results, never judging them: JUnit, summary and compare tables
(``render``, ``perf_compare``), the self-contained HTML report (``html``) with its overview
(``overview``), per-cell performance (``perf_section``) and load (``load_section``) sections."""
