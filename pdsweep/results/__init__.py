"""The results layout on disk: a run directory's and a cell's files and their atomic writers
(``layout``), and the types each results file must have when read (``schema``). Every stage
that writes or reads a run imports it; it imports nothing above ``core``."""
