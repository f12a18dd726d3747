"""The ``tiercheck`` command line and the demo."""
