"""The trace formats ``synth`` writes (a module of its own: the command line names them without
importing the writer, which pulls in synthesis)."""

FORMATS = ("chakra", "json")
