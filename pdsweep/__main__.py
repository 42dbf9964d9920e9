from pdsweep.cli import entry

entry()
