"""What a deployed cell is measured with: lm-eval accuracy (``accuracy``, ``evalproc``,
``evaltasks``), the PD-vs-single-instance consistency probe (``consistency``), vLLM's
``/metrics`` (``metrics``), the phases of one cell (``phases``) and the verdicts written
from its raw results (``verdicts``)."""
